"""DiLoCo hyperparameter sweep: a plain single-process simulation of the swarm's algorithm.

K workers (default 4), each a `swarm.model.diloco.DiLoCo` over its own copy of
`build_model(preset(model), seed)`, run H inner steps on their own windows (worker i samples
with `node_generator(peer_i, global_inner_step)`, as a `swarm-node` with identity i does), then
average their pseudo-gradients exactly (fp32, weighted by tokens, in worker order) and each
applies the average (`apply_outer`). Two baselines see the same windows:

    ddp     one model, the same AdamW, global batch = the K workers' batches concatenated
    alone   one model, the same AdamW, worker 0's batches only

and the share of the gap DiLoCo closes is  gap_closed = (L_alone - L_diloco) / (L_alone - L_ddp)
(final loss on `eval_windows(data.eval, seq_len)`). The baselines run through `DiLoCo.inner_step`
with H = the whole run (no outer step ever), so all three use one optimizer, schedule and clipping:
the workload's (`--lr-schedule`, default cosine to 10% at --steps, the protocol of the DiLoCo benchmark; the
table's title and every JSON row say which).

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

scripts/bench/diloco.py imports the workload, identities and the baselines from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarm.model.data import TokenData, eval_windows, node_generator, sample_batch, stdlib_corpus
from swarm.model.diloco import DiLoCo, DiLoCoConfig
from swarm.model.error_feedback import ErrorFeedback
from swarm.model.llama import build_model
from swarm.model.loss import eval_loss
from swarm.model.presets import preset
from swarm.model.schedule import SCHEDULES
from swarm.model.sparse_blocks import BlockSelection, step_seed
from swarm.model.state_hash import tensors_sha256
from swarm.p2p.identity import Identity

IDENTITY_TAG = "swarm.bench_diloco"
CODEC_BLOCK = 64  # the all-reduce's block size (AveragingConfig.block_size)


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """What every run of one comparison shares: model, data windows, batch and length."""

    model: str = "tiny"
    workers: int = 4  # K: DiLoCo workers (swarm nodes); DDP's global batch is K per-node batches
    steps: int = 1000  # inner steps per worker (= optimizer steps of the baselines)
    batch_size: int = 2  # sequences per worker per inner step
    seq_len: int = 256
    seed: int = 0  # model weights and worker identities
    eval_windows: int = 64
    # the inner schedule every run of the comparison uses (DiLoCo and both baselines): the DiLoCo
    # benchmark's stated protocol is warmup then cosine to 10% at the run's end (steps)
    lr_schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2  # wsd only

    def __post_init__(self) -> None:
        for name in ("workers", "steps", "batch_size", "seq_len", "eval_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"Workload.{name} must be >= 1, got {getattr(self, name)}")

    def schedule(self) -> dict[str, Any]:
        """The DiLoCoConfig schedule fields of this workload: a decaying one ends at `steps`."""
        total = None if self.lr_schedule == "constant" else self.steps
        return {"lr_schedule": self.lr_schedule, "total_steps": total, "min_lr_ratio": self.min_lr_ratio,
                "decay_fraction": self.decay_fraction}  # fmt: skip

    def schedule_label(self) -> str:
        if self.lr_schedule == "constant":
            return "constant inner lr after warmup"
        end = f"{self.min_lr_ratio:g}x at step {self.steps}"
        if self.lr_schedule == "wsd":
            return f"wsd inner lr (decay over the last {self.decay_fraction:g}, to {end})"
        return f"cosine inner lr to {end}"

    def key(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class HSchedule:
    """Inner steps per outer step: H_k = min(target, start * factor**k); start == target: constant."""

    target: int
    start: int | None = None  # None: constant H = target
    factor: float = 2.0

    def __post_init__(self) -> None:
        if self.target < 1 or (self.start is not None and not 1 <= self.start <= self.target) or self.factor < 1:
            raise ValueError(f"bad H schedule {self}: need 1 <= start <= target and factor >= 1")

    @property
    def constant(self) -> bool:
        return self.start is None or self.start == self.target

    def at(self, outer_step: int) -> int:
        if self.start is None:
            return self.target
        return min(self.target, math.floor(self.start * self.factor**outer_step))

    def label(self) -> str:
        return str(self.target) if self.constant else f"{self.start}x{self.factor:g}->{self.target}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Setting:
    """One DiLoCo configuration of the sweep."""

    name: str
    h: HSchedule
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    lr: float = 1e-3  # inner AdamW peak learning rate
    warmup_steps: int = 100
    # how pseudo-gradients travel: "none" averages them exactly; a codec ("int8", ...) carries
    # each worker's and the average (as a part owner's result), with error feedback of this
    # decay when > 0 (swarm/model/error_feedback.py)
    codec: str = "none"
    error_feedback: float = 0.0
    density: float = 1.0  # the share of blocks each round carries (swarm/model/sparse_blocks.py)

    def diloco_config(self, workload: Workload) -> DiLoCoConfig:
        return DiLoCoConfig(
            inner_steps=self.h.target, lr=self.lr, warmup_steps=self.warmup_steps, outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum, nesterov=self.nesterov, **workload.schedule(),
        )  # fmt: skip

    def inner_key(self) -> tuple[float, int]:
        """The inner optimizer's settings: the baselines to compare with depend on these alone."""
        return (self.lr, self.warmup_steps)

    def row(self) -> dict[str, Any]:
        return {
            "setting": self.name, "H": self.h.label(), "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum, "nesterov": self.nesterov, "lr": self.lr,
            "warmup_steps": self.warmup_steps, "codec": self.codec, "error_feedback": self.error_feedback,
            "density": self.density,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class RunResult:
    eval_loss: float
    train_loss: float  # mean training loss over the last 10% of inner steps (worker 0 for DiLoCo)
    seconds: float
    outer_steps: int  # 0 for the baselines
    sha256: str  # θ at the end: equal across reruns with one seed (and across DiLoCo workers)


# --- workload pieces shared with bench_diloco.py ------------------------------------------------


def node_identity(index: int, seed: int = 0) -> Identity:
    """The fixed identity of worker (node) `index`: its PeerID chooses its training windows."""
    return Identity.from_seed(hashlib.sha256(f"{IDENTITY_TAG}:{seed}:{index}".encode()).digest())


def worker_peers(workload: Workload) -> list[bytes]:
    return [node_identity(i, workload.seed).peer_id.to_bytes() for i in range(workload.workers)]


@functools.lru_cache(maxsize=1)
def load_corpus() -> TokenData:
    return stdlib_corpus()


def worker_batch(data: TokenData, workload: Workload, peer: bytes, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch a node with PeerID bytes `peer` trains on at global inner step `step`."""
    return sample_batch(data.train, workload.batch_size, workload.seq_len, node_generator(peer, step))


def inner_config(workload: Workload, lr: float = 1e-3, warmup_steps: int = 100, **overrides: Any) -> DiLoCoConfig:
    """The baselines' inner optimizer: the workload's schedule, as every DiLoCo setting uses."""
    return DiLoCoConfig(lr=lr, warmup_steps=warmup_steps, **{**workload.schedule(), **overrides})


def train_data_parallel(data: TokenData, workload: Workload, peers: Sequence[bytes], config: DiLoCoConfig) -> RunResult:
    """One model trained for workload.steps AdamW steps on the concatenated batches of `peers`
    (all K: the DDP equivalent; one: a node alone). `config` gives the inner optimizer; its H is
    ignored (the run never takes an outer step)."""
    model = build_model(preset(workload.model), seed=workload.seed)
    trainer = DiLoCo(model, dataclasses.replace(config, inner_steps=workload.steps))
    started, losses = time.perf_counter(), []
    for step in range(workload.steps):
        batches = [worker_batch(data, workload, peer, step) for peer in peers]
        inputs = torch.cat([b[0] for b in batches])
        targets = torch.cat([b[1] for b in batches])
        losses.append(trainer.inner_step(inputs, targets).loss)
    seconds = time.perf_counter() - started
    windows = eval_windows(data.eval, workload.seq_len, workload.eval_windows)
    return RunResult(eval_loss(model, windows), _tail_mean(losses), seconds, 0, tensors_sha256(trainer.params))


class _ScheduledDiLoCo(DiLoCo):
    """DiLoCo whose H changes between outer steps: its clock counts the inner steps done, not
    outer_step * H. The driver sets `config` (H of this round) and `steps_before` per round."""

    steps_before = 0

    @property
    def global_inner_step(self) -> int:
        return self.steps_before + self.inner_done


def average_deltas(deltas: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[torch.Tensor]:
    """The exact weighted mean of the workers' pseudo-gradients, fp32, summed in worker order."""
    total = float(sum(weights))
    out = [torch.zeros_like(t) for t in deltas[0]]
    for worker, weight in zip(deltas, weights, strict=True):
        scale = weight / total
        for acc, t in zip(out, worker, strict=True):
            acc.add_(t * scale)
    return out


def train_diloco(
    data: TokenData,
    workload: Workload,
    setting: Setting,
    on_outer: Callable[[int, float], None] | None = None,
) -> RunResult:
    """K DiLoCo workers from one initialization, averaging exactly after every round."""
    peers = worker_peers(workload)
    config = setting.diloco_config(workload)
    workers = [_ScheduledDiLoCo(build_model(preset(workload.model), seed=workload.seed), config) for _ in peers]
    feedback = [] if setting.codec == "none" else [
        ErrorFeedback(setting.codec, CODEC_BLOCK, setting.error_feedback or 1.0) for _ in peers]  # fmt: skip
    started, losses, done = time.perf_counter(), [], 0
    while done < workload.steps:
        h = min(setting.h.at(workers[0].outer_step), workload.steps - done)
        for worker in workers:
            worker.config = dataclasses.replace(config, inner_steps=h)
            worker.steps_before = done
        for index, (worker, peer) in enumerate(zip(workers, peers, strict=True)):
            for step in range(done, done + h):
                stats = worker.inner_step(*worker_batch(data, workload, peer, step))
                if index == 0:
                    losses.append(stats.loss)
        selection = None
        if setting.density < 1:  # the same blocks for every worker of the round, as in a swarm
            numel = sum(p.numel() for p in workers[0].params)
            selection = BlockSelection.choose(
                numel, CODEC_BLOCK, setting.density, step_seed("sweep", workers[0].outer_step)
            )
        deltas = carry(feedback, [w.pseudo_gradients() for w in workers], keep=setting.error_feedback > 0,
                       selection=selection)  # fmt: skip
        averaged = average_deltas(deltas, [w.tokens_since_outer for w in workers])
        if feedback:  # the owners' results travel through the codec too
            averaged = ErrorFeedback(setting.codec, CODEC_BLOCK).compensate(averaged).sent
        for worker in workers:
            worker.apply_outer(averaged)
        done += h
        if on_outer is not None:
            on_outer(workers[0].outer_step, losses[-1])
    seconds = time.perf_counter() - started
    hashes = {w.outer_sha256() for w in workers}
    if len(hashes) != 1:
        raise AssertionError("DiLoCo workers ended with different θ_outer")
    windows = eval_windows(data.eval, workload.seq_len, workload.eval_windows)
    return RunResult(eval_loss(workers[0].model, windows), _tail_mean(losses), seconds, workers[0].outer_step, *hashes)


def carry(
    feedback: Sequence[ErrorFeedback],
    deltas: list[list[torch.Tensor]],
    *,
    keep: bool,
    selection: BlockSelection | None = None,
) -> list[list[torch.Tensor]]:
    """Each worker's pseudo-gradients as its codec carries them (only the `selection`'s blocks,
    zeros elsewhere, when given), keeping what it drops for the next round when `keep` (error
    feedback); unchanged without a codec."""
    if not feedback:
        return deltas
    sent = []
    for ef, worker in zip(feedback, deltas, strict=True):
        compensated = ef.compensate(worker, selection)
        if keep:
            ef.commit(compensated)
        sent.append(compensated.sent)
    return sent


def gap_closed(alone: float, ddp: float, diloco: float) -> float:
    """(L_alone - L_diloco) / (L_alone - L_ddp): 0 = no better than one node, 1 = as good as DDP."""
    return (alone - diloco) / (alone - ddp) if alone != ddp else float("nan")


def _tail_mean(losses: Sequence[float]) -> float:
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail)


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
    Example: `outer_lr=1.0,outer_momentum=0.8,H=10-100`."""
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
        elif key in ("outer_lr", "outer_momentum", "lr"):
            fields[key] = float(value)
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
