"""The DiLoCo benchmark on a busy machine (`scripts/bench/diloco.py --busy N`): the same runs
beside N processes that each spin a core, against the quiet runs of the same seed.

What it reports per configuration: the eval loss of both and their ratio (the target: at most
1.02), the share of outer steps each node spent in a full group (the target: at least 0.95), and
every miss with its reason, read from the nodes' events:

    alone            the node applied its own pseudo-gradient (a group of 1)
    group of m       it averaged with m - 1 others, not with every node
    fetched: REASON  it had no outer_step event for the step: it took the swarm's state after it
                     (the fetch event's reason: behind, missed, ...)
    absent           neither (it had left, or had not started)
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

BUSY_RATIO_TARGET = 1.02  # the busy run's eval loss over the quiet run's, at most
FULL_GROUP_TARGET = 0.95  # the busy run's share of node-steps in a full group, at least


def group_misses(per_node: list[list[dict[str, Any]]], nodes: int) -> list[dict[str, Any]]:
    """Each (node, outer step) that was not in a full group, with why, for the run's steps
    (0 to the last step any node completed)."""
    steps_of = [{e["outer_step"]: e for e in events if e.get("event") == "outer_step"} for events in per_node]
    last = max((max(steps, default=-1) for steps in steps_of), default=-1)
    misses = []
    for index, (events, steps) in enumerate(zip(per_node, steps_of, strict=True)):
        fetches = sorted((e for e in events if e.get("event") == "fetch"), key=lambda e: e["outer_step"])
        for step in range(last + 1):
            done = steps.get(step)
            if done is not None:
                size = done.get("group_size") or 1
                if size >= nodes:
                    continue
                why = "alone" if size == 1 else f"group of {size}"
            else:  # the first fetch of a state past this step carried the node over it
                over = next((f for f in fetches if f["outer_step"] > step), None)
                why = "absent" if over is None else f"fetched: {over.get('reason', '?')}"
            misses.append({"node": index, "outer_step": step, "why": why})
    return misses


def busy_results(quiet: dict[str, list[dict[str, Any]]], busy: dict[str, list[dict[str, Any]]],
                 processes: int) -> dict[str, Any]:  # fmt: skip
    """The comparison of each configuration's busy runs with its quiet ones (medians over repeats)."""
    out: dict[str, Any] = {"processes": processes, "eval_loss": {}, "quiet_eval_loss": {}, "ratio_to_quiet": {},
                           "full_group_share": {}, "misses": {}, "miss_reasons": {}, "run_s": {},
                           "met": {}}  # fmt: skip
    for name, runs in busy.items():
        loss = statistics.median(r["eval_loss"] for r in runs)
        calm = statistics.median(r["eval_loss"] for r in quiet[name])
        share = min(r["full_group_share"] for r in runs)
        misses = [m for r in runs for m in r["misses"]]
        out["eval_loss"][name], out["quiet_eval_loss"][name] = loss, calm
        out["ratio_to_quiet"][name] = loss / calm
        out["full_group_share"][name] = share
        out["misses"][name] = misses
        out["miss_reasons"][name] = dict(Counter(m["why"] for m in misses))
        out["run_s"][name] = statistics.median(r["run_s"] for r in runs)
        out["met"][name] = loss / calm <= BUSY_RATIO_TARGET and share >= FULL_GROUP_TARGET
    return out


def busy_lines(res: dict[str, Any]) -> list[str]:
    """The comparison as lines under the benchmark's table."""
    lines = [f"beside {res['processes']} busy processes (targets: loss <= {BUSY_RATIO_TARGET}x quiet, "
             f"full groups >= {FULL_GROUP_TARGET:.0%}):"]  # fmt: skip
    for name, loss in res["eval_loss"].items():
        reasons = ", ".join(f"{why} x{count}" for why, count in sorted(res["miss_reasons"][name].items())) or "none"
        lines.append(
            f"  {name}: eval {loss:.4f} vs quiet {res['quiet_eval_loss'][name]:.4f} "
            f"({res['ratio_to_quiet'][name]:.4f}x), full groups {res['full_group_share'][name]:.0%}, "
            f"{res['run_s'][name]:.0f}s, misses: {reasons} -> {'met' if res['met'][name] else 'NOT met'}"
        )
    return lines
