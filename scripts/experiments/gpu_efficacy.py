"""DiLoCo against data-parallel training on one GPU, in one process and one command.

At the same tokens per worker, through the one-process simulator the CPU sweeps use
(scripts/experiments/diloco_sim.py: the project's DiLoCo arithmetic, outer SGD and codecs):

    alone        one worker's batches, AdamW, the workload's schedule
    ddp          the M workers' batches concatenated (the same windows, schedule and AdamW)
    H{h} {codec} DiLoCo with M workers, each H inner steps then one averaged outer step, the
                 pseudo-gradients carried exactly (fp32) or through int8, for each H of --hs

each for every seed (model weights and worker identities). On CUDA the inner steps run in bf16
(DiLoCo's autocast) and, with --compile, through torch.compile. Before training, a few timed
steps of each preset of --models (largest first) choose the largest one, the most seeds (up to
--seeds) and the inner steps (a multiple of every H) that fit --budget-s with at least
--min-outer-steps outer steps at the smallest H; --steps and a single --models skip the choice.

It prints a table and one JSON line: final eval loss of each run, gap closed, bytes each worker
sends against an fp32 data-parallel ring all-reduce, tokens/s, wall time, the device's name, and
the targets (int8 at H 50 closes >= 50% of the gap; int8 within 0.5% of fp32's eval loss).
Exit 0 when every run finished with a finite loss, 1 when one raised or ended in NaN, 2 when it
could not start (no CUDA device, a missing module).

    python -m scripts.experiments.gpu_efficacy --wheels wheels/            # on the GPU machine
    python -m scripts.experiments.gpu_efficacy --data DIR                  # a `swarm-data prepare` folder
    python -m scripts.experiments.gpu_efficacy --dry-run                   # the tiny preset on the CPU

The wheels folder is gpu_check's (`python -m scripts.experiments.gpu_check --prepare-wheels DIR`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scripts.experiments import gpu_wheels

if TYPE_CHECKING:  # imported in main, after --wheels put the GPU machine's missing modules on the path
    from scripts.experiments.diloco_sim import Runtime, Workload
    from swarm.model.data import TokenData

# inner AdamW peak learning rates by preset: the DiLoCo paper's 4e-4 at 150M, more for smaller models
LR = {"tiny": 1e-3, "small": 6e-4, "150m": 4e-4, "1b": 3e-4}
GAP_TARGET = 0.5  # int8 at H 50: share of the gap from one worker to data-parallel closed
INT8_TARGET = 0.005  # int8's eval loss within this share of fp32's, at the same H
# --dry-run: the tiny preset on the CPU for a few steps, every path of a GPU run (probe, plan,
# both baselines, DiLoCo through int8 and fp32, two seeds, the summary) in seconds
DRY_RUN = {"device": "cpu", "models": "tiny", "steps": 8, "seeds": 2, "hs": "2,4", "batch_size": 1, "seq_len": 16,
           "eval_windows": 2}  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class Probe:
    """One preset's measured cost: seconds of one inner step on one worker's batch and on the M
    workers' batch, and of building (and compiling) a model up to its first steps."""

    step_s: float
    ddp_step_s: float
    build_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    model: str
    seeds: int
    steps: int
    fits: bool  # False: even the smallest preset and one seed miss the budget or the outer steps


def plan(
    probes: dict[str, Probe], *, budget_s: float, workers: int, diloco_runs: int, seeds: int,
    min_steps: int, multiple: int,
) -> Plan:  # fmt: skip
    """The first preset of `probes` (largest first) and the most seeds whose runs fit `budget_s`
    with at least `min_steps` inner steps, a multiple of `multiple`. Per seed and inner step the
    runs cost one worker's step (alone), one M-batch step (ddp) and M steps per DiLoCo run; each
    run builds its models once. Nothing fits: the last preset, one seed, the steps that fit."""
    last: Plan | None = None
    for model, p in probes.items():
        per_step = p.step_s + p.ddp_step_s + diloco_runs * workers * p.step_s
        builds = (2 + diloco_runs * workers) * p.build_s
        for n in range(seeds, 0, -1):
            steps = int((budget_s / n - builds) / per_step) // multiple * multiple
            if steps >= min_steps:
                return Plan(model=model, seeds=n, steps=steps, fits=True)
        last = Plan(model=model, seeds=1, steps=max(multiple, steps), fits=False)
    if last is None:
        raise ValueError("no preset to plan with")
    return last


def probe(model: str, data: TokenData, workload: Workload, runtime: Runtime, steps: int = 5) -> Probe:
    """Times `steps` inner steps of `model` on one worker's batch and on the workers' batch."""
    import torch

    from scripts.experiments.diloco_sim import inner_config, worker_batch, worker_peers
    from swarm.model.diloco import DiLoCo

    w = dataclasses.replace(workload, model=model, steps=max(workload.steps, 2 * steps + 4))
    peers = worker_peers(w)
    out = []
    for chosen in (peers[:1], peers):
        started = time.perf_counter()
        # a small learning rate: the probe times steps, and its loss must stay finite whatever the run's rate
        trainer = DiLoCo(runtime.build(w, data), inner_config(w, 1e-4, 1, inner_steps=w.steps))
        batches = [[worker_batch(data, w, peer, step) for peer in chosen] for step in range(2 * steps + 2)]
        cat = [(torch.cat([b[0] for b in bs]), torch.cat([b[1] for b in bs])) for bs in batches]
        for inputs, targets in cat[:2]:  # kernels chosen (and the model compiled) on the first steps
            trainer.inner_step(inputs, targets)
        build_s = time.perf_counter() - started
        timed = time.perf_counter()
        for inputs, targets in cat[2 : 2 + steps]:
            trainer.inner_step(inputs, targets)  # its loss is read: the step has finished on the device
        out.append(((time.perf_counter() - timed) / steps, build_s))
        del trainer
    return Probe(step_s=out[0][0], ddp_step_s=out[1][0], build_s=max(out[0][1], out[1][1]))


def configs(hs: Sequence[int], codecs: Sequence[str]) -> list[tuple[str, int, str]]:
    """(name, H, codec) of each DiLoCo run; H 0 marks the baselines."""
    return [("alone", 0, ""), ("ddp", 0, "")] + [(f"H{h} {c}", h, c) for h in hs for c in codecs]


def run_seed(data: TokenData, workload: Workload, runtime: Runtime, hs: Sequence[int], codecs: Sequence[str],
             lr: float, warmup: int, log: Any) -> list[dict[str, Any]]:  # fmt: skip
    """Every configuration at one seed: a row each, with its error when it raised."""
    from scripts.experiments.codec_sweep import bytes_per_parameter
    from scripts.experiments.diloco_sim import (
        HSchedule,
        Setting,
        inner_config,
        train_data_parallel,
        train_diloco,
        worker_peers,
    )

    peers = worker_peers(workload)
    rows = []
    for name, h, codec in configs(hs, codecs):
        row: dict[str, Any] = {"config": name, "seed": workload.seed, "H": h or None, "codec": codec or None}
        try:
            if h == 0:
                chosen = peers[:1] if name == "alone" else peers
                result = train_data_parallel(data, workload, chosen, inner_config(workload, lr, warmup), runtime)
                tokens, sent = len(chosen) * workload.batch_size * workload.seq_len * workload.steps, None
                if name == "ddp":  # an fp32 ring all-reduce of the gradients at every step
                    sent = 2 * (workload.workers - 1) / workload.workers * 4.0 * workload.steps
            else:
                setting = Setting(name=name, h=HSchedule(target=h), lr=lr, warmup_steps=warmup,
                                  codec="none" if codec == "fp32" else codec)  # fmt: skip
                result = train_diloco(data, workload, setting, runtime=runtime)
                tokens = workload.workers * workload.batch_size * workload.seq_len * workload.steps
                per_param = bytes_per_parameter(setting.codec)  # a butterfly round: sent once, result back
                sent = 2 * (workload.workers - 1) / workload.workers * per_param * result.outer_steps
            row.update(eval_loss=result.eval_loss, train_loss=result.train_loss, seconds=result.seconds,
                       outer_steps=result.outer_steps, tokens=tokens, tokens_per_s=tokens / result.seconds,
                       bytes_per_param_sent=sent)  # fmt: skip
        except Exception as error:  # one failed run is reported and the others still run
            row["error"] = f"{type(error).__name__}: {error}"[:300]
        log(f"seed {workload.seed} {name:12s} " + (f"eval {row['eval_loss']:.4f} ({row['seconds']:.0f} s)"
                                                   if "eval_loss" in row else row["error"]))  # fmt: skip
        rows.append(row)
        if runtime.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
    return rows


def _spread(values: Sequence[float]) -> dict[str, float] | None:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    return {"mean": sum(finite) / len(finite), "min": min(finite), "max": max(finite), "n": len(finite)}


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per configuration: eval loss and gap closed (each seed against its own baselines) as mean,
    min, max over seeds; bytes per worker against fp32 data-parallel's; tokens/s and seconds."""
    by_seed: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_seed.setdefault(r["seed"], {})[r["config"]] = r
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["config"] for r in rows):
        done = [s[name] for s in by_seed.values() if "eval_loss" in s.get(name, {})]
        gaps = []
        for seed_rows in by_seed.values():
            alone, ddp, run = (seed_rows.get(k, {}).get("eval_loss") for k in ("alone", "ddp", name))
            if None not in (alone, ddp, run) and alone != ddp:
                gaps.append((alone - run) / (alone - ddp))
        ddp_sent = [s["ddp"]["bytes_per_param_sent"] for s in by_seed.values() if "eval_loss" in s.get("ddp", {})]
        sent = done[0].get("bytes_per_param_sent") if done else None
        out[name] = {
            "eval_loss": _spread([r["eval_loss"] for r in done]), "gap_closed": _spread(gaps),
            "reduction_vs_fp32_ddp": ddp_sent[0] / sent if sent and ddp_sent else None,
            "tokens_per_s": _spread([r["tokens_per_s"] for r in done]),
            "seconds": _spread([r["seconds"] for r in done]),
        }  # fmt: skip
    return out


def failures(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The runs that raised or ended with a loss that is not finite."""
    bad = []
    for r in rows:
        if "error" in r or not all(math.isfinite(r.get(k, math.nan)) for k in ("eval_loss", "train_loss")):
            bad.append(f"seed {r['seed']} {r['config']}: {r.get('error', 'loss not finite')}")
    return bad


def targets(summary: dict[str, dict[str, Any]], hs: Sequence[int]) -> dict[str, bool | None]:
    """Each target met or not (None: not measured); reported, never a failure by itself."""
    out: dict[str, bool | None] = {}
    gap = (summary.get("H50 int8") or {}).get("gap_closed")
    out["H50_int8_gap_closed_50"] = gap["mean"] >= GAP_TARGET if gap else None
    for h in hs:
        q, f = ((summary.get(f"H{h} {c}") or {}).get("eval_loss") for c in ("int8", "fp32"))
        out[f"H{h}_int8_within_0.5pct_of_fp32"] = abs(q["mean"] / f["mean"] - 1) <= INT8_TARGET if q and f else None
    return out


def print_table(summary: dict[str, dict[str, Any]], header: str) -> None:
    print(header)
    print(f"{'run':12s} {'eval loss (min-max)':>26s} {'gap closed (min-max)':>24s} {'vs fp32 DDP':>11s} "
          f"{'tokens/s':>11s} {'s':>7s}")  # fmt: skip
    for name, s in summary.items():
        loss, gap = s["eval_loss"], s["gap_closed"]
        loss_t = f"{loss['mean']:.4f} ({loss['min']:.4f}-{loss['max']:.4f})" if loss else "failed"
        gap_t = f"{gap['mean']:.1%} ({gap['min']:.1%}-{gap['max']:.1%})" if gap and name.startswith("H") else ""
        red = s["reduction_vs_fp32_ddp"]
        speed = f"{s['tokens_per_s']['mean']:,.0f}" if s["tokens_per_s"] else ""
        secs = f"{s['seconds']['mean']:.1f}" if s["seconds"] else ""
        print(f"{name:12s} {loss_t:>26s} {gap_t:>24s} {(f'{red:,.0f}x' if red else ''):>11s} {speed:>11s} {secs:>7s}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="the tiny preset for a few steps on the CPU")
    parser.add_argument("--wheels", type=Path, metavar="DIR", help="install gpu_check's wheels folder first (offline)")
    parser.add_argument("--site", type=Path, default=Path(tempfile.gettempdir()) / "swarm-gpu-site")
    parser.add_argument("--data", help="a `swarm-data prepare` folder (default: the stdlib corpus)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="150m,small", help="presets to choose from, largest first")
    parser.add_argument("--steps", type=int, help="inner steps per worker (default: chosen to fit --budget-s)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="seconds of training, all runs together")
    parser.add_argument("--min-outer-steps", type=int, default=20, help="at the smallest H")
    parser.add_argument("--seeds", type=int, default=2, help="at most; fewer when the budget needs")
    parser.add_argument("--hs", default="50,100", help="comma-separated H values (250 if time allows)")
    parser.add_argument("--codecs", default="int8,fp32", help="how Δ travels: int8 and exact fp32")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per worker and inner step")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument("--compile", action="store_true", help="torch.compile each model (as swarm-node --compile)")
    if "--dry-run" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**DRY_RUN)  # flags given beside it still win
    args = parser.parse_args(argv)
    if args.wheels is not None:
        subprocess.run(gpu_wheels.install_command(args.wheels, args.site), check=True)
        gpu_wheels.use_site(args.site)
    try:
        import torch

        from scripts.experiments import diloco_sim  # noqa: F401 (all it imports, checked before any run)
    except ImportError as error:
        print(json.dumps({"error": f"{error}: prepare a wheels folder (gpu_check --prepare-wheels)"}))
        return 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device (--dry-run runs on the CPU)"}))
        return 2
    threads = torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(1)  # deterministic, as the CPU sweeps
    try:
        return compare(args)
    finally:  # as it was: the dry run also runs inside the test suite's process
        torch.set_num_threads(threads)


def compare(args: argparse.Namespace) -> int:
    """Every run of the comparison, the table and the JSON line; the exit code."""
    import torch

    from scripts.experiments import diloco_sim as sim
    from swarm.model.data import load_data
    from swarm.model.llama import build_model
    from swarm.model.presets import preset

    started = time.perf_counter()
    hs = [int(h) for h in args.hs.split(",")]
    codecs = [c for c in args.codecs.split(",") if c]
    models = [m for m in args.models.split(",") if m]
    data = load_data(args.data) if args.data else sim.load_corpus()
    runtime = sim.Runtime(device=args.device, compile=args.compile)
    base = sim.Workload(model=models[0], workers=args.workers, steps=args.steps or 1, batch_size=args.batch_size,
                        seq_len=args.seq_len, eval_windows=args.eval_windows)  # fmt: skip
    probes: dict[str, Probe] = {}
    planned: Plan | None = None
    if args.steps is None or len(models) > 1 or args.dry_run:  # the dry run probes too: that path cannot rot
        try:
            probes = {m: probe(m, data, base, runtime, steps=2 if args.dry_run else 5) for m in models}
        except Exception as error:  # a preset that cannot train here: nothing to compare
            print(json.dumps({"error": f"probe: {type(error).__name__}: {error}"[:500], "failures": ["probe"]}))
            return 1
        planned = plan(probes, budget_s=args.budget_s - (time.perf_counter() - started), workers=args.workers,
                       diloco_runs=len(hs) * len(codecs), seeds=args.seeds, min_steps=args.min_outer_steps * min(hs),
                       multiple=math.lcm(*hs))  # fmt: skip
    chosen = planned  # without --steps there is always a plan
    if args.steps or chosen is None:  # given: the steps and seeds are the user's; the preset is still chosen
        chosen = Plan(model=planned.model if planned and len(models) > 1 else models[0], seeds=args.seeds,
                      steps=args.steps, fits=True)  # fmt: skip
    warmup = max(1, min(100, chosen.steps // 10))
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu ({platform.machine()})"

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    log(f"{device}: {chosen.model}, {chosen.steps} inner steps, {chosen.seeds} seed(s), {data.name}")
    rows: list[dict[str, Any]] = []
    for seed in range(chosen.seeds):
        workload = dataclasses.replace(base, model=chosen.model, steps=chosen.steps, seed=seed)
        rows += run_seed(data, workload, runtime, hs, codecs, LR[chosen.model], warmup, log)
    summary = summarize(rows)
    shape = build_model(preset(chosen.model, vocab_size=data.vocab_size), seed=0, device="meta")
    parameters = sum(p.numel() for p in shape.parameters())
    header = (f"{device}, {chosen.model} ({parameters / 1e6:.1f}M), {args.workers} workers, {chosen.steps} inner "
              f"steps of {args.batch_size} x {args.seq_len} tokens per worker, {workload.schedule_label()}, "
              f"{chosen.seeds} seed(s), {data.name}")  # fmt: skip
    print_table(summary, header)
    bad = failures(rows)
    out = {
        "device": device, "torch": torch.__version__, "model": chosen.model, "parameters": parameters,
        "data": data.name, "workers": args.workers, "steps": chosen.steps, "batch_size": args.batch_size,
        "seq_len": args.seq_len, "hs": hs, "codecs": codecs, "seeds": chosen.seeds, "fits_budget": chosen.fits,
        "compile": args.compile, "lr": LR[chosen.model], "warmup_steps": warmup, "schedule": workload.schedule(),
        "probes": {m: vars_of(p) for m, p in probes.items()},
        "plan": dataclasses.asdict(planned) if planned else None, "summary": summary, "targets": targets(summary, hs),
        "runs": rows, "failures": bad, "seconds": time.perf_counter() - started,
    }  # fmt: skip
    print(json.dumps(out))
    return 1 if bad else 0


def vars_of(p: Probe) -> dict[str, float]:
    return {"step_s": p.step_s, "ddp_step_s": p.ddp_step_s, "build_s": p.build_s}


if __name__ == "__main__":
    sys.exit(main())
