"""Codecs and error feedback against exact averaging: the loss each costs and the bytes it saves.

For each H and each codec (none = exact fp32 averaging), with and without error feedback (swarm/
model/error_feedback.py), K DiLoCo workers train as in scripts/experiments/diloco_sim.py (one process, the
same windows and schedule), except that each worker's pseudo-gradient and the average travel
through the codec, as they do in a swarm round (a member's contribution, then the part owner's
result). Reported per run: the final eval loss, its ratio to exact averaging at the same H, the
share of the DiLoCo-vs-alone gap to data-parallel it closes, and the bytes per parameter on the
wire with the reduction against fp32 data-parallel:

    reduction = H x 4 bytes / (codec bytes per parameter)

(data-parallel all-reduces 4 bytes per parameter every inner step; DiLoCo the codec's bytes once
per H; both move 2(n-1)/n of that in a butterfly, which cancels).

    python -m scripts.experiments.codec_sweep --codecs int8,int4,int2 --hs 50,100 --json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from scripts.experiments.diloco_sim import (
    CODEC_BLOCK,
    HSchedule,
    Setting,
    Workload,
    gap_closed,
    inner_config,
    load_corpus,
    train_data_parallel,
    train_diloco,
    worker_peers,
)
from scripts.experiments.diloco_sweep import CHEAP
from swarm_kernels.codecs import get_codec


def bytes_per_parameter(codec: str, density: float = 1.0, numel: int = 1 << 20) -> float:
    """Bytes on the wire per parameter of the model: the codec's, for the share of blocks sent."""
    per_value = 4.0 if codec == "none" else get_codec(codec, block_size=CODEC_BLOCK).encoded_nbytes(numel) / numel
    return per_value * density


def run(
    workload: Workload, hs: list[int], codecs: list[str], feedback: list[float], densities: list[float]
) -> list[dict[str, Any]]:
    data = load_corpus()
    peers = worker_peers(workload)
    base = inner_config(workload)
    alone = train_data_parallel(data, workload, peers[:1], base).eval_loss
    ddp = train_data_parallel(data, workload, peers, base).eval_loss
    rows = []
    for h in hs:
        exact: float | None = None
        plan = [("none", 0.0, 1.0)] + [(c, ef, d) for c in codecs for d in densities for ef in feedback]
        for codec, ef, density in plan:
            setting = Setting(name=f"H{h}_{codec}:{density:g}_ef{ef:g}", h=HSchedule(target=h), codec=codec,
                              error_feedback=ef, density=density)  # fmt: skip
            started = time.perf_counter()
            result = train_diloco(data, workload, setting)
            exact = result.eval_loss if codec == "none" else exact
            per_param = bytes_per_parameter(codec, density)
            rows.append({
                "H": h, "codec": codec, "density": density, "error_feedback": ef,
                "eval_loss": round(result.eval_loss, 4),
                "vs_exact": round(result.eval_loss / exact, 4) if exact else None,
                "gap_closed": round(gap_closed(alone, ddp, result.eval_loss), 3),
                "bytes_per_param": round(per_param, 4), "reduction_vs_dp": round(h * 4.0 / per_param, 1),
                "seconds": round(time.perf_counter() - started, 1),
                "alone_eval_loss": round(alone, 4), "ddp_eval_loss": round(ddp, 4),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def print_table(rows: list[dict[str, Any]], workload: Workload) -> None:
    print(f"\n{workload.workers} workers, {workload.model}, {workload.steps} inner steps, seq {workload.seq_len}")
    print("| H | codec | density | error feedback | eval loss | vs exact | gap closed | bytes/param | vs fp32 DP |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        ef = "off" if not r["error_feedback"] else f"decay {r['error_feedback']:g}"
        print(f"| {r['H']} | {r['codec']} | {r['density']:g} | {ef} | {r['eval_loss']:.4f} | {r['vs_exact']:.4f} | "
              f"{r['gap_closed']:.3f} | {r['bytes_per_param']:.4f} | {r['reduction_vs_dp']:,.0f}x |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codecs", default="int8", help="comma-separated codecs besides exact averaging")
    parser.add_argument("--hs", default="50", help="comma-separated H values")
    parser.add_argument("--feedback", default="0,1", help="error-feedback decays to try (0: off)")
    parser.add_argument("--densities", default="1", help="shares of the blocks each round sends")
    parser.add_argument("--steps", type=int, default=CHEAP.steps)
    parser.add_argument("--seq-len", type=int, default=CHEAP.seq_len)
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON document at the end")
    args = parser.parse_args()
    torch.set_num_threads(1)  # deterministic, as diloco_sweep
    workload = Workload(steps=args.steps, seq_len=args.seq_len)
    rows = run(workload, [int(h) for h in args.hs.split(",")], [c for c in args.codecs.split(",") if c],
               [float(f) for f in args.feedback.split(",")], [float(d) for d in args.densities.split(",")])  # fmt: skip
    print_table(rows, workload)
    if args.json:
        print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
