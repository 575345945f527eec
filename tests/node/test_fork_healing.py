"""A fork's smaller lineage takes the larger one's state (ready.outvoted, grouping.ForkWatch).

Five SwarmNodes in one event loop. At step 1 the swarm is split (each half sees only its own
half's ready records and progress records while it is at that step), so two groups form, of 3 and
of 2: a fork. (Seeing the other half live, the smaller half would not form its group: a leader
leaves no live majority of its last round behind, ready.left_behind.) From step 2
the smaller half still never sees a record of the larger half's state while it matchmakes
(as when it always decides before the larger half's announcements are in, the fork CI saw
persist for 9 steps), but the step-1 FORMED markers stay readable. Without the lineage check the
two halves go on as two states at every step; with it the smaller half fetches the larger one's
state and every later step holds one state."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from swarm.averaging.matchmaking.ready import ReadyView
from swarm.averaging.matchmaking.ready_board import ReadyBoard
from swarm.node.grouping import ForkWatch
from swarm.node.plan import Facts
from swarm.node.view import SwarmView
from swarm.state.keeper import LARGER_LINEAGE
from tests.node.inprocess import LocalSwarm, Running

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]


def split_boards(monkeypatch: pytest.MonkeyPatch, large: list[Running], small: list[Running]) -> None:
    """What each node reads of the step it is matchmaking (a past step's set is read whole), and
    of its peers' progress while it is at step 1."""
    read = ReadyBoard.read
    half = {r.node.peer_id: 0 for r in large} | {r.node.peer_id: 1 for r in small}
    nodes = {r.node.peer_id: r.node for r in (*large, *small)}
    read_progress = SwarmView.read

    def split_progress(self: SwarmView) -> Facts:
        facts = read_progress(self)
        me = self.ctx.averager.host.peer_id
        if me not in half or self.ctx.diloco.outer_step != 1:
            return facts
        return dataclasses.replace(facts, peers=tuple(p for p in facts.peers if half.get(p.peer_id) == half[me]))

    monkeypatch.setattr(SwarmView, "read", split_progress)

    async def partial_read(self: ReadyBoard, step: int) -> ReadyView:
        view = await read(self, step)
        node = nodes.get(self.peer_id)
        if node is None or step != node.diloco.outer_step:
            return view
        mine = half[self.peer_id]
        if step == 1:  # the split: two groups of one state
            return dataclasses.replace(
                view,
                ready={p: m for p, m in view.ready.items() if half.get(p) == mine},
                formed={p: s for p, s in view.formed.items() if half.get(p) == mine},
            )
        if mine == 1:  # the smaller half never sees a record of another state than its own
            own = node.facts.state_sha
            return dataclasses.replace(
                view,
                ready={p: m for p, m in view.ready.items() if m.state == own},
                formed={p: s for p, s in view.formed.items() if s == own},
            )
        return view

    monkeypatch.setattr(ReadyBoard, "read", partial_read)


Events = list[dict[str, Any]]


async def split_run(
    local: LocalSwarm, monkeypatch: pytest.MonkeyPatch, steps: int, healed_from: int
) -> tuple[Events, Events, list[Any]]:
    """Five nodes split 3/2 at step 1 (split_boards), run to `steps`; one state at every step
    from `healed_from` on. Returns the fetches of the smaller half, of the larger, and what each
    node did (for failures' messages)."""
    bootstrap = await local.start_bootstrap()
    nodes = [local.start((bootstrap,), max_outer_steps=steps) for _ in range(5)]
    large, small = nodes[:3], nodes[3:]
    split_boards(monkeypatch, large, small)
    reasons = await local.finish(150)
    assert reasons == ["finished"] * 5
    by_step = local.by_step()
    story = [[(e["event"], e["outer_step"], e["state_sha256"][:6], e.get("group_size"), e.get("reason"))
              for e in n.events if e["event"] in ("outer_step", "fetch")] for n in nodes]  # fmt: skip
    assert len(by_step[1]) == 2, f"the test made no fork at step 1: {story}"
    forks = {step: len(states) for step, states in by_step.items() if step >= healed_from and len(states) > 1}
    assert not forks, f"the fork went on (step: states): {forks}; nodes: {story}"
    fetched = [[e for n in half for e in n.events if e["event"] == "fetch"] for half in (small, large)]
    return fetched[0], fetched[1], story


async def test_the_smaller_half_of_a_fork_takes_the_larger_ones_state(
    local: LocalSwarm, monkeypatch: pytest.MonkeyPatch
) -> None:
    small_fetched, _, story = await split_run(local, monkeypatch, steps=5, healed_from=2)
    # it learns of the fork from matchmaking (the larger group's FORMED markers) or, as soon, from
    # its round mates' state records and their lineage (the test below has only the second)
    assert any(e["reason"] in ("not the swarm's state", LARGER_LINEAGE) for e in small_fetched), story


async def test_a_fork_nothing_in_matchmaking_points_at_heals_by_its_lineages(
    local: LocalSwarm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same split, but the step-1 FORMED markers never tell the smaller half that a larger
    group formed beside its own (ForkWatch finds nothing: markers expired, or reads failed, as in
    a 60-minute soak under load where two lineages ran apart for 50 steps). Both halves step at the
    same pace, so neither is ever behind the other. What is left to heal it is the state records:
    the smaller half sees round mates of its last round of five advertise another state at its
    step, checks that state's lineage, finds more of that round's members signed it than its own,
    and takes it (trust.py rule 5)."""

    async def never(self: ForkWatch, averager: object, step: int) -> bool:
        return False

    monkeypatch.setattr(ForkWatch, "outvoted", never)
    small_fetched, large_fetched, story = await split_run(local, monkeypatch, steps=6, healed_from=4)
    assert any(e["reason"] == LARGER_LINEAGE for e in small_fetched), story
    assert not large_fetched, story  # the larger half never moved
