"""The DiLoCo sweep's simulation and baselines (scripts/experiments/diloco_sweep.py), and the pure parts of
scripts/bench/diloco.py, on a workload small enough for a unit test."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from scripts.bench import diloco as bench_diloco
from scripts.experiments import diloco_sim as sim
from scripts.experiments import diloco_sweep as sweep

TINY = sweep.Workload(workers=2, steps=6, batch_size=1, seq_len=16, eval_windows=2)


def test_h_schedule_grows_to_its_target() -> None:
    assert [sweep.HSchedule(target=50).at(k) for k in range(3)] == [50, 50, 50]
    assert [sweep.HSchedule(target=100, start=10).at(k) for k in range(6)] == [10, 20, 40, 80, 100, 100]
    assert sweep.parse_h("10x3-100") == sweep.HSchedule(target=100, start=10, factor=3.0)
    with pytest.raises(ValueError):
        sweep.HSchedule(target=10, start=20)


def test_average_is_the_exact_weighted_mean() -> None:
    a, b = [torch.tensor([1.0, 2.0])], [torch.tensor([3.0, 6.0])]
    assert sim.average_deltas([a, b], [1.0, 3.0])[0].tolist() == [2.5, 5.0]


def test_identities_are_fixed_and_distinct() -> None:
    peers = sweep.worker_peers(TINY)
    assert peers == sweep.worker_peers(TINY) and len(set(peers)) == TINY.workers
    assert sweep.worker_peers(dataclasses.replace(TINY, seed=1)) != peers


def test_one_worker_with_plain_averaging_is_the_node_alone() -> None:
    """DiLoCo with one worker, outer lr 1 and no momentum reproduces the lone node's run: same
    windows, same clock (a growing H included), same optimizer."""
    data = sweep.load_corpus()
    one = dataclasses.replace(TINY, workers=1)
    config = sweep.inner_config(one, lr=3e-3, warmup_steps=2)
    alone = sweep.train_data_parallel(data, one, sweep.worker_peers(one), config)
    for h in (sweep.HSchedule(target=3), sweep.HSchedule(target=4, start=1)):
        setting = sweep.Setting(
            name="plain", h=h, outer_lr=1.0, outer_momentum=0.0, nesterov=False, lr=3e-3, warmup_steps=2
        )
        diloco = sweep.train_diloco(data, one, setting)
        assert diloco.eval_loss == pytest.approx(alone.eval_loss, abs=1e-4)
        assert diloco.outer_steps == (2 if h.constant else 3)  # 3 + 3; 1 + 2 + 3 (the last cut to fit)


def test_runs_are_deterministic_and_ddp_sees_every_worker() -> None:
    data = sweep.load_corpus()
    config = sweep.inner_config(TINY, lr=3e-3, warmup_steps=2)
    peers = sweep.worker_peers(TINY)
    ddp = sweep.train_data_parallel(data, TINY, peers, config)
    assert sweep.train_data_parallel(data, TINY, peers, config).sha256 == ddp.sha256
    assert sweep.train_data_parallel(data, TINY, peers[:1], config).sha256 != ddp.sha256
    setting = sweep.Setting(name="s", h=sweep.HSchedule(target=3), lr=3e-3, warmup_steps=2)
    first, second = sweep.train_diloco(data, TINY, setting), sweep.train_diloco(data, TINY, setting)
    assert first.sha256 == second.sha256 and first.eval_loss == second.eval_loss


def test_every_run_of_a_comparison_uses_the_workloads_schedule() -> None:
    """DiLoCo settings and both baselines take the workload's inner schedule (cosine to 10% at
    the run's end by default, the protocol of the DiLoCo benchmark), and a decaying one ends at --steps."""
    assert TINY.schedule() == {"lr_schedule": "cosine", "total_steps": 6, "min_lr_ratio": 0.1, "decay_fraction": 0.2}
    setting = sweep.Setting(name="s", h=sweep.HSchedule(target=3), warmup_steps=2)
    for workload in (
        TINY,
        dataclasses.replace(TINY, lr_schedule="wsd"),
        dataclasses.replace(TINY, lr_schedule="constant"),
    ):
        baseline, diloco = sweep.inner_config(workload, warmup_steps=2), setting.diloco_config(workload)
        for config in (baseline, diloco):
            assert config.lr_schedule == workload.lr_schedule
            assert config.total_steps == (None if workload.lr_schedule == "constant" else workload.steps)
    assert "wsd" in bench_diloco.schedule_flags(dataclasses.replace(TINY, lr_schedule="wsd"))
    assert bench_diloco.schedule_flags(dataclasses.replace(TINY, lr_schedule="constant")) == [
        "--lr-schedule",
        "constant",
    ]


@pytest.mark.timeout(120)
@pytest.mark.swarm  # a child interpreter importing torch: seconds of CPU
def test_the_sweeps_json_names_its_schedule_and_its_baselines_follow_it() -> None:
    """From the sweep's own JSON: the schedule is reported, and the baselines change with it."""
    import json
    import subprocess

    root = Path(__file__).resolve().parents[2]
    rows = {}
    for schedule in ("constant", "cosine"):
        out = subprocess.run(
            [sys.executable, "-m", "scripts.experiments.diloco_sweep", "--steps", "8", "--seq-len", "16",
             "--workers", "2", "--batch-size", "1",
             "--settings", "H=4,warmup_steps=2,lr=0.003", "--lr-schedule", schedule, "--json"],
            capture_output=True, text=True, timeout=100, check=True, cwd=root,
        )  # fmt: skip
        (rows[schedule],) = json.loads(out.stdout)
    assert rows["cosine"]["schedule"]["lr_schedule"] == "cosine" and rows["cosine"]["schedule"]["total_steps"] == 8
    assert rows["constant"]["schedule"]["total_steps"] is None
    for kind in ("ddp_eval_loss", "alone_eval_loss", "eval_loss"):
        assert rows["cosine"][kind] != rows["constant"][kind], kind


def test_gap_closed() -> None:
    assert sweep.gap_closed(alone=2.0, ddp=1.0, diloco=1.25) == pytest.approx(0.75)


def test_bench_configs_and_ring_bytes() -> None:
    assert bench_diloco.SwarmConfig.parse("H100_none") == bench_diloco.SwarmConfig("H100_none", 100, "none")
    ef = bench_diloco.SwarmConfig.parse("H100_int4:0.25_ef0.9")
    assert ef == bench_diloco.SwarmConfig("H100_int4:0.25_ef0.9", 100, "int4:0.25", 0.9)
    one = {"mode": "blocking", "fragments": 1, "catch_up": "update", "overlap_matchmaking": False, "bandwidth": "auto"}
    assert ef.labels() == {"codec": "int4", "density": 0.25, "error_feedback": 0.9, **one}
    plain = bench_diloco.SwarmConfig.parse("H50_int2")
    assert plain.labels() == {"codec": "int2", "density": 1.0, "error_feedback": 0.0, **one}
    # fragments: H stays each fragment's; the node steps every H / P
    streaming = bench_diloco.SwarmConfig.parse("H50_int8_f5_eager")
    assert streaming == bench_diloco.SwarmConfig("H50_int8_f5_eager", 10, "int8", 0.0, "eager", 5)
    assert streaming.labels()["fragments"] == 5 and bench_diloco.SwarmConfig.parse("H50_int8_f2").inner_steps == 25
    eager = bench_diloco.SwarmConfig.parse("H50_int8_ef0.5_eager")
    assert (eager.overlap, eager.error_feedback, eager.labels()["mode"]) == ("eager", 0.5, "eager")
    assert bench_diloco.SwarmConfig.parse("H50_int8_delayed").labels()["mode"] == "delayed"
    whole = bench_diloco.SwarmConfig.parse("H50_int8_eager_fetchstate")  # a missed group: the whole state
    assert (whole.overlap, whole.catch_up, whole.labels()["catch_up"]) == ("eager", "state", "state")
    assert bench_diloco.SwarmConfig.parse("H50_int8_fetchstate").catch_up == "state"
    background = bench_diloco.SwarmConfig.parse("H48_int8_f8_eager_mm_fetchstate")  # --overlap-matchmaking
    assert (background.overlap, background.fragments, background.catch_up) == ("eager", 8, "state")
    assert background.overlap_matchmaking and background.labels()["overlap_matchmaking"] is True
    fixed = bench_diloco.SwarmConfig.parse("H48_int8_f8_eager_mm_fetchstate_bwfixed")  # --bandwidth 100
    assert fixed.bandwidth_fixed and fixed.catch_up == "state" and fixed.labels()["bandwidth"] == "fixed"
    assert bench_diloco.SwarmConfig.parse("H50_int8").labels()["bandwidth"] == "auto"
    for bad in ("H0_int8", "50_int8", "H50_int3", "H50_int4:0", "H50_int4:2", "H50_none:0.5", "H50_int4_ef0",
                "H50_int4_ef2", "H50_int4_x1", "H50_int4_efx", "H50_int8_eager_ef1", "H50_int8_none",
                "H50_int8_eager_eager", "H50_int8_f3", "H50_int8_f0", "H50_int8_f100",
                "H50_int8_eager_f5", "H50_int8_fetchstate_eager", "H50_fetchstate", "H50_int8_mm",
                "H50_int8_mm_eager", "H50_int8_bwfixed_eager", "H50_bwfixed", "H50_int8_bwfixed_bwfixed",
                "H50_int8_bwauto"):  # fmt: skip
        with pytest.raises(ValueError):
            bench_diloco.SwarmConfig.parse(bad)
    assert bench_diloco.ring_allreduce_bytes(nodes=4, parameters=1000, steps=10) == 1.5 * 4 * 1000 * 10


def test_bench_summary_of_metrics_events() -> None:
    def step(k: int, group: int, sent: int) -> dict[str, object]:
        return {
            "event": "outer_step", "outer_step": k, "eval_loss": 1.5 if k == 1 else None, "state_sha256": "ab",
            "group_size": group, "bytes_sent": sent, "bytes_received": sent, "inner_s": 8.0, "wall_s": 10.0,
            "tokens_per_s": 100.0,
        }  # fmt: skip

    nodes = [[{"event": "start"}, step(0, 2, 10), step(1, 2, 20), {"event": "exit"}], [step(0, 1, 5), step(1, 2, 30)]]
    summary = bench_diloco.summarize(bench_diloco.SwarmConfig.parse("H50_int8"), nodes)
    assert summary["eval_loss"] == 1.5 and summary["states_agree"] and summary["outer_steps"] == [2, 2]
    assert summary["bytes_sent"] == [30, 35] and summary["utilization"] == [0.8, 0.8]
    assert summary["full_group_share"] == 0.75
    fetch = {"event": "fetch", "outer_step": 2, "state_sha256": "ab", "bytes": 7, "by_update": True}
    nodes[1].append(fetch)
    nodes[0].append({**fetch, "bytes": 50, "by_update": False})
    summary = bench_diloco.summarize(bench_diloco.SwarmConfig.parse("H50_int8"), nodes)
    assert (summary["fetches"], summary["fetches_by_update"], summary["fetched_bytes"]) == ([1, 1], [0, 1], [50, 7])
    summary["run_s"] = 10.0
    res = bench_diloco.results(TINY, {"ddp": 1.0, "alone": 2.0}, {"H50_int8_fetchstate": [summary]})
    row = {key: value["H50_int8_fetchstate"] for key, value in res.items() if isinstance(value, dict)
           and "H50_int8_fetchstate" in value}  # fmt: skip
    assert row["catch_up"] == "state" and row["mode"] == "blocking" and row["diloco_eval_loss"] == 1.5
    assert (row["fetches"], row["fetches_by_update"], row["fetched_bytes"]) == (2, 1, 57)
    bench_diloco.print_table(res)  # every column has its value
