"""An outer step that overlaps the next inner steps, simulated: what each way of applying a late
average costs in loss, against blocking DiLoCo at the same H.

K workers as in scripts/experiments/diloco_sim.py (one process, the same windows and schedule). In a
swarm the all-reduce of round t runs while the nodes already train round t+1; here it "lands"
after `delay` x H inner steps of round t+1 (1.0: the round takes a whole inner phase, the worst
case that still overlaps fully). Then every worker computes the same θ_outer(t+1) from the same
average (bit-identical, as in the swarm) and moves its local weights onto it, keeping what it
trained since (so the next pseudo-gradient is exactly round t+1's progress), with swarm-node's own
arithmetic (DiLoCo.begin_overlap, swarm-node --overlap):

    blocking  the average is applied before round t+1 trains (swarm-node --overlap none)
    delayed   round t+1 starts from the worker's own end of round t; on landing,
              θ_local += θ_outer(t+1) - θ_local(end of round t)    (Streaming DiLoCo's overlap)
    eager     round t+1 starts from θ_outer(t) moved by the worker's OWN Δ_t through the outer
              optimizer (a proxy of the average); on landing,
              θ_local += θ_outer(t+1) - proxy                        ("eager updates")

`--alphas A,...` adds Streaming DiLoCo's merge on landing (Douillard et al. 2025): the worker's
weights become A x its own (what it trained since included) + (1 - A) x θ_outer(t+1) (A = 1:
the rules above alone; the paper uses 0.5). θ_outer, which the workers share, is unchanged by it.

    python -m scripts.experiments.overlap_sweep --modes blocking,delayed,eager --delays 1,0.25 --alphas 1,0.5 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

import torch

from scripts.experiments.diloco_sim import (
    HSchedule,
    Setting,
    Workload,
    _ScheduledDiLoCo,
    average_deltas,
    load_corpus,
    train_diloco,
    worker_batch,
    worker_peers,
)
from scripts.experiments.diloco_sweep import CHEAP
from swarm.model.data import eval_windows
from swarm.model.diloco import DiLoCo
from swarm.model.llama import build_model
from swarm.model.loss import eval_loss
from swarm.model.presets import preset

MODES = ("blocking", "delayed", "eager")


def train_overlapped(data: Any, workload: Workload, setting: Setting, mode: str, delay: float,
                     alpha: float = 1.0) -> tuple[float, float]:  # fmt: skip
    """(final eval loss, seconds) of K workers whose round-t average lands `delay` x H inner steps
    into round t+1, applied the `mode` way: swarm-node's own arithmetic (DiLoCo.begin_overlap,
    then apply_outer when the average lands), then mixed with the weights before it by `alpha`
    (the module docstring; 1: not mixed)."""
    peers = worker_peers(workload)
    config = setting.diloco_config(workload)
    workers = [_ScheduledDiLoCo(build_model(preset(workload.model), seed=workload.seed), config) for _ in peers]
    h = setting.h.target
    started, losses, done = time.perf_counter(), [], 0
    pending: list[torch.Tensor] | None = None  # the average of the round in flight
    while done < workload.steps:
        steps = min(h, workload.steps - done)
        landing = done + (min(steps, max(1, round(delay * h))) if pending is not None else 0)
        for worker in workers:
            worker.config = dataclasses.replace(config, inner_steps=steps)
            worker.steps_before = done
        for step in range(done, done + steps):
            if pending is not None and step == landing:
                for worker in workers:
                    land(worker, pending, alpha)
                pending = None
            for index, (worker, peer) in enumerate(zip(workers, peers, strict=True)):
                stats = worker.inner_step(*worker_batch(data, workload, peer, step))
                if index == 0:
                    losses.append(stats.loss)
        if pending is not None:  # the round was shorter than the delay: it lands now
            for worker in workers:
                land(worker, pending, alpha)
        averaged = average_deltas([w.pseudo_gradients() for w in workers], [w.tokens_since_outer for w in workers])
        done += steps
        for worker in workers:
            if done >= workload.steps:  # the last round: nothing left to overlap with
                worker.apply_outer(averaged)
            else:
                worker.begin_overlap(eager=mode == "eager")
        pending = None if done >= workload.steps else averaged
    if len({w.outer_sha256() for w in workers}) != 1:
        raise AssertionError("workers ended with different θ_outer")
    windows = eval_windows(data.eval, workload.seq_len, workload.eval_windows)
    return eval_loss(workers[0].model, windows), time.perf_counter() - started  # θ_inner is θ_outer after the last


@torch.no_grad()
def land(worker: DiLoCo, average: list[torch.Tensor], alpha: float) -> None:
    """The late average applied the node's way (apply_outer), then, with alpha < 1, Streaming
    DiLoCo's merge: θ_local = alpha x θ_local before the landing + (1 - alpha) x θ_outer(t+1)."""
    before = [p.detach().clone() for p in worker.params] if alpha < 1 else []
    worker.apply_outer(average)
    for p, kept, theta in zip(worker.params, before, worker.outer_params, strict=False):
        p.detach().copy_(kept.mul_(alpha).add_(theta.to(p.dtype), alpha=1 - alpha))


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The run's shape, as this script and scripts/experiments/fragment_sweep.py take it."""
    parser.add_argument("--h", type=int, default=50)
    parser.add_argument("--steps", type=int, default=CHEAP.steps)
    parser.add_argument("--seq-len", type=int, default=CHEAP.seq_len)
    parser.add_argument("--json", action="store_true")


def run_of(args: argparse.Namespace) -> tuple[Workload, Setting, Any]:
    """(workload, setting, corpus) of add_run_arguments' flags; one torch thread (deterministic)."""
    torch.set_num_threads(1)
    return Workload(steps=args.steps, seq_len=args.seq_len), Setting(name=f"H{args.h}", h=HSchedule(target=args.h)), \
        load_corpus()  # fmt: skip


def shape_line(workload: Workload, h: int) -> str:
    return f"{workload.workers} workers, {workload.model}, {workload.steps} inner steps, seq {workload.seq_len}, H {h}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="blocking,delayed,eager")
    parser.add_argument("--delays", default="1", help="when the average lands, as a fraction of H")
    parser.add_argument("--alphas", default="1", help="Streaming DiLoCo's merge on landing (1: none)")
    add_run_arguments(parser)
    args = parser.parse_args()
    workload, setting, data = run_of(args)
    rows: list[dict[str, Any]] = []
    blocking = None
    for mode in args.modes.split(","):
        overlapped = [(float(d), float(a)) for d in args.delays.split(",") for a in args.alphas.split(",")]
        for delay, alpha in [(0.0, 1.0)] if mode == "blocking" else overlapped:
            started = time.perf_counter()
            loss = train_diloco(data, workload, setting).eval_loss if mode == "blocking" else \
                train_overlapped(data, workload, setting, mode, delay, alpha)[0]  # fmt: skip
            blocking = loss if mode == "blocking" else blocking
            rows.append({"mode": mode, "delay": delay, "alpha": alpha, "H": args.h, "eval_loss": round(loss, 4),
                         "vs_blocking": round(loss / blocking, 4) if blocking else None,
                         "seconds": round(time.perf_counter() - started, 1)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{shape_line(workload, args.h)}")
    print("| mode | lands after | merge alpha | eval loss | vs blocking |\n|---|---:|---:|---:|---:|")
    for r in rows:
        lands, alpha = ("-", "-") if r["mode"] == "blocking" else (f"{r['delay']:g} H", f"{r['alpha']:g}")
        ratio = f"{r['vs_blocking']:.4f}" if r["vs_blocking"] else "-"
        print(f"| {r['mode']} | {lands} | {alpha} | {r['eval_loss']:.4f} | {ratio} |")
    if args.json:
        print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
