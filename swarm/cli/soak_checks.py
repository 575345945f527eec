"""The soak's invariants: pure functions over what the run recorded, each returning its
violations as one line each (empty: it held).

Inputs (soak_run.py records them):
    events   every node's metrics events (swarm/node/events.py's docstring lists them), each with "slot" (the
             node's identity in the soak: node0, node1, ...) added
    churn    what the harness did: {"time", "kind", "slot"}; kinds are the schedule's, plus
             "restart" (the slot started again from its checkpoint), "cont" (SIGCONT) and "leave"
             (the node a join replaced: SIGTERM, never back)
    samples  {"time", "slot", "pid", "rss_bytes", "fds"}: each node process, every few seconds
    logs     slot -> its log's lines (every incarnation's, in order)

The invariants (the soak exits 1 when one breaks):
    one_state       one state_sha256 per outer step among the nodes that completed it
    none_behind     no node more than one step behind the swarm for more than two of the swarm's
                    steps in a row, while it is up (started, not killed or paused)
    in_every_round  a node that finished its inner steps of a step, undisturbed, is in that step's
                    group (the group most nodes averaged in), not alone and not beside it
    no_unseen_deaths  no asyncio task died without its error being handled ("Task exception was
                    never retrieved" and kin); supervised tasks that failed and were restarted
                    (swarm/utils/supervised.py logs them) are counted, not failures
    flat_memory     each node process's RSS and open fds end within 10% of their value after
                    warm-up (growth only; fds get a few of slack for the connections churn opens)
"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

DOWN_KINDS = ("kill", "kill_round", "kill_fetch", "term", "pause", "leave")  # the slot is not up after these
UNSEEN = ("Task exception was never retrieved", "Exception in callback", "Task was destroyed but it is pending",
          "exception was never retrieved")  # fmt: skip
SEEN = "background task"  # Supervised: "background task %r failed (%d time(s)); starting it again"
GROWTH = 0.10
FD_SLACK = 8
BEHIND_STEPS = 2  # lagging more than one step for more than this many swarm steps in a row: stuck

Event = Mapping[str, Any]


def _steps(events: Iterable[Event]) -> list[Event]:
    return [e for e in events if e.get("event") == "outer_step" and isinstance(e.get("outer_step"), int)]


def one_state(events: Sequence[Event]) -> list[str]:
    states: dict[int, Counter[str]] = defaultdict(Counter)
    for e in _steps(events):
        states[e["outer_step"]][str(e.get("state_sha256"))] += 1
    return [
        f"step {step}: {len(shas)} states among the nodes that completed it: "
        + ", ".join(f"{sha[:12]} x{n}" for sha, n in shas.most_common())
        for step, shas in sorted(states.items())
        if len(shas) > 1
    ]


def down_intervals(events: Sequence[Event], churn: Sequence[Event], end: float) -> dict[str, list[tuple[float, float]]]:
    """slot -> the times it was not up: before its first start, and from each kill, term or
    pause to its next start event (or SIGCONT)."""
    starts: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("event") == "start":
            starts[e["slot"]].append(e["time"])
    down: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for slot, times in starts.items():
        down[slot].append((float("-inf"), min(times)))
    conts = defaultdict(list)
    for c in churn:
        if c["kind"] == "cont":
            conts[c["slot"]].append(c["time"])
    for c in churn:
        if c["kind"] not in DOWN_KINDS or c.get("slot") is None:
            continue
        back = conts[c["slot"]] if c["kind"] == "pause" else starts[c["slot"]]
        later = [t for t in back if t > c["time"]]
        down[c["slot"]].append((c["time"], min(later) if later else end))
    return down


def _up(down: Sequence[tuple[float, float]], start: float, end: float, settle: float) -> bool:
    return all(hi + settle < start or lo > end for lo, hi in down)


def none_behind(events: Sequence[Event], churn: Sequence[Event], *, settle_s: float = 10.0) -> list[str]:
    steps = sorted(_steps(events), key=lambda e: e["time"])
    if not steps:
        return []
    end = max(e["time"] for e in events)
    down = down_intervals(events, churn, end)
    held: dict[str, list[tuple[float, int]]] = defaultdict(list)  # slot -> (time, steps it has completed)
    for e in events:
        if e.get("event") == "outer_step" and isinstance(e.get("outer_step"), int):
            held[e["slot"]].append((e["time"], e["outer_step"] + 1))
        elif e.get("event") in ("fetch", "start") and isinstance(e.get("outer_step"), int):
            held[e["slot"]].append((e["time"], e["outer_step"]))
    for rows in held.values():
        rows.sort()
    problems, strikes, swarm = [], Counter[str](), 0
    for e in steps:
        if e["outer_step"] + 1 <= swarm:
            continue
        swarm, now = e["outer_step"] + 1, e["time"]
        for slot, rows in held.items():
            if not _up(down.get(slot, []), now, now, settle_s):
                strikes[slot] = 0
                continue
            i = bisect.bisect_right(rows, (now, float("inf")))
            mine = max((n for _, n in rows[:i]), default=0)
            strikes[slot] = strikes[slot] + 1 if swarm - mine > 1 else 0
            if strikes[slot] == BEHIND_STEPS + 1:
                problems.append(f"{slot}: more than one step behind for {strikes[slot]} swarm steps in a row "
                                f"(holds {mine} steps when the swarm completed {swarm})")  # fmt: skip
    return problems


def in_every_round(events: Sequence[Event], churn: Sequence[Event], inner_steps: int) -> list[str]:
    end = max((e["time"] for e in events), default=0.0)
    down = down_intervals(events, churn, end)
    by_step: dict[int, list[Event]] = defaultdict(list)
    for e in _steps(events):
        by_step[e["outer_step"]].append(e)
    ready: dict[tuple[str, int], float] = {}  # (slot, step) -> when its inner steps were done
    for e in events:
        kind, step = e.get("event"), e.get("outer_step")
        done = kind == "round" or (kind == "progress" and (e.get("inner_step") or 0) >= inner_steps)
        if (done or kind == "outer_step") and isinstance(step, int):
            key = (e["slot"], step)
            ready[key] = min(ready.get(key, e["time"]), e["time"])
    problems = []
    for step, done in sorted(by_step.items()):
        groups = Counter(e.get("group_id") for e in done if e.get("group_id"))
        if not groups:
            continue
        group = groups.most_common(1)[0][0]
        members = [e for e in done if e.get("group_id") == group]
        began = min(e["time"] - float(e.get("round_s") or 0) for e in members)
        ended = max(e["time"] for e in members)
        for (slot, s), at in ready.items():
            if s != step or at > began or not _up(down.get(slot, []), at, ended, 0.0):
                continue
            mine = [e for e in done if e["slot"] == slot]
            if not any(e.get("group_id") == group for e in mine):
                how = (
                    "completed it alone"
                    if any(not e.get("group_id") for e in mine)
                    else ("in another group" if mine else "did not complete it")
                )
                problems.append(f"step {step}: {slot} was ready and up but not in the group of {len(members)} "
                                f"({how})")  # fmt: skip
    return problems


def task_deaths(logs: Mapping[str, Sequence[str]]) -> tuple[list[str], list[str]]:
    """(unseen deaths, seen and restarted failures), one line each."""
    unseen, seen = [], []
    for slot, lines in sorted(logs.items()):
        for line in lines:
            if any(marker in line for marker in UNSEEN):
                unseen.append(f"{slot}: {line.strip()[:300]}")
            elif SEEN in line and "failed" in line:
                seen.append(f"{slot}: {line.strip()[:300]}")
    return unseen, seen


def flat_memory(samples: Sequence[Event], warmup_s: float) -> list[str]:
    """Per node process: the median of its samples in the minute after `warmup_s` of its life
    against the median of its last five; processes too short-lived for both are skipped."""
    by_pid: dict[tuple[str, int], list[Event]] = defaultdict(list)
    for s in samples:
        by_pid[(s["slot"], s["pid"])].append(s)
    problems = []
    for (slot, pid), rows in sorted(by_pid.items()):
        rows = sorted(rows, key=lambda r: r["time"])
        born = rows[0]["time"]
        base = [r for r in rows if warmup_s <= r["time"] - born < warmup_s + 60]
        last = rows[-5:]
        if len(base) < 3 or last[0]["time"] - born < warmup_s + 120:
            continue
        for key, slack in (("rss_bytes", 0), ("fds", FD_SLACK)):
            before = statistics.median(r[key] for r in base)
            after = statistics.median(r[key] for r in last)
            if after > before * (1 + GROWTH) + slack:
                problems.append(f"{slot} (pid {pid}): {key} grew from {before:.0f} to {after:.0f} after warm-up")
    return problems


def check(
    events: Sequence[Event],
    churn: Sequence[Event],
    samples: Sequence[Event],
    logs: Mapping[str, Sequence[str]],
    *,
    inner_steps: int,
    warmup_s: float,
) -> dict[str, list[str]]:
    """Every invariant's violations by name (all empty: the soak passed)."""
    unseen, _ = task_deaths(logs)
    return {
        "one_state": one_state(events),
        "none_behind": none_behind(events, churn),
        "in_every_round": in_every_round(events, churn, inner_steps),
        "no_unseen_deaths": unseen,
        "flat_memory": flat_memory(samples, warmup_s),
    }
