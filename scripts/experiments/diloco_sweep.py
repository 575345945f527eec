"""DiLoCo hyperparameter sweep: a plain single-process simulation of the swarm's algorithm.

K workers (default 4) of the one-process simulator (scripts/experiments/diloco_sim.py: exact
averaging, the same windows for DiLoCo and both baselines) train under one setting each, against
data-parallel training (DDP) and one node alone, with the workload's inner schedule
(`--lr-schedule`, default cosine to 10% at --steps, the protocol of the DiLoCo benchmark; the
table's title and every JSON row say which); gap_closed = (L_alone - L_diloco) / (L_alone - L_ddp).

A "growing H" setting syncs more often early: H_k = min(target, start * factor**k) for outer
step k (the run's last round is cut to end at --steps). Its clock (learning rate schedule and
data windows) counts the inner steps actually done; with a constant H that is the swarm's
outer_step * H + inner steps done.

The sweep is deterministic given --seed (one torch thread, fixed seeds and identities). The
default plan ranks settings cheaply (`--stage cheap`: 300 inner steps, sequences of 128), one
factor at a time around the DiLoCo paper's defaults (outer lr 0.7, Nesterov momentum 0.9, H 50),
then tries together the best of each factor that beat the default by MIN_GAIN; `--stage full`
re-runs chosen settings at the issue's scale (1,000 inner steps, sequences of 256, 2 per worker).
`--cache FILE` keeps each result (JSON lines) so an interrupted sweep resumes where it stopped.

    python -m scripts.experiments.diloco_sweep --stage cheap --cache sweep.jsonl
    python -m scripts.experiments.diloco_sweep --stage full --settings default olr1-m0.8 'H=10-50' --cache sweep.jsonl

scripts/bench/diloco.py imports the cache and the baselines from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from scripts.experiments.diloco_sim import (
    HSchedule,
    RunResult,
    Setting,
    Workload,
    gap_closed,
    inner_config,
    load_corpus,
    train_data_parallel,
    train_diloco,
    worker_peers,
)
from swarm.model.schedule import SCHEDULES

# --- the sweep plan -----------------------------------------------------------------------------

CHEAP = Workload(steps=300, seq_len=128)
FULL = Workload()


def stage1_settings() -> list[Setting]:
    """One factor at a time around the DiLoCo paper's defaults (H 50, outer lr 0.7, Nesterov 0.9)."""
    h50 = HSchedule(target=50)
    s = [Setting(name="default", h=h50)]
    for lr, mu in ((0.4, 0.8), (0.4, 0.9), (0.7, 0.8), (1.0, 0.8), (1.0, 0.9), (1.0, 0.7), (1.3, 0.8)):
        s.append(Setting(name=f"olr{lr:g}-m{mu:g}", h=h50, outer_lr=lr, outer_momentum=mu))
    s.append(Setting(name="no-nesterov", h=h50, nesterov=False))
    s.append(Setting(name="fedavg", h=h50, outer_lr=1.0, outer_momentum=0.0, nesterov=False))
    for h in (25, 100):
        s.append(Setting(name=f"H{h}", h=HSchedule(target=h)))
    for target in (50, 100):
        s.append(Setting(name=f"grow10-{target}", h=HSchedule(target=target, start=10)))
    s.append(Setting(name="lr3e-3", h=h50, lr=3e-3))
    s.append(Setting(name="warmup30", h=h50, warmup_steps=30))
    return s


OUTER_FACTOR = (
    "default", "olr0.4-m0.8", "olr0.4-m0.9", "olr0.7-m0.8", "olr1-m0.8", "olr1-m0.9", "olr1-m0.7", "olr1.3-m0.8",
    "no-nesterov",
)  # fmt: skip
# How H starts, at one target H (the communication budget a user picks): constant or growing.
# H 25 (twice the syncs) and H 100 (half) are reported, not chosen: they change the budget.
H_FACTOR = ("default", "grow10-50")
INNER_FACTOR = ("default", "lr3e-3", "warmup30")


def combined_settings(best: dict[str, Setting]) -> list[Setting]:
    """The best outer optimizer with the best H schedule (and with the best inner optimizer),
    each at H 50 and at H 100 (a growing schedule keeps its start)."""
    outer, h, inner = best["outer"], best["h"], best["inner"]
    out = []
    for target in (50, 100):
        schedule = dataclasses.replace(h.h, target=target)
        combo = dataclasses.replace(outer, h=schedule, name=f"{outer.name}+H{schedule.label()}")
        out.append(combo)
        if inner.name != "default":
            out.append(
                dataclasses.replace(
                    combo, lr=inner.lr, warmup_steps=inner.warmup_steps, name=f"{combo.name}+{inner.name}"
                )
            )
    return out


FULL_PLAN = ("default", "olr1-m0.8", "grow10-50")  # the paper's defaults and the cheap stage's two best at H 50
MIN_GAIN = 0.01  # nats of eval loss a factor's setting must gain over the default to be adopted


def best_of(results: dict[str, dict[str, Any]], names: Sequence[str]) -> str:
    """The best setting of one factor, or "default" when none beats it by MIN_GAIN."""
    best = min((n for n in names if n in results), key=lambda n: results[n]["eval_loss"])
    return best if results[best]["eval_loss"] < results["default"]["eval_loss"] - MIN_GAIN else "default"


# --- running, caching, printing -----------------------------------------------------------------


class Cache:
    """Results by (kind, workload, setting) in a JSON-lines file (None: memory only)."""

    def __init__(self, path: str | None) -> None:
        self.path, self.rows = path, {}
        if path and os.path.exists(path):
            for line in Path(path).read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    self.rows[row["key"]] = row

    def get_or_run(self, key: str, run: Callable[[], RunResult]) -> dict[str, Any]:
        if key in self.rows:
            return self.rows[key]
        row = {"key": key, **dataclasses.asdict(run())}
        self.rows[key] = row
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        return row


def run_baselines(
    cache: Cache, workload: Workload, lr: float, warmup_steps: int, log: Callable[[str], None]
) -> dict[str, float]:
    """{"ddp": eval loss, "alone": eval loss} for this inner optimizer (cached)."""
    data, peers = load_corpus(), worker_peers(workload)
    out = {}
    for kind, chosen in (("ddp", peers), ("alone", peers[:1])):
        key = json.dumps([kind, workload.key(), lr, warmup_steps])
        config = inner_config(workload, lr, warmup_steps)
        fresh = key not in cache.rows
        row = cache.get_or_run(key, lambda c=config, p=chosen: train_data_parallel(data, workload, p, c))
        if fresh:
            log(f"{kind:6s} lr {lr:g} warmup {warmup_steps}: eval {row['eval_loss']:.4f} ({row['seconds']:.0f}s)")
        out[kind] = row["eval_loss"]
    return out


def run_setting(cache: Cache, workload: Workload, setting: Setting, log: Callable[[str], None]) -> dict[str, Any]:
    base = run_baselines(cache, workload, setting.lr, setting.warmup_steps, log)
    params = {k: v for k, v in setting.row().items() if k != "setting"}
    key = json.dumps(["diloco", workload.key(), params], sort_keys=True)
    row = cache.get_or_run(key, lambda: train_diloco(load_corpus(), workload, setting))
    out = {
        **setting.row(), "steps": workload.steps, "seq_len": workload.seq_len, "seed": workload.seed,
        "schedule": workload.schedule(), "eval_loss": row["eval_loss"],
        "train_loss": row["train_loss"], "outer_steps": row["outer_steps"], "seconds": row["seconds"],
        "ddp_eval_loss": base["ddp"], "alone_eval_loss": base["alone"],
        "ratio_to_ddp": row["eval_loss"] / base["ddp"],
        "gap_closed": gap_closed(base["alone"], base["ddp"], row["eval_loss"]),
    }  # fmt: skip
    log(f"{setting.name:28s} eval {out['eval_loss']:.4f} gap closed {out['gap_closed']:+.1%} ({row['seconds']:.0f}s)")
    return out


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    columns = ("setting", "H", "outer lr", "mom", "nest", "inner lr", "warmup", "eval", "/ddp", "gap closed", "s")
    for column in columns:
        table.add_column(column, justify="right")
    for r in sorted(rows, key=lambda r: r["eval_loss"]):
        table.add_row(
            r["setting"], r["H"], f"{r['outer_lr']:g}", f"{r['outer_momentum']:g}", "y" if r["nesterov"] else "n",
            f"{r['lr']:g}", str(r["warmup_steps"]), f"{r['eval_loss']:.4f}", f"{r['ratio_to_ddp']:.3f}",
            f"{r['gap_closed']:.1%}", f"{r['seconds']:.0f}",
        )  # fmt: skip
    Console(width=160).print(table)
    for (lr, warmup), base in sorted({(r["lr"], r["warmup_steps"]): r for r in rows}.items()):
        print(
            f"baselines at inner lr {lr:g}, warmup {warmup}: "
            f"DDP {base['ddp_eval_loss']:.4f}, one node alone {base['alone_eval_loss']:.4f}"
        )


def settings_by_name() -> dict[str, Setting]:
    named = {s.name: s for s in stage1_settings()}
    h100 = HSchedule(target=100)
    named["default-H100"] = Setting(name="default-H100", h=h100)
    return named


def parse_setting(text: str) -> Setting:
    """A named setting, or `key=value,...` over Setting's fields; H as 50 (constant), 10-100
    (doubling from 10 up to 100) or 10x1.5-100 (another growth factor).
    Example: `outer_lr=1.0,outer_momentum=0.8,H=10-100`; `codec=int8,H=100` carries Δ through int8."""
    named = settings_by_name()
    if "=" not in text:
        if text not in named:
            raise ValueError(f"unknown setting {text!r}; named ones: {', '.join(named)}")
        return named[text]
    fields: dict[str, Any] = {"name": text, "h": HSchedule(target=50)}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key == "H":
            fields["h"] = parse_h(value)
        elif key == "nesterov":
            fields[key] = value.lower() in ("1", "true", "y", "yes")
        elif key == "warmup_steps":
            fields[key] = int(value)
        elif key in ("outer_lr", "outer_momentum", "lr", "error_feedback", "density"):
            fields[key] = float(value)
        elif key == "codec":
            fields[key] = value
        else:
            raise ValueError(f"unknown field {key!r} in {text!r}")
    return Setting(**fields)


def parse_h(text: str) -> HSchedule:
    if "-" not in text:
        return HSchedule(target=int(text))
    start, _, target = text.partition("-")
    start, _, factor = start.partition("x")
    return HSchedule(target=int(target), start=int(start), factor=float(factor or 2))


def cheap_stage(cache: Cache, workload: Workload, log: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = {s.name: run_setting(cache, workload, s, log) for s in stage1_settings()}
    best = {
        "outer": settings_by_name()[best_of(rows, OUTER_FACTOR)],
        "h": settings_by_name()[best_of(rows, H_FACTOR)],
        "inner": settings_by_name()[best_of(rows, INNER_FACTOR)],
    }
    log("best of each factor: " + ", ".join(f"{k} {v.name}" for k, v in best.items()))
    for setting in combined_settings(best):
        rows[setting.name] = run_setting(cache, workload, setting, log)
    return list(rows.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=["cheap", "full"], default="cheap")
    parser.add_argument(
        "--settings",
        nargs="*",
        help="settings to run instead of the stage's plan: names (default, default-H100, H25, grow10-100, ...) "
        "or key=value lists (outer_lr=1.0,outer_momentum=0.8,H=10-100)",
    )
    parser.add_argument("--steps", type=int, help="inner steps per worker (cheap 300, full 1000)")
    parser.add_argument("--seq-len", type=int, help="cheap 128, full 256")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--lr-schedule",
        choices=SCHEDULES,
        default=Workload().lr_schedule,
        help="inner schedule of every run (DiLoCo and both baselines); decaying ones end at --steps",
    )
    parser.add_argument("--decay-fraction", type=float, default=Workload().decay_fraction, help="wsd's decay share")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache", help="JSON-lines file of results: reused, appended to")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = CHEAP if args.stage == "cheap" else FULL
    workload = dataclasses.replace(
        base, steps=args.steps or base.steps, seq_len=args.seq_len or base.seq_len, batch_size=args.batch_size,
        workers=args.workers, seed=args.seed, lr_schedule=args.lr_schedule, decay_fraction=args.decay_fraction,
    )  # fmt: skip
    cache = Cache(args.cache)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.settings:
        try:
            settings = [parse_setting(s) for s in args.settings]
        except ValueError as e:
            parser.error(str(e))
        rows = [run_setting(cache, workload, s, log) for s in settings]
    elif args.stage == "cheap":
        rows = cheap_stage(cache, workload, log)
    else:
        rows = [run_setting(cache, workload, settings_by_name()[n], log) for n in FULL_PLAN]
    if args.json:
        print(json.dumps(rows))
    else:
        title = (
            f"DiLoCo, {workload.workers} workers, {workload.model}, {workload.steps} inner steps, "
            f"batch {workload.batch_size} x seq {workload.seq_len} per worker (seed {workload.seed}), "
            f"{workload.schedule_label()}"
        )
        print_table(title, rows)


if __name__ == "__main__":
    main()
