"""A network split healed after 3 steps: five SwarmNodes in one event loop average together,
then the network splits them into a half of 3 (with the bootstrap) and a half of 2 that cannot
dial each other at all (every connection between the halves is closed and every dial refused,
DHT traffic included), for 3 outer steps. Each half goes on as its own lineage. When the
network heals, the halves find each other again through the DHT, and the merge takes one
lineage: the one whose first round after the fork carries the majority of the last common
round's members (the half of 3). The half of 2 fetches that state and says why; no node ends
on a state that neither half computed, and every step after the merge holds one state."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import pytest

from swarm.dht import DHTConfig
from swarm.node.grouping import LINEAGE_STEPS
from swarm.node.inner_steps import InnerSteps
from swarm.node.training_thread import DataTrainingThread, TrainingThreadFactory
from swarm.p2p import P2PHost
from swarm.p2p.dialer import Dialer
from swarm.p2p.errors import ConnectionLost
from swarm.p2p.maddr import TcpAddress
from tests.node.inprocess import LocalSwarm, Running
from tests.waiting import until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

TOGETHER = 2  # outer steps 0 and 1: one swarm
SPLIT = 3  # steps 2, 3 and 4: two halves
STEPS = 9  # the nodes' run: 4 steps after the heal
REJOIN_S = 1.0
# the smaller half ahead at the heal: by more steps than a node weighs its last rounds by
# (grouping.LINEAGE_STEPS), so no group of the larger half ever forms beside one of them
AHEAD_STEPS = LINEAGE_STEPS + 2
AHEAD_RUN = 16  # that run's steps: the larger half catches up from a step or two after the split
BRAKE_S = 1.0  # the larger half's extra seconds an inner step while split


class Split:
    """Cuts the network between two sets of hosts: while `on`, a dial from one side to an
    address of the other fails as an unreachable address does, and `cut()` closes every
    connection between them (inbound and outbound)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, sides: list[list[P2PHost]]) -> None:
        self.on = False
        self.side_of_dialer = {id(host._dialer): i for i, hosts in enumerate(sides) for host in hosts}
        self.side_of_port = {int(m.rsplit("/tcp/", 1)[1].split("/")[0]): i
                             for i, hosts in enumerate(sides) for h in hosts for m in h.visible_maddrs}  # fmt: skip
        self.hosts = [h for hosts in sides for h in hosts]
        self.side_of_peer = {h.peer_id: i for i, hosts in enumerate(sides) for h in hosts}
        opened = Dialer._open_authenticated
        split = self

        async def open_authenticated(self: Dialer, addr: TcpAddress, *, probe: bool = False) -> Any:
            mine, theirs = split.side_of_dialer.get(id(self)), split.side_of_port.get(addr.port)
            if split.on and mine is not None and theirs is not None and mine != theirs:
                raise ConnectionLost(f"cannot connect to {addr}: the network is split")
            return await opened(self, addr, probe=probe)

        monkeypatch.setattr(Dialer, "_open_authenticated", open_authenticated)

    def cut(self) -> None:
        self.on = True
        for host in self.hosts:
            mine = self.side_of_peer[host.peer_id]
            for peer, conns in list(host._pool.by_peer.items()):
                if self.side_of_peer.get(peer, mine) != mine:
                    for conn in list(conns):
                        conn.close()

    def heal(self) -> None:
        self.on = False


def done(node: Running, step: int) -> bool:
    return max(node.steps(), default=-1) >= step


async def split_after_together(local: LocalSwarm, monkeypatch: pytest.MonkeyPatch, steps: int, *,
                               large_thread: TrainingThreadFactory = DataTrainingThread,
                               ) -> tuple[list[Running], list[Running], Split]:  # fmt: skip
    """Five nodes of a run of `steps`, three (the larger half, with the bootstrap, training with
    `large_thread`) and two, that average together for TOGETHER steps; then the network between
    the halves is cut. Returns the halves and the split, to heal."""
    bootstrap = await local.start_bootstrap()
    # the nodes of the smaller half ping the bootstrap they lost every second, not every 15 s
    rejoin = DHTConfig(rejoin_interval=REJOIN_S)
    large = [local.start((bootstrap,), max_outer_steps=steps, dht_config=rejoin, training_thread=large_thread)
             for _ in range(3)]  # fmt: skip
    small = [local.start((bootstrap,), max_outer_steps=steps, dht_config=rejoin) for _ in range(2)]
    nodes = [*large, *small]
    assert local.bootstrap is not None
    await until(lambda: all(n.node.maddrs for n in nodes), 30, "every node listening", poll=0.05)
    split = Split(monkeypatch, [[local.bootstrap[0], *(n.node.outer_loop.ctx.averager.host for n in large)],
                                [n.node.outer_loop.ctx.averager.host for n in small]])  # fmt: skip
    await until(lambda: all(done(n, TOGETHER - 1) for n in nodes), 90, "the steps together", poll=0.05)
    split.cut()
    return large, small, split


async def test_a_split_healed_after_three_steps_merges_into_the_larger_halfs_lineage(
    local: LocalSwarm, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO)
    large, small, split = await split_after_together(local, monkeypatch, STEPS)
    nodes = [*large, *small]
    await until(lambda: all(done(n, TOGETHER + SPLIT - 1) for n in nodes), 120, "the split steps", poll=0.05)
    split.heal()
    healed_after = max(max(n.steps()) for n in nodes)  # the last step any node took apart
    reasons = await local.finish(150)
    assert reasons == ["finished"] * 5, reasons

    story = [[(e["event"], e["outer_step"], e["state_sha256"][:6], e.get("group_size"), e.get("reason"))
              for e in n.events if e["event"] in ("outer_step", "fetch")] for n in nodes]  # fmt: skip
    by_step = local.by_step()
    together = [by_step[s] for s in range(TOGETHER)]
    assert all(len(states) == 1 for states in together), f"no one swarm before the split: {story}"
    apart = {s: by_step.get(s, set()) for s in range(TOGETHER, TOGETHER + SPLIT)}
    assert any(len(states) == 2 for states in apart.values()), f"the split made no fork: {story}"
    large_states = {e["state_sha256"] for n in large for e in n.steps().values()}
    merged = max(by_step)
    assert by_step[merged] and len(by_step[merged]) == 1, f"no one state at the end: {story}"
    # the halves meet again through the DHT once the smaller half pings the bootstrap it lost
    # (REJOIN_S), and its nodes fetch the larger half's state when it reaches their step: by the
    # second step after the heal (a step here is about 1.5 s)
    after = {s: states for s, states in by_step.items() if s > healed_after + 2}
    assert all(len(states) == 1 for states in after.values()), f"the fork outlived the heal at {healed_after}: {story}"
    small_states = {e["state_sha256"] for n in small for e in n.steps().values()} - large_states
    # "not the swarm's state" when the halves meet at one step; "behind" when the larger half
    # ran ahead meanwhile (the lineage, not the reason, decides what is taken: the log line)
    took = [e for n in small for e in n.events if e["event"] == "fetch"]
    assert took, f"the smaller half never took the larger one's state: {story}"
    assert all(e["state_sha256"] in large_states for e in took), f"took a state the larger half never held: {story}"
    fetched = [e for n in nodes for e in n.events if e["event"] == "fetch"]
    assert not [e for e in fetched if e["state_sha256"] in small_states], f"a node took the smaller half's: {story}"
    assert any("lineage" in r.getMessage() for r in caplog.records if r.levelno >= logging.INFO), "no line says why"


braked = threading.Event()  # while set, BrakedLoop's inner steps are slow


class BrakedLoop(DataTrainingThread):
    """swarm-node's training thread, BRAKE_S slower an inner step while `braked` is set."""

    def __init__(self, steps: InnerSteps, *args: Any, **kwargs: Any) -> None:
        super().__init__(steps, *args, **kwargs)
        permit = steps.wait_for_permit

        def wait_for_permit(timeout: float | None = None) -> bool:
            if braked.is_set():
                time.sleep(BRAKE_S)
            return permit(timeout)

        steps.wait_for_permit = wait_for_permit  # type: ignore[method-assign]


async def test_a_smaller_half_ahead_at_the_heal_steps_back_to_the_larger_halfs_lineage(
    local: LocalSwarm, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other way round: the larger half was slow while split (its inner steps braked), so
    the smaller one is AHEAD_STEPS or more steps ahead when the network heals, and both then train
    at one pace. The larger half never reaches the smaller one's step, and a group of it never
    forms beside the smaller half's last rounds. The smaller half's nodes find the larger
    lineage behind them among the state holders, check its lineage, and step back to it: the
    steps they took apart are lost, and the five average as one group again. (Whether they stay
    one to the run's end is not this test's: once, on a loaded machine, the five split 2 + 2 + 1
    at a later step, and no side holds half of the round before it, the gap of a small round
    whose members split, under one swarm, one state's known gaps.)"""
    caplog.set_level(logging.INFO)
    large, small, split = await split_after_together(local, monkeypatch, AHEAD_RUN, large_thread=BrakedLoop)
    nodes = [*large, *small]
    braked.set()
    try:
        await until(lambda: min(max(n.steps()) for n in small) - max(max(n.steps()) for n in large) >= AHEAD_STEPS,
                    120, f"the smaller half {AHEAD_STEPS} steps ahead", poll=0.05)  # fmt: skip
    finally:
        braked.clear()
    split.heal()
    at_heal = {id(n): (max(n.steps()), len(n.events)) for n in nodes}
    reasons = await local.finish(150)
    assert reasons == ["finished"] * 5, reasons

    story = [[(e["event"], e["outer_step"], e["state_sha256"][:6], e.get("group_size"), e.get("reason"))
              for e in n.events if e["event"] in ("outer_step", "fetch")] for n in nodes]  # fmt: skip
    large_states = {e["state_sha256"] for n in large for e in n.steps().values()}
    since = {id(n): at_heal[id(n)][1] for n in large}
    for n in small:  # each stepped back: after the heal, it fetched a state older than one it had completed
        step, seen = at_heal[id(n)]
        back = [i for i, e in enumerate(n.events) if i >= seen and e["event"] == "fetch" and e["outer_step"] < step]
        assert back, f"the smaller half never stepped back: {story}"
        assert n.events[back[0]]["state_sha256"] in large_states, f"stepped back to another state: {story}"
        since[id(n)] = back[0]
    # from there on, the five average as one again: a step that every node completed in a group
    # of five, on one state (the smaller half's steps beyond the larger half's were of the
    # lineage it left)
    after: dict[int, list[tuple[str, int]]] = {}
    for n in nodes:
        for e in n.events[since[id(n)] :]:
            if e["event"] == "outer_step":
                after.setdefault(e["outer_step"], []).append((e["state_sha256"], e["group_size"]))
    together = [s for s, done in after.items() if len(done) == 5 and set(done) == {(done[0][0], 5)}]
    assert together, f"the halves never averaged as one again: {story}"
    assert any("the steps we took apart are lost" in r.getMessage() for r in caplog.records), "no line says why"


async def test_nodes_that_all_read_their_step_as_forming_still_train_it(
    local: LocalSwarm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the heal above, every node of one half once read its step's records as "the peers
    of our step are matchmaking" (they were the other half's, at the same step number) and joined
    with no inner steps, as a client: nobody could lead and nobody had anything to give, and
    they matchmade again with nothing, forever. Here every node reads step 1 so."""
    from swarm.node import loop
    from swarm.node.plan import JOIN_FORMING, StepPlan

    planned = loop.plan_step
    # each node plans in its own task: held here, so no task's identity is reused by another's
    misread: set[asyncio.Task[Any]] = set()

    def forming_once(facts: Any) -> StepPlan:
        node = asyncio.current_task()
        assert node is not None
        if facts.step == 1 and node not in misread:
            misread.add(node)
            return StepPlan(JOIN_FORMING, "the peers of our step are matchmaking")
        return planned(facts)

    monkeypatch.setattr(loop, "plan_step", forming_once)
    bootstrap = await local.start_bootstrap()
    for _ in range(3):
        local.start((bootstrap,), max_outer_steps=3)
    reasons = await local.finish(90)
    assert reasons == ["finished"] * 3
    # every node that planned step 1 read it as forming once (the first time). A node that came
    # to step 1 after the others had taken it fetched its result and never planned it (under
    # load, one did): at least two planned it, so they were all misled and trained it anyway
    assert len(misread) >= 2, f"the test misled {len(misread)} node(s)"
    by_step = local.by_step()
    assert all(len(states) == 1 for states in by_step.values()), by_step
