"""Grouping.wait_for_peers: how long a node whose inner steps are done waits for slower peers of
its step before it matchmakes, and when it stops waiting because a group is forming already.

The wait's parts that read the network (the progress book, the step's ready set) are handed in
as small stand-ins with a clock the test moves: the decisions are plan.py's, tested on their own
in test_plan.py; here the loop around them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from swarm.node import grouping as grouping_module
from swarm.node.config import NodeConfig
from swarm.node.grouping import WAIT_RECHECK_S, Grouping
from swarm.node.plan import Facts
from swarm.node.progress import PeerProgress
from swarm.p2p.identity import Identity
from swarm.p2p.peer_id import PeerID

H, STEP = 10, 5
OURS, OTHER = b"\x01" * 32, b"\x02" * 32
SLOW, READY = Identity.generate().peer_id, Identity.generate().peer_id
MATCHMAKING_TIME = 3.0


@dataclass
class Clock:
    """Unix time as the node reads it: each read of the progress book after the first moves it
    on by a recheck interval (WAIT_RECHECK_S), whatever the test's short real sleeps were."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Book:
    clock: Clock
    step_s: float  # how far each refresh moves the clock
    refreshes: int = 0

    async def refresh(self) -> None:
        if self.refreshes:
            self.clock.now += self.step_s
        self.refreshes += 1


@dataclass
class Averager:
    ready: dict[PeerID, bytes]
    reads: list[int] = field(default_factory=list)

    async def announced(self, step: int) -> dict[PeerID, bytes]:
        self.reads.append(step)
        return dict(self.ready)


@dataclass
class Diloco:
    outer_step: int = STEP


@dataclass
class Context:
    config: NodeConfig
    clock: Clock
    book: Book
    averager: Averager
    diloco: Diloco = field(default_factory=Diloco)
    stop: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class View:
    """Our inner steps are done now; SLOW should finish at `slow_finish` (unix time); READY has
    finished its steps and may be matchmaking already (Averager.ready)."""

    clock: Clock
    slow_finish: float

    def read(self) -> Facts:
        now = self.clock.now
        left = max(0.0, self.slow_finish - now)
        slow = PeerProgress(SLOW, STEP, H - round(left), H, 1.0, now, False)
        ready = PeerProgress(READY, STEP, H, H, 1.0, now, False)
        return Facts(step=STEP, inner_steps=H, own_sec=1.0, client=False, peers=(slow, ready), now=now,
                     fresh_for=10.0)  # fmt: skip


@dataclass
class StepState:
    """The state we hold (StepFacts.state_sha): the one we announce."""

    state_sha: bytes = OURS


def grouping(slow_in: float, ready: dict[PeerID, bytes]) -> tuple[Grouping, Context]:
    clock = Clock()
    config = NodeConfig(run_id="wait", inner_steps=H, matchmaking_time=MATCHMAKING_TIME, max_wait=10.0)
    ctx = Context(config, clock, Book(clock, WAIT_RECHECK_S), Averager(ready))
    g = Grouping.__new__(Grouping)  # the wait reads ctx, facts and view only: no fork watch needed
    g.ctx, g.facts, g.view = ctx, StepState(), View(clock, clock.now + slow_in)  # type: ignore[assignment]
    return g, ctx


WAITS = [
    # (situation, the slow peer's finish from now (s), who announced what in the step's ready set,
    #  reads of the progress records until the node matchmakes, reads of the ready set)
    # a wait shorter than a matchmaking window: peers that announced our state earlier form their
    # group within it, before our wait ends (a soak node slept 4.9 s through such a group)
    ("short wait, a peer of our step matchmaking our state: join now", 5.0, {READY: OURS}, 1, 1),
    ("long wait, a peer of our step matchmaking our state: join now", 9.0, {READY: OURS}, 1, 1),
    ("short wait, nobody matchmaking: wait it out", 5.0, {}, 3, 2),
    ("short wait, a peer matchmaking another state: wait it out", 5.0, {READY: OTHER}, 3, 2),
    ("a stranger (no live record of our step) matchmaking our state: wait it out", 5.0,
     {Identity.generate().peer_id: OURS}, 3, 2),
]  # fmt: skip


@pytest.mark.timeout(20)
@pytest.mark.parametrize(("what", "slow_in", "ready", "refreshes", "reads"), WAITS, ids=[w[0] for w in WAITS])
async def test_wait_for_slower_peers(what: str, slow_in: float, ready: dict, refreshes: int, reads: int,
                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(grouping_module, "WAIT_RECHECK_S", 0.01)  # real sleeps; the clock moves by WAIT_RECHECK_S
    g, ctx = grouping(slow_in, ready)
    await asyncio.wait_for(g.wait_for_peers(), 10)
    assert ctx.book.refreshes == refreshes, what
    assert ctx.averager.reads == [STEP] * reads, what
