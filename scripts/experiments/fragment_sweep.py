"""Streaming DiLoCo's fragments, simulated: does syncing the model a fragment at a time shrink
what an overlapped outer step costs in loss?

scripts/experiments/overlap_sweep.py measures the whole model's average landing `delay` x H inner steps late:
the later it lands, the more it costs. On a link, a fragment of 1/P of the model takes about 1/P
of the round's time, so its average lands P times sooner. Here, as in Douillard et al. 2025
("Streaming DiLoCo"), the model's parameters are cut into P fragments of consecutive tensors of
about equal size (swarm/model/fragments.py, as swarm-node --fragments cuts them);
fragment f is synced every H inner steps, at steps f*H/P + k*H (k >= 1). Its average lands
`delay` x H / P inner steps later (at the latest when the fragment syncs again) and is applied
the `mode` way, with the node's own rules (scripts/experiments/overlap_sweep.py, swarm-node --overlap):

    blocking  the fragment's outer step at once (delay 0)
    delayed   the workers go on from where they are; on landing,
              θ_fragment += θ_outer_fragment(new) - θ_fragment(at the sync)
    eager     the workers go on from θ_outer_fragment moved by their OWN Δ; on landing,
              θ_fragment += θ_outer_fragment(new) - that proxy

At the run's end every fragment lands and is synced once more (blocking), so the final θ_outer
holds all the run's steps; the eval loss is of that θ_outer. Nesterov's outer step is the node's
(DiLoCo._outer_update itself, on worker 0's θ_outer, which all share); K workers, data windows and schedule are
scripts/experiments/diloco_sim.py's. P = 1 is overlap_sweep's run to the bit (with delay 0: blocking DiLoCo).

    python -m scripts.experiments.fragment_sweep --fragments 1,4 --modes blocking,eager --delays 0.3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

import torch

from scripts.experiments.diloco_sim import (
    Setting,
    Workload,
    _ScheduledDiLoCo,
    average_deltas,
    worker_batch,
    worker_peers,
)
from scripts.experiments.overlap_sweep import add_run_arguments, run_of, shape_line
from swarm.model.data import eval_windows
from swarm.model.fragments import fragments_of
from swarm.model.llama import build_model
from swarm.model.loss import eval_loss
from swarm.model.presets import preset

MODES = ("blocking", "delayed", "eager")


@dataclass(slots=True)
class InFlight:
    """One fragment's round: its average lands at inner step `lands` (steps done)."""

    fragment: int
    lands: int
    average: list[torch.Tensor]
    bases: list[list[torch.Tensor]]  # per worker: what the landing moves onto θ_outer(new)


def sync_steps(fragment: int, fragments: int, h: int, steps: int) -> list[int]:
    """The inner steps (counted as steps done) at which `fragment` starts a round: f*H/P + k*H,
    k >= 1, before the run's end (the end syncs every fragment anyway)."""
    offset = fragment * h // fragments
    return list(range(offset + h, steps, h))


@torch.no_grad()
def train_fragments(data: Any, workload: Workload, setting: Setting, fragments: int, mode: str,
                    delay: float) -> float:  # fmt: skip
    """The final eval loss of K workers syncing `fragments` fragments, each round landing
    delay x H / fragments inner steps late, applied the `mode` way (the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    peers = worker_peers(workload)
    h = setting.h.target
    # our own outer clock: the workers never reach their H (no DiLoCo outer step), only the schedule counts
    config = dataclasses.replace(setting.diloco_config(workload), inner_steps=workload.steps + 1)
    workers = [_ScheduledDiLoCo(build_model(preset(workload.model), seed=workload.seed), config) for _ in peers]
    # the θ_outer and momentum the workers share (they agree bit for bit): worker 0's, which its
    # own DiLoCo never moves here, moved by the node's own Nesterov step (DiLoCo._outer_update)
    outer = workers[0]
    parts = fragments_of([t.numel() for t in outer.outer_params], fragments)
    lag = 0 if mode == "blocking" else max(1, round(delay * h / fragments))
    starts = {s: f for f in range(fragments) for s in sync_steps(f, fragments, h, workload.steps)}
    flying: list[InFlight] = []

    def land(round_: InFlight) -> None:
        indices = parts[round_.fragment]
        outer._outer_update(indices, round_.average, commit=True)
        for worker, base in zip(workers, round_.bases, strict=True):
            for i, b in zip(indices, base, strict=True):
                worker.params[i].add_(outer.outer_params[i] - b)

    def sync(fragment: int, done: int, lag_steps: int) -> None:
        for round_ in [r for r in flying if r.fragment == fragment]:  # its last round lands first, as
            land(round_)  # a node's does before its next outer step (a round as long as H lands now)
            flying.remove(round_)
        indices = parts[fragment]
        deltas = [[outer.outer_params[i] - w.params[i].detach() for i in indices] for w in workers]
        average = average_deltas(deltas, [1.0] * len(workers))  # equal batches: equal weights
        if lag_steps == 0:
            outer._outer_update(indices, average, commit=True)
            for worker in workers:
                for i in indices:
                    worker.params[i].copy_(outer.outer_params[i])
            return
        bases = []
        for worker, own in zip(workers, deltas, strict=True):
            if mode == "eager":
                proxy = outer._outer_update(indices, own, commit=False)
                for i, p in zip(indices, proxy, strict=True):
                    worker.params[i].copy_(p)
                bases.append(proxy)
            else:
                bases.append([worker.params[i].detach().clone() for i in indices])
        flying.append(InFlight(fragment, done + lag_steps, average, bases))

    for step in range(workload.steps):
        for round_ in [r for r in flying if r.lands == step]:
            land(round_)
            flying.remove(round_)
        with torch.enable_grad():
            for worker, peer in zip(workers, peers, strict=True):
                worker.inner_step(*worker_batch(data, workload, peer, step))
        if (fragment := starts.get(step + 1)) is not None:
            sync(fragment, step + 1, lag)
    for fragment in range(fragments):  # the run's end: what is in flight lands, then every fragment syncs
        sync(fragment, workload.steps, 0)
    model = workers[0].model
    for p, theta in zip(workers[0].params, outer.outer_params, strict=True):
        p.copy_(theta)
    return eval_loss(model, eval_windows(data.eval, workload.seq_len, workload.eval_windows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fragments", default="1,4", help="P values, comma-separated")
    parser.add_argument("--modes", default="blocking,eager")
    parser.add_argument("--delays", default="0.3", help="the whole model's landing, a fraction of H (/P each)")
    add_run_arguments(parser)
    args = parser.parse_args()
    workload, setting, data = run_of(args)
    rows: list[dict[str, Any]] = []
    reference = None  # blocking with P = 1: DiLoCo itself
    for fragments in [int(p) for p in args.fragments.split(",")]:
        for mode in args.modes.split(","):
            for delay in [0.0] if mode == "blocking" else [float(d) for d in args.delays.split(",")]:
                started = time.perf_counter()
                loss = train_fragments(data, workload, setting, fragments, mode, delay)
                if mode == "blocking" and fragments == 1:
                    reference = loss
                ratio = round(loss / reference, 4) if reference else None
                rows.append({"fragments": fragments, "mode": mode, "delay": delay, "H": args.h,
                             "eval_loss": round(loss, 4), "vs_diloco": ratio,
                             "seconds": round(time.perf_counter() - started, 1)})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    print(f"\n{shape_line(workload, args.h)}")
    print("| fragments | mode | whole model lands after | eval loss | vs DiLoCo |\n|---:|---|---:|---:|---:|")
    for r in rows:
        lands = "-" if r["mode"] == "blocking" else f"{r['delay']:g} H"
        ratio = f"{r['vs_diloco']:.4f}" if r["vs_diloco"] else "-"
        print(f"| {r['fragments']} | {r['mode']} | {lands} | {r['eval_loss']:.4f} | {ratio} |")
    if args.json:
        print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
