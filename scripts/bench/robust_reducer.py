"""Robust part reduction: how far each aggregator lands from the honest mean under each attack,
and what it costs.

    python -m scripts.bench.robust_reducer                 # table
    python -m scripts.bench.robust_reducer --json          # one JSON object

Workload: 4 honest contributions + 1 attacker of the same weight (the largest a capped weight
allows). Honest pseudo-gradients are "non-iid": a shared direction plus per-node noise of the
same norm (cosine ~0.5 between two honest nodes, the regime of DiLoCo deltas on different data
shards), each passed through the int8 codec as it would be on the wire (the attacker's too,
when the codec can carry it: NaN and inf cannot, and reach the aggregator only as an owner's own
slice). Attacks: none (5 honest), x1e4 (its own delta times 1e4), 1e30 (every element 1e30),
sign-flip (minus the honest mean, rescaled to an honest norm), NaN, inf. "real" and "real
sign-flip": the honest contributions are real DiLoCo deltas of the tiny model (16 inner steps
from one init, each node on its own batches of the built-in corpus).

Aggregators:
- mean: today's weighted mean (non-finite contributions cannot even be encoded: NaN row);
- cclip: swarm.averaging.robust (screen, CenteredClip from the geometric median, tau =
  TAU_FACTOR x the median pairwise distance), also at tau factors 0.5 and 2;
- geomed: the weighted geometric median alone (Weiszfeld);
- clip+tm: norm clipping to 2 x the weighted median norm (non-finite dropped), then the
  coordinate-wise trimmed mean dropping the largest and the smallest value of each coordinate.

Reported: relative error |aggregate - honest mean| / |honest mean| (honest mean: the exact fp32
mean of the honest contributions), at --elements (default 1M), and ms per --time-elements
(default 16M) part with 5 contributions, median of --repeat runs, on --threads threads, without
an attacker and with the sign-flipping one (cclip then makes its second pass). The swarm's own
reduction (rounds/reduction.py) decodes int8 payloads instead of stacking fp32 inputs; its cost against
the plain mean is in `python -m scripts.bench.allreduce --aggregators mean,robust`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from swarm.averaging import robust
from swarm_kernels import get_codec

ATTACKS = ("none", "none-uneq", "x1e4", "x30", "1e30", "sign-flip", "nan", "inf", "real", "real sign-flip")
REAL_INNER_STEPS = 16
NOISE = (0.5, 1.0, 1.5, 2.0, 1.0)  # "none-uneq": honest noise levels and weights differ
UNEQUAL_WEIGHTS = [1.0, 1.5, 2.0, 0.5, 1.0]
HONEST = 4

Aggregator = Callable[[list[torch.Tensor], list[float]], torch.Tensor]


def honest_deltas(n: int, numel: int, seed: int, noise: tuple[float, ...] = (1.0,) * 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(numel, generator=gen) * 1e-3
    return [shared + torch.randn(numel, generator=gen) * 1e-3 * noise[i] for i in range(n)]


def real_deltas(n: int, seed: int) -> list[torch.Tensor]:
    """Real DiLoCo pseudo-gradients: n copies of the tiny model from one init, each trained
    REAL_INNER_STEPS inner steps on its own batches of the built-in corpus, flattened."""
    from swarm.model.data import load_data, node_generator, sample_batch
    from swarm.model.diloco import DiLoCo, DiLoCoConfig
    from swarm.model.llama import build_model
    from swarm.model.presets import preset

    data = load_data("stdlib")
    config = DiLoCoConfig(inner_steps=REAL_INNER_STEPS, warmup_steps=2)
    deltas = []
    for node in range(n):
        diloco = DiLoCo(build_model(preset("tiny", vocab_size=data.vocab_size), seed), config)
        for step in range(REAL_INNER_STEPS):
            diloco.inner_step(*sample_batch(data.train, 8, 64, node_generator(bytes([node]), step)))
        deltas.append(torch.cat([d.reshape(-1) for d in diloco.pseudo_gradients()]))
    return deltas


def attacker(attack: str, honest: list[torch.Tensor]) -> torch.Tensor | None:
    mean = torch.stack(honest).mean(0)
    if attack.startswith("none") or attack == "real":
        return None
    if attack in ("x1e4", "x30"):
        return honest[0] * float(attack[1:])
    if attack == "1e30":
        return torch.full_like(mean, 1e30)
    if attack.endswith("sign-flip"):
        return -mean * (honest[0].norm() / mean.norm())
    return torch.full_like(mean, math.nan if attack == "nan" else math.inf)


def on_the_wire(x: torch.Tensor) -> torch.Tensor:
    """x as the owner sees it after the int8 codec (block 64); as it is if the codec refuses it."""
    if not bool(torch.isfinite(x).all()):
        return x
    codec = get_codec("int8", block_size=64)
    return codec.decode(codec.encode(x), x.numel())


def mean(xs: list[torch.Tensor], w: list[float]) -> torch.Tensor:
    acc = torch.zeros_like(xs[0])
    for x, wk in zip(xs, w, strict=True):
        acc.add_(x, alpha=wk)
    return acc / sum(w)


def cclip(tau_factor: float) -> Aggregator:
    return lambda xs, w: robust.robust_aggregate(xs, w, tau_factor=tau_factor)[0]


def geomed(xs: list[torch.Tensor], w: list[float]) -> torch.Tensor:
    gram = robust.gram_matrix(xs)
    kept = [k for k in range(len(xs)) if math.isfinite(gram[k][k])]
    g = [[gram[i][j] for j in kept] for i in kept]
    a = robust.geometric_median(g, [w[k] for k in kept])
    coefficients = [0.0] * len(xs)
    for slot, k in enumerate(kept):
        coefficients[k] = a[slot]
    return robust.combine(xs, coefficients)


def clip_trimmed_mean(xs: list[torch.Tensor], w: list[float], kappa: float = 2.0, chunk: int = 1 << 18) -> torch.Tensor:
    norms = [float(x.double().norm()) for x in xs]
    kept = [k for k in range(len(xs)) if math.isfinite(norms[k])]
    limit = kappa * robust.weighted_median([norms[k] for k in kept], [w[k] for k in kept])
    scales = [min(1.0, limit / norms[k]) if norms[k] > 0 else 1.0 for k in kept]
    trim = 1 if len(kept) >= 3 else 0
    out = torch.empty_like(xs[0])
    for lo in range(0, out.numel(), chunk):
        block = torch.stack([xs[k][lo : lo + chunk] * s for k, s in zip(kept, scales, strict=True)])
        ordered = block.sort(dim=0).values
        out[lo : lo + chunk] = ordered[trim : len(kept) - trim].mean(0)
    return out


AGGREGATORS: dict[str, Aggregator] = {
    "mean": mean,
    "cclip": cclip(robust.TAU_FACTOR),
    "cclip tau x0.5": cclip(0.5 * robust.TAU_FACTOR),
    "cclip tau x2": cclip(2 * robust.TAU_FACTOR),
    "geomed": geomed,
    "clip+tm": clip_trimmed_mean,
}


def relative_errors(numel: int, seed: int) -> dict[str, dict[str, float]]:
    errors: dict[str, dict[str, float]] = {name: {} for name in AGGREGATORS}
    real = real_deltas(HONEST + 1, seed)
    for attack in ATTACKS:
        unequal = attack == "none-uneq"
        honest = honest_deltas(HONEST + 1, numel, seed, NOISE if unequal else (1.0,) * 5)
        if attack.startswith("real"):
            honest = real
        weights = UNEQUAL_WEIGHTS if unequal else [1.0] * (HONEST + 1)
        bad = attacker(attack, honest[:HONEST])
        if bad is not None:
            honest, weights = honest[:HONEST], weights[:HONEST]
        w = torch.tensor(weights, dtype=torch.float64)[:, None]
        truth = (torch.stack(honest).double() * w).sum(0) / w.sum()
        xs = [on_the_wire(x) for x in (honest if bad is None else [*honest, bad])]
        weights = weights if bad is None else [*weights, 1.0]
        for name, aggregate in AGGREGATORS.items():
            if name == "mean" and attack in ("nan", "inf"):
                errors[name][attack] = math.nan  # the codec refuses it; an own slice would poison
                continue
            out = aggregate(xs, weights).double()
            errors[name][attack] = float((out - truth).norm() / truth.norm())
    return errors


def timings(numel: int, seed: int, repeat: int) -> dict[str, tuple[float, float]]:
    """(ms without an attacker, ms with a sign-flipping one: a second pass where it clips)."""
    honest = honest_deltas(HONEST + 1, numel, seed)
    bad = attacker("sign-flip", honest[:HONEST])
    inputs = [[on_the_wire(x) for x in honest], [on_the_wire(x) for x in [*honest[:HONEST], bad]]]  # type: ignore[list-item]
    w = [1.0] * (HONEST + 1)
    runs: dict[str, list[list[float]]] = {name: [[], []] for name in AGGREGATORS}
    for _ in range(repeat):  # interleaved: a change of load hits every aggregator alike
        for name, aggregate in AGGREGATORS.items():
            for case, xs in enumerate(inputs):
                started = time.perf_counter()
                aggregate(xs, w)
                runs[name][case].append(time.perf_counter() - started)
    return {name: (1e3 * statistics.median(a), 1e3 * statistics.median(b)) for name, (a, b) in runs.items()}


def run_bench(elements: int, time_elements: int, repeat: int, seed: int) -> dict[str, Any]:
    errors = relative_errors(elements, seed)
    ms = timings(time_elements, seed, repeat)
    rows = [{"aggregator": name, "ms_per_part": ms[name][0], "ms_per_part_attacked": ms[name][1],
             **{f"err_{a}": errors[name][a] for a in ATTACKS}} for name in AGGREGATORS]  # fmt: skip
    return {"elements": elements, "time_elements": time_elements, "threads": torch.get_num_threads(),
            "contributions": HONEST + 1, "rows": rows}  # fmt: skip


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (f"Relative error to the honest mean ({HONEST} honest + 1 attacker, {result['elements']:,} elements); "
             f"ms per {result['time_elements'] / 2**20:.0f}M-element part, {result['threads']} threads")  # fmt: skip
    table = Table(title=title)
    for column in ("aggregator", *ATTACKS, "ms / part", "ms attacked"):
        table.add_column(column, justify="right")
    for row in result["rows"]:
        table.add_row(row["aggregator"], *(f"{row[f'err_{a}']:.3g}" for a in ATTACKS), f"{row['ms_per_part']:.0f}",
                      f"{row['ms_per_part_attacked']:.0f}")  # fmt: skip
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=1 << 20)
    parser.add_argument("--time-elements", type=int, default=16 << 20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = run_bench(args.elements, args.time_elements, args.repeat, args.seed)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
