"""Which records ahead of a node's step it waits on (swarm/node/view.py): not those of a peer on a
lineage it refused, nor, after max_wait of fetching nothing, those of the peers it waited on,
until they average with it. Pure, an injected time."""

from __future__ import annotations

import pytest

from swarm.node.progress import PeerProgress
from swarm.node.view import AheadWatch, ahead_problem
from swarm.p2p.identity import Identity

IDS = [Identity.from_seed(bytes([i + 40]) * 32).peer_id for i in range(4)]
A, B, C, D = IDS
MAX_WAIT = 30.0


def record(peer: object, step: int) -> PeerProgress:
    return PeerProgress(peer, step, 0, 10, 0.1, 0.0, False)  # type: ignore[arg-type]


CASES = [
    # (situation, record's step, forked: peer -> refused state's step, believed?)
    ("a peer one step ahead, nothing known against it", 6, {}, True),
    ("a peer ahead on a lineage we refused at its step", 6, {A: 6}, False),
    ("... and at a later step of that lineage", 8, {A: 6}, False),
    ("a peer whose refused state is later than the step it now says (it stepped back)", 6, {A: 7}, True),
    ("a forked peer at our own step: not ahead, not dropped here", 5, {A: 5}, True),
    ("another peer forked: says nothing of this one", 6, {B: 6}, True),
]


@pytest.mark.parametrize(("situation", "step", "forked", "believed"), CASES, ids=[c[0][:50] for c in CASES])
def test_records_ahead_on_a_refused_lineage_are_not_waited_on(
    situation: str, step: int, forked: dict, believed: bool
) -> None:
    why = ahead_problem(record(A, step), 5, forked, AheadWatch(MAX_WAIT))
    assert (why is None) is believed, f"{situation}: {why}"


def test_after_max_wait_of_fetching_nothing_the_peers_ahead_are_not_believed_until_they_average_with_us() -> None:
    watch = AheadWatch(MAX_WAIT)
    assert watch.came_to_nothing(5, 100.0, [A, B]) == frozenset()
    assert watch.came_to_nothing(5, 100.0 + MAX_WAIT - 1, [A, B]) == frozenset()
    assert ahead_problem(record(A, 6), 5, {}, watch) is None
    assert watch.came_to_nothing(5, 100.0 + MAX_WAIT, [A, B]) == {A, B}
    assert "no state came" in ahead_problem(record(A, 6), 5, {}, watch)
    assert ahead_problem(record(C, 6), 5, {}, watch) is None  # a peer we did not wait on
    assert ahead_problem(record(A, 5), 5, {}, watch) is None  # at our step: counted
    watch.averaged_with(frozenset({A, C}))  # a round with A made our state (A is there): believed again
    assert ahead_problem(record(A, 7), 6, {}, watch) is None
    assert ahead_problem(record(B, 7), 6, {}, watch) is not None  # B still is not


def test_the_wait_starts_over_at_another_step_and_after_a_fetch() -> None:
    watch = AheadWatch(MAX_WAIT)
    watch.came_to_nothing(5, 0.0, [A])
    assert watch.came_to_nothing(6, MAX_WAIT, [A]) == frozenset()  # our step moved: a new wait from here
    assert watch.came_to_nothing(6, 2 * MAX_WAIT - 1, [A]) == frozenset()
    watch.fetched()
    assert watch.came_to_nothing(6, 2 * MAX_WAIT, [A]) == frozenset()  # the fetch ended the wait
    assert watch.came_to_nothing(6, 3 * MAX_WAIT, [A, D]) == {A, D}
    assert watch.came_to_nothing(6, 5 * MAX_WAIT, [A, D]) == frozenset()  # a new wait, and both are known
