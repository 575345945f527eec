"""scripts/experiments/gpu_efficacy.py: its CPU dry run end to end (so the GPU run cannot rot
between loans), the plan that picks the preset, seeds and steps, and what counts as a failure."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from scripts.experiments import gpu_efficacy as eff
from scripts.experiments.codec_sweep import bytes_per_parameter

CONFIGS = {"alone", "ddp", "H2 int8", "H2 fp32", "H4 int8", "H4 fp32"}


def _json_line(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.swarm  # trains every configuration: 14 s
@pytest.mark.timeout(180)  # about 10 s of CPU; minutes of wall time on a loaded 2-core machine
def test_the_dry_run_trains_every_configuration_at_two_seeds_and_reports_them(capsys: pytest.CaptureFixture) -> None:
    # this thread's CPU: the dry run trains on it alone (one torch thread), and other threads of
    # this worker (a previous test's, on a loaded machine) must not count toward it
    threads, started = torch.get_num_threads(), time.thread_time()
    assert eff.main(["--dry-run"]) == 0
    cpu_s = time.thread_time() - started
    assert torch.get_num_threads() == threads  # one thread for the run only: it runs inside the suite's process
    out = capsys.readouterr().out
    report = _json_line(out)
    assert report["device"].startswith("cpu") and report["model"] == "tiny" and report["seeds"] == 2
    assert report["failures"] == [] and set(report["probes"]) == {"tiny"}
    assert {(r["seed"], r["config"]) for r in report["runs"]} == {(s, c) for s in (0, 1) for c in CONFIGS}
    assert all(math.isfinite(r["eval_loss"]) and r["tokens_per_s"] > 0 for r in report["runs"])
    summary = report["summary"]
    assert summary["ddp"]["reduction_vs_fp32_ddp"] == 1.0
    # fp32 Δ at H sends 4 bytes per parameter every H steps where the ring sends 4 every step
    assert summary["H2 fp32"]["reduction_vs_fp32_ddp"] == pytest.approx(2.0)
    assert summary["H4 int8"]["reduction_vs_fp32_ddp"] == pytest.approx(4 * 4 / bytes_per_parameter("int8"))
    for h in (2, 4):  # int8 carries Δ closely: the same run to about 4 digits of loss
        assert summary[f"H{h} int8"]["eval_loss"]["mean"] == pytest.approx(summary[f"H{h} fp32"]["eval_loss"]["mean"],
                                                                           rel=1e-3)  # fmt: skip
        assert report["targets"][f"H{h}_int8_within_0.5pct_of_fp32"] is True
    assert report["targets"]["H50_int8_gap_closed_50"] is None  # not measured in a dry run
    for name in CONFIGS:  # the table has a line per configuration
        assert any(line.startswith(name) for line in out.splitlines())
    # about 10 CPU-s here and 15 on CI's busier machine: twice that is a dry run that grew, not a slow machine
    assert cpu_s < 30, f"the dry run took {cpu_s:.1f} s of CPU"


@pytest.mark.timeout(180)
def test_a_run_that_diverges_is_a_failure_and_the_exit_is_1(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(eff.LR, "tiny", 1e12)  # AdamW steps of 1e12: the logits overflow
    assert eff.main(["--dry-run", "--seeds", "1", "--hs", "4", "--codecs", "int8"]) == 1
    report = _json_line(capsys.readouterr().out)
    assert report["failures"] and all("seed 0" in f for f in report["failures"])


P = eff.Probe
# (probes, seeds asked, expected plan): budget 100 s, 4 workers, 4 DiLoCo runs, >= 100 steps, multiples of 100
PLANS = [
    # 150m fits two seeds: per step 1 + 4 + 16 = 21 ms, 100 / 2 / 0.021 = 2,380 -> 2,300
    ({"150m": P(step_s=0.001, ddp_step_s=0.004, build_s=0)}, 2, eff.Plan(model="150m", seeds=2, steps=2300, fits=True)),
    # 150m fits one seed only (2 seeds: 96 steps < 100)
    ({"150m": P(step_s=0.025, ddp_step_s=0.1, build_s=0.0)}, 2, eff.Plan(model="150m", seeds=1, steps=100, fits=True)),
    # 150m does not fit: small does, with two seeds
    ({"150m": P(step_s=0.5, ddp_step_s=2, build_s=0), "small": P(step_s=0.01, ddp_step_s=0.04, build_s=0)}, 2,
     eff.Plan(model="small", seeds=2, steps=200, fits=True)),
    # model building counts: 18 builds of 2 s leave 64 s of 100 for one seed
    ({"small": P(step_s=0.01, ddp_step_s=0.04, build_s=2)}, 1, eff.Plan(model="small", seeds=1, steps=300, fits=True)),
    # nothing fits: the last preset, one seed, one multiple
    ({"150m": P(step_s=1, ddp_step_s=4, build_s=0), "small": P(step_s=0.5, ddp_step_s=2, build_s=0)}, 2,
     eff.Plan(model="small", seeds=1, steps=100, fits=False)),
]  # fmt: skip


@pytest.mark.parametrize(("probes", "seeds", "expected"), PLANS)
def test_plan(probes: dict[str, eff.Probe], seeds: int, expected: eff.Plan) -> None:
    got = eff.plan(probes, budget_s=100.0, workers=4, diloco_runs=4, seeds=seeds, min_steps=100, multiple=100)
    assert got == expected


def test_failures_and_the_gap_closed_per_seed() -> None:
    rows = [
        {"seed": 0, "config": "alone", "eval_loss": 3.0, "train_loss": 3.0, "tokens_per_s": 1.0, "seconds": 1.0},
        {"seed": 0, "config": "ddp", "eval_loss": 2.0, "train_loss": 2.0, "tokens_per_s": 1.0, "seconds": 1.0,
         "bytes_per_param_sent": 300.0},
        {"seed": 0, "config": "H50 int8", "eval_loss": 2.5, "train_loss": 2.5, "tokens_per_s": 1.0, "seconds": 1.0,
         "bytes_per_param_sent": 3.0},
        {"seed": 1, "config": "alone", "eval_loss": 4.0, "train_loss": 4.0, "tokens_per_s": 1.0, "seconds": 1.0},
        {"seed": 1, "config": "ddp", "eval_loss": 2.0, "train_loss": 2.0, "tokens_per_s": 1.0, "seconds": 1.0,
         "bytes_per_param_sent": 300.0},
        {"seed": 1, "config": "H50 int8", "eval_loss": 2.5, "train_loss": math.nan, "tokens_per_s": 1.0,
         "seconds": 1.0, "bytes_per_param_sent": 3.0},
        {"seed": 1, "config": "H50 fp32", "error": "NonFiniteLossError: loss nan"},
    ]  # fmt: skip
    assert eff.failures(rows) == ["seed 1 H50 int8: loss not finite", "seed 1 H50 fp32: NonFiniteLossError: loss nan"]
    summary = eff.summarize(rows)
    gap = summary["H50 int8"]["gap_closed"]  # 0.5 at seed 0, 0.75 at seed 1: each against its own baselines
    assert (gap["mean"], gap["min"], gap["max"]) == (0.625, 0.5, 0.75)
    assert summary["H50 int8"]["reduction_vs_fp32_ddp"] == 100.0
    assert summary["H50 fp32"]["eval_loss"] is None
    assert eff.targets(summary, [50])["H50_int8_gap_closed_50"] is True
    assert eff.targets(summary, [50])["H50_int8_within_0.5pct_of_fp32"] is None
