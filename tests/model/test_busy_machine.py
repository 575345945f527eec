"""The busy-machine comparison of the DiLoCo benchmark (scripts/bench/busy_machine.py): each
node-step outside a full group gets its reason from the nodes' events; the targets are checked."""

from __future__ import annotations

from typing import Any

import pytest

from scripts.bench.busy_machine import busy_lines, busy_results, group_misses


def step(k: int, size: int) -> dict[str, Any]:
    return {"event": "outer_step", "outer_step": k, "group_size": size}


def fetch(k: int, reason: str) -> dict[str, Any]:
    return {"event": "fetch", "outer_step": k, "reason": reason}


MISS_CASES = [
    # (situation, per-node events, misses as (node, step, why))
    ("every node in every group", [[step(0, 2), step(1, 2)], [step(0, 2), step(1, 2)]], []),
    ("a node alone at one step", [[step(0, 2), step(1, 1)], [step(0, 2), step(1, 2)]], [(0, 1, "alone")]),
    ("a smaller group", [[step(0, 2)], [step(0, 2)], [step(0, 3)]], [(0, 0, "group of 2"), (1, 0, "group of 2")]),
    ("a node that missed a step fetched past it",
     [[step(0, 1), fetch(2, "behind"), step(2, 2)], [step(0, 1), step(1, 1), step(2, 2)]],
     [(0, 0, "alone"), (0, 1, "fetched: behind"), (1, 0, "alone"), (1, 1, "alone")]),
    ("a node that left before the last step", [[step(0, 2)], [step(0, 2), step(1, 1)]],
     [(0, 1, "absent"), (1, 1, "alone")]),
]  # fmt: skip


@pytest.mark.parametrize(("what", "per_node", "misses"), MISS_CASES, ids=[c[0] for c in MISS_CASES])
def test_group_misses(what: str, per_node: list[list[dict[str, Any]]], misses: list[tuple[int, int, str]]) -> None:
    found = group_misses(per_node, len(per_node))
    assert [(m["node"], m["outer_step"], m["why"]) for m in found] == misses


def run(loss: float, share: float, *whys: str) -> dict[str, Any]:
    return {"eval_loss": loss, "full_group_share": share, "run_s": 10.0,
            "misses": [{"node": 0, "outer_step": i, "why": w} for i, w in enumerate(whys)]}  # fmt: skip


@pytest.mark.parametrize(
    ("quiet", "busy", "met"),
    [
        (2.0, run(2.03, 1.0), True),  # 1.015x, every group full
        (2.0, run(2.05, 1.0), False),  # 1.025x: over the loss target
        (2.0, run(2.0, 0.9, "alone", "alone"), False),  # groups below 95%
    ],
)
def test_busy_results_check_both_targets(quiet: float, busy: dict[str, Any], met: bool) -> None:
    res = busy_results({"H50_int8": [run(quiet, 1.0)]}, {"H50_int8": [busy]}, 8)
    assert res["met"]["H50_int8"] is met
    assert res["ratio_to_quiet"]["H50_int8"] == pytest.approx(busy["eval_loss"] / quiet)
    assert res["miss_reasons"]["H50_int8"] == ({"alone": 2} if busy["misses"] else {})
    assert ("NOT met" in busy_lines(res)[1]) is not met
