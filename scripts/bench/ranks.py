"""Nodes of N local ranks against nodes of one, for `bench_diloco --nproc-per-node N`.

The same swarm (bench_diloco's workload: --nodes nodes, the node batch --batch-size) runs twice
per configuration: each node one rank, then each node N gloo ranks on the CPU (the batch split
over them). Reported per run: the nodes' inner tokens/s (tokens / seconds in inner steps) and
overall tokens/s (tokens / wall seconds), their utilization (inner / wall seconds) and the bytes
each node sent in its all-reduce rounds, which must not change with N: the swarm sees one node.

Honest about the CPU: N ranks speed an inner step up only where N x --nodes processes find free
cores; on a 2-core machine 2 nodes of 2 ranks share 2 cores, so the figure there shows the
overhead of DDP and the command protocol, not the gain a machine of N GPUs gets.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any

RunSwarm = Callable[[Any, Any], dict[str, Any]]  # (NodeOptions, SwarmConfig) -> run_swarm's summary


def compare_ranks(run: RunSwarm, options: Any, configs: Sequence[Any], nproc: int, repeat: int,
                  log: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """{config: {"1": figures, "N": figures}} with medians over `repeat` runs each."""
    out: dict[str, Any] = {"nproc": nproc, "cpus": os.cpu_count(), "configs": {}}
    for config in configs:
        per_n: dict[str, Any] = {}
        for n in (1, nproc):
            summaries = []
            for attempt in range(repeat):
                log(f"swarm {config.name}, {n} rank(s) per node, run {attempt + 1}/{repeat} ...")
                summaries.append(run(dataclasses.replace(options, nproc=n), config))
            per_n[str(n)] = _figures(summaries)
        out["configs"][config.name] = per_n
    return out


def _figures(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    def median(key: str) -> float:
        return statistics.median(statistics.fmean(s[key]) for s in summaries)

    wall_rate, utilization = median("tokens_per_s"), median("utilization")
    return {
        "inner_tokens_per_s": wall_rate / utilization if utilization > 0 else 0.0,
        "tokens_per_s": wall_rate,
        "utilization": utilization,
        "bytes_sent_per_node": median("bytes_sent"),
        "eval_loss": statistics.median(s["eval_loss"] for s in summaries),
        "states_agree": all(s["states_agree"] for s in summaries),
    }


def print_ranks(res: dict[str, Any]) -> str:
    lines = [f"nodes of {res['nproc']} ranks vs 1 ({res['cpus']} CPUs; gloo on the CPU)",
             f"{'config':<10} {'ranks':>5} {'inner tok/s':>12} {'tok/s':>9} {'util':>6} {'MB sent/node':>13} "
             f"{'eval':>7} {'agree':>5}"]  # fmt: skip
    for name, per_n in res["configs"].items():
        for n, f in per_n.items():
            lines.append(f"{name:<10} {n:>5} {f['inner_tokens_per_s']:>12.0f} {f['tokens_per_s']:>9.0f} "
                         f"{f['utilization']:>6.1%} {f['bytes_sent_per_node'] / 1e6:>13.3f} {f['eval_loss']:>7.4f} "
                         f"{'yes' if f['states_agree'] else 'NO':>5}")  # fmt: skip
    return "\n".join(lines)
