"""What the keeper remembers of a refused lineage's holders (swarm/state/adoption.py): a holder of
a state whose lineage was refused outright is `forked` (its records ahead are not waited on:
node/view.py); one whose newest round is only pending, or that holds a state of our own lineage,
is not."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from swarm.state import adoption
from swarm.state.adoption import Adoption
from swarm.state.holders import Holder
from swarm.state.lineage import Lineage
from swarm.state.receipts import Receipt
from tests.state.test_lineage import HONEST, IN_SYNC, TOGETHER, A, B, G, X, chain, link


class Book:
    """The lineage book's part that Adoption reads: our lineage, and the candidate's lineage as its
    holders would send it (what a fetch over the wire returns, tested in test_lineage.py)."""

    provisional = False

    def __init__(self, own: Lineage, candidate: Lineage) -> None:
        self.lineage, self.candidate = own, candidate

    async def fetch(self, holders: Sequence[Holder], since: int, step: int) -> tuple[Lineage, list[Receipt]]:
        return self.candidate, []


def holders(*peers: object, step: int) -> list[Holder]:
    return [Holder(p, step, "ab" * 32, ("/ip4/127.0.0.1/tcp/1",), 1) for p in peers]  # type: ignore[arg-type]


CASES = [
    # (situation, our lineage, the candidate, forked?)
    (
        "a round ahead endorsed by none of the round before it: refused, its holders forked",
        IN_SYNC,
        chain(0, G, *HONEST[:3], link(3, "s3", "zero", "xyz")),
        True,
    ),
    (
        "a fork's larger half asked at once (its signatures still coming): pending, not forked",
        chain(0, G, *TOGETHER, link(2, "t2", "m3", "de")),
        chain(0, G, *TOGETHER, link(2, "t2", "n3", "abc", "a")),
        False,
    ),
    (
        "a state not after the one we trust without receipts (our anchor): refused, its holders only behind",
        chain(2, "s2"),
        chain(0, G, *HONEST[:2]),
        False,
    ),
    (
        "a state of our own lineage, behind us: refused, its holders only behind",
        IN_SYNC,
        chain(0, G, *HONEST[:2]),
        False,
    ),
]


@pytest.mark.parametrize(("situation", "own", "candidate", "forked"), CASES, ids=[c[0][:50] for c in CASES])
async def test_the_holders_of_a_refused_lineage_are_forked(
    situation: str, own: Lineage, candidate: Lineage, forked: bool
) -> None:
    adopt = Adoption(Book(own, candidate), vouching=frozenset(), client=False)  # type: ignore[arg-type]
    assert await adopt.linked(holders(A, X, step=candidate.step), candidate.step, "ab" * 32) is None, situation
    assert adopt.forked() == ({A: candidate.step, X: candidate.step} if forked else {}), situation


async def test_forked_holders_are_forgotten_after_forked_s(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(adoption.time, "monotonic", lambda: now[0])
    refused = chain(0, G, *HONEST[:3], link(3, "s3", "zero", "xyz"))
    adopt = Adoption(Book(IN_SYNC, refused), vouching=frozenset(), client=False)  # type: ignore[arg-type]
    await adopt.linked(holders(B, step=4), 4, "ab" * 32)
    now[0] += adoption.FORKED_S - 1
    assert adopt.forked() == {B: 4}
    now[0] += 2
    assert adopt.forked() == {}


async def test_a_forked_peer_that_advertises_another_state_is_forked_no_longer() -> None:
    """It stepped back to our lineage, or moved on: its new state is weighed in turn."""
    refused = chain(0, G, *HONEST[:3], link(3, "s3", "zero", "xyz"))
    adopt = Adoption(Book(IN_SYNC, refused), vouching=frozenset(), client=False)  # type: ignore[arg-type]
    await adopt.linked(holders(A, B, step=4), 4, "ab" * 32)
    adopt.advertised([*holders(A, step=4), Holder(B, 3, "cd" * 32, ("/ip4/127.0.0.1/tcp/1",), 1)])
    assert adopt.forked() == {A: 4}  # A still holds the refused state; B holds another
    adopt.book.candidate = chain(0, G, *HONEST)  # the same holder, a state we take
    assert await adopt.linked(holders(A, step=4), 4, "ef" * 32) is not None
    assert adopt.forked() == {}
