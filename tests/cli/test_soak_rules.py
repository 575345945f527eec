"""The soak's pure parts: the churn schedule (soak_schedule.py) and the invariants over recorded
events (soak_checks.py), on tables of cases."""

from __future__ import annotations

from typing import Any

import pytest

from swarm.cli.soak_checks import flat_memory, in_every_round, none_behind, one_state, task_deaths
from swarm.cli.soak_schedule import (
    END_MARGIN_S,
    KILL_ROUND,
    KINDS,
    LOAD,
    PAUSE,
    RESTARTED,
    WARMUP_S,
    Churn,
    churn_schedule,
    schedule_lag,
)

# --- the schedule ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seed", "run_s", "events_at_least", "events_at_most", "kinds"),
    [
        (0, 60.0, 0, 0, set()),  # shorter than the warm-up: nothing
        (0, WARMUP_S + END_MARGIN_S + 10, 0, 1, None),  # no room for a gap: at most the first draw
        (0, 300.0, 4, 8, None),  # the CI form: a few events, the load burst among them
        (1, 900.0, 20, 40, set(KINDS)),  # a quarter hour: every kind
        (7, 3600.0, 100, 140, set(KINDS)),  # the hour: >= 40 events, >= 10 aimed inside rounds
    ],
)
def test_churn_schedule(seed: int, run_s: float, events_at_least: int, events_at_most: int, kinds: set | None) -> None:
    schedule = churn_schedule(seed, run_s)
    assert events_at_least <= len(schedule) <= events_at_most
    assert list(schedule) == sorted(schedule, key=lambda c: c.at_s)
    for c in schedule:
        assert WARMUP_S <= c.at_s < run_s - END_MARGIN_S or c.kind == LOAD
        if c.kind == PAUSE:
            assert c.seconds >= 10  # longer than a round and the part timeout's floor
        if c.kind in RESTARTED:
            assert 5 <= c.seconds <= 15
    if kinds is not None:
        assert {c.kind for c in schedule} == kinds
    if run_s >= 3600:
        assert sum(c.kind == KILL_ROUND for c in schedule) >= 10
    assert churn_schedule(seed, run_s) == schedule  # a pure function of the seed and the length
    if len(schedule) > 2:
        assert churn_schedule(seed + 1, run_s) != schedule


@pytest.mark.parametrize(
    ("lag", "due_s", "fired_s", "expected", "why"),
    [
        (0.0, 100.0, 100.05, 0.05, "on time (a poll late): the schedule as drawn"),
        (0.0, 100.0, 160.0, 60.0, "an aimed kill that waited 60 s for a round: the events after it wait as long"),
        (60.0, 130.0, 190.0, 60.0, "the next one, fired at its shifted time: still 60 s late, the gap kept"),
        (60.0, 130.0, 200.0, 70.0, "another wait adds to it"),
        (60.0, 130.0, 185.0, 60.0, "never earlier than the events before it ran"),
    ],
)
def test_events_after_an_aimed_kill_that_waited_keep_their_spacing(lag: float, due_s: float, fired_s: float,
                                                                  expected: float, why: str) -> None:  # fmt: skip
    assert schedule_lag(lag, due_s, fired_s) == pytest.approx(expected), why


def test_a_schedule_of_chosen_kinds_deals_only_those() -> None:
    pauses = churn_schedule(1, 300.0, gap_s=17.0, kinds=(PAUSE,))  # the soak of pauses that forked the model
    assert {c.kind for c in pauses} == {PAUSE} and 8 <= len(pauses) <= 16
    assert {c.kind for c in churn_schedule(1, 900.0, kinds=(KILL_ROUND, LOAD))} == {KILL_ROUND, LOAD}
    assert churn_schedule(1, 900.0, kinds=()) == ()


def test_a_bad_churn_is_refused() -> None:
    with pytest.raises(ValueError):
        Churn(1.0, "explode")
    with pytest.raises(ValueError):
        Churn(-1.0, PAUSE)
    with pytest.raises(ValueError):
        churn_schedule(0, 600.0, gap_s=0)
    with pytest.raises(ValueError, match="unknown churn kinds"):
        churn_schedule(0, 600.0, kinds=(PAUSE, "explode"))


# --- the invariants -------------------------------------------------------------------------


def step(slot: str, n: int, t: float, sha: str = "a", group: str | None = "g", round_s: float = 0.5) -> dict[str, Any]:
    return {"slot": slot, "event": "outer_step", "outer_step": n, "time": t, "state_sha256": sha,
            "group_id": group if group is None else f"{group}{n}", "round_s": round_s}  # fmt: skip


def start(slot: str, n: int, t: float) -> dict[str, Any]:
    return {"slot": slot, "event": "start", "outer_step": n, "time": t}


def ready(slot: str, n: int, t: float) -> dict[str, Any]:
    return {"slot": slot, "event": "round", "outer_step": n, "time": t}


TWO = [start("a", 0, 0.0), start("b", 0, 0.0)]


@pytest.mark.parametrize(
    ("events", "broken"),
    [
        ([*TWO, step("a", 0, 10), step("b", 0, 10)], 0),
        ([*TWO, step("a", 0, 10), step("b", 0, 10, sha="b")], 1),  # a fork
        ([*TWO, step("a", 0, 10), step("b", 0, 10), step("a", 1, 20, sha="x"), step("b", 1, 20, sha="y")], 1),
        ([*TWO, step("a", 0, 10)], 0),  # b did not complete it: no second state
    ],
)
def test_one_state(events: list[dict[str, Any]], broken: int) -> None:
    assert len(one_state(events)) == broken


KILL_B = [{"time": 25.0, "kind": "kill", "slot": "b"}]


def swarm_steps(slot: str, steps: range, t0: float = 10.0) -> list[dict[str, Any]]:
    return [step(slot, n, t0 + 10 * n) for n in steps]


@pytest.mark.parametrize(
    ("events", "churn", "broken", "why"),
    [
        ([*TWO, *swarm_steps("a", range(6)), *swarm_steps("b", range(6))], [], 0, "in step"),
        ([*TWO, *swarm_steps("a", range(6)), *swarm_steps("b", range(2))], [], 1, "b stops at 2 while up: stuck"),
        ([*TWO, *swarm_steps("a", range(6)), *swarm_steps("b", range(0, 6, 2))], [], 0, "b one behind, then even"),
        ([*TWO, *swarm_steps("a", range(6)), *swarm_steps("b", range(2))], KILL_B,
         0, "b was killed: down, not stuck"),
        ([*TWO, *swarm_steps("a", range(8)), *swarm_steps("b", range(2)), start("b", 2, 45.0)],
         KILL_B, 1, "b came back at step 2 and stayed there"),
        ([*TWO, *swarm_steps("a", range(8)), *swarm_steps("b", range(2)), start("b", 2, 45.0),
          {"slot": "b", "event": "fetch", "outer_step": 6, "time": 60.0}, *swarm_steps("b", range(6, 8))],
         KILL_B, 0, "b came back and fetched at once"),
        ([*TWO, *swarm_steps("a", range(6)), *swarm_steps("b", range(2))],
         [{"time": 25.0, "kind": "leave", "slot": "b"}], 0, "b left for good when a newcomer joined: down, never back"),
    ],
)  # fmt: skip
def test_none_behind(events: list[dict[str, Any]], churn: list[dict[str, Any]], broken: int, why: str) -> None:
    assert len(none_behind(events, churn, settle_s=0.0)) == broken, why


@pytest.mark.parametrize(
    ("events", "churn", "broken", "why"),
    [
        ([*TWO, ready("a", 0, 9), ready("b", 0, 9), step("a", 0, 10), step("b", 0, 10)], [], 0, "one group"),
        ([*TWO, ready("a", 0, 9), ready("b", 0, 9), step("a", 0, 10), step("b", 0, 10),
          start("c", 0, 0.0), ready("c", 0, 9), step("c", 0, 10, group=None)], [], 1, "c ready, averaged alone"),
        ([*TWO, start("c", 0, 0.0), ready("a", 0, 9), ready("b", 0, 9), ready("c", 0, 9), step("a", 0, 10),
          step("b", 0, 10), step("c", 0, 10, group="other")], [], 1, "c in a group beside the swarm's"),
        ([*TWO, start("c", 0, 0.0), ready("a", 0, 9), ready("b", 0, 9), ready("c", 0, 9), step("a", 0, 10),
          step("b", 0, 10)], [{"time": 9.7, "kind": "kill_round", "slot": "c"}], 0, "c killed inside the round"),
        ([*TWO, start("c", 0, 0.0), ready("a", 0, 9), ready("b", 0, 9), ready("c", 0, 11), step("a", 0, 10),
          step("b", 0, 10)], [], 0, "c was ready only after the round"),
    ],
)  # fmt: skip
def test_in_every_round(events: list[dict[str, Any]], churn: list[dict[str, Any]], broken: int, why: str) -> None:
    assert len(in_every_round(events, churn, inner_steps=20)) == broken, why


def test_task_deaths_tell_unseen_from_supervised() -> None:
    logs = {
        "a": ["INFO all fine", "ERROR asyncio: Task exception was never retrieved"],
        "b": ["ERROR swarm.utils.supervised: background task 'DHT maintenance' failed (1 time(s)); starting it again"],
        "c": ["WARNING step 3: a group of 4 formed beside ours"],
    }
    unseen, seen = task_deaths(logs)
    assert [line.split(":")[0] for line in unseen] == ["a"]
    assert [line.split(":")[0] for line in seen] == ["b"]


def samples(pid: int, rss: list[float], fds: list[int]) -> list[dict[str, Any]]:
    return [{"time": 5.0 * i, "slot": "a", "pid": pid, "rss_bytes": r, "fds": f}
            for i, (r, f) in enumerate(zip(rss, fds, strict=True))]  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "broken", "why"),
    [
        (samples(1, [100.0] * 60, [50] * 60), 0, "flat"),
        (samples(1, [100.0] * 40 + [108.0] * 20, [50] * 60), 0, "within 10%"),
        (samples(1, [100.0] * 40 + [120.0] * 20, [50] * 60), 1, "RSS grew 20%"),
        (samples(1, [100.0] * 60, [50] * 40 + [70] * 20), 1, "fds grew beyond 10% and the slack"),
        (samples(1, [100.0] * 60, [50] * 40 + [58] * 20), 0, "a few fds more: connections churn"),
        (samples(1, [100.0] * 10 + [200.0] * 5, [50] * 15), 0, "too short-lived to judge"),
        (samples(1, [200.0] * 5 + [100.0] * 55, [50] * 60), 0, "the warm-up does not count"),
    ],
)
def test_flat_memory(rows: list[dict[str, Any]], broken: int, why: str) -> None:
    assert len(flat_memory(rows, warmup_s=20.0)) == broken, why
