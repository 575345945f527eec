"""Robust aggregation of one part: a bounded-influence, deterministic replacement for the mean.

    aggregate, fates = robust_aggregate([x_0, x_1, ...], [w_0, w_1, ...])

The rule (CenteredClip, Karimireddy, He & Jaggi 2021, as used by Gorbunov et al. 2022,
"Secure Distributed Training at Scale", with a screen and a radius chosen from the data):

1. Screen. A contribution whose squared norm is NaN or inf (a NaN/inf element, or elements
   beyond ~1.8e19 whose squares overflow fp32) is dropped ("not finite"). So is one whose norm
   exceeds ABSURD_FACTOR x the weighted median norm ("absurd": a 1e4-scaled or 1e30 delta).
2. Centre. Start from the weighted geometric median of the kept contributions (Weiszfeld's
   iteration), whose breakdown point is 1/2 of the weight.
3. Radius. tau = TAU_FACTOR x the weighted median distance of the kept contributions to that
   centre: the spread of the honest majority, whatever the scale of the pseudo-gradients.
4. Clip. CenteredClip to its fixed point: v <- v + sum_k w_k min(1, tau/|x_k - v|)(x_k - v) / W.
   A contribution within tau of the result counts fully; one beyond counts as if it sat at
   distance tau. With nobody beyond tau (no outlier) the fixed point IS the weighted mean.

Influence and breakdown point: as long as the contributions of weight fraction delta < 1/2 are
malicious, the median norm, the geometric median and the median distance are set by the honest
majority, and a malicious contribution moves the result by at most about
(its weight / W) x tau, i.e. a fraction of the honest spread, whatever it sends. At delta >= 1/2
(a majority of the weight, e.g. 1 of 2 equal members) no rule can tell who is honest: the
screen then keeps the smaller norms (lower weighted median), and nothing else is promised.

Measured (scripts/bench_robust_reducer.py, honest = shared direction + per-node noise of the
same norm, 4 honest + 1 attacker of equal weight): see that script's docstring for the table.
CenteredClip here was chosen over norm clipping + a coordinate-wise trimmed mean because it adds
no bias when nobody is an outlier (the trimmed mean of non-iid deltas is a different vector than
their mean), bounds a sign-flipped delta of ordinary norm as well, and costs less: everything
after the Gram matrix runs on n x n numbers.

How it is computed: every candidate point (weighted mean, geometric median, CenteredClip
iterate) is a linear combination sum_k a_k x_k of the contributions, so all distances follow
from the Gram matrix G_ij = <x_i, x_j>. The Gram matrix is the only pass over the data besides
the final combination: cost ~ n(n+1)/2 + n multiply-add passes over the part.

Determinism (all members and auditors must get the same bits):
- the Gram matrix: fp32 products (elementwise: exactly rounded, the same on every machine),
  summed in float64 per fixed row of GRAM_ROW elements (each row is summed by one thread, so
  the thread count does not matter), rows summed with math.fsum (correctly rounded, so their
  order does not matter), then each entry snapped to a grid of 2**-SNAP_BITS x sqrt(G_ii G_jj):
  a float64 row sum that differs in its last bits on another CPU (SIMD width) lands on the same
  grid point unless it sits within ~1e-13 of a grid boundary (probability ~1e-5 per entry);
- the iterations: plain Python float arithmetic in a fixed order (IEEE, the same everywhere);
- the result: sum_k fp32(a_k) * x_k in member order, as separate multiply and add kernels (no
  fused multiply-add), chunk by chunk: elementwise, hence independent of threads and SIMD.
Tested bit-identical across torch.set_num_threads(1) and (2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ABSURD_FACTOR = 100.0  # a norm beyond this many median norms is dropped
TAU_FACTOR = 1.0  # clipping radius, in units of the spread (median pairwise distance)
GRAM_ROW = 4096  # elements per float64 partial sum of a Gram entry
CHUNK = 1 << 18  # elements per cache-sized chunk of the passes over the data
SNAP_BITS = 20  # Gram entries are snapped to 2**-SNAP_BITS of their Cauchy-Schwarz bound
WEISZFELD_ITERATIONS = 64
CLIP_ITERATIONS = 64
CONVERGED = 1e-12  # stop iterating when no coefficient moves more than this


@dataclass(frozen=True, slots=True)
class Fate:
    """What the aggregator did with one contribution: dropped (with the reason) or kept with a
    clip factor in (0, 1] (1.0: counted fully; 0.1: counted as if 10x closer to the result)."""

    dropped: str | None = None
    clip: float = 1.0

    @property
    def touched(self) -> bool:
        return self.dropped is not None or self.clip < 1.0


def robust_aggregate(
    contributions: list[torch.Tensor],
    weights: list[float],
    *,
    tau_factor: float = TAU_FACTOR,
    absurd_factor: float = ABSURD_FACTOR,
) -> tuple[torch.Tensor, list[Fate]]:
    """The robust aggregate of equal-length 1-D fp32 contributions (never modified) with
    non-negative weights, and one Fate per contribution. Never raises on the values: a part
    whose contributions are all dropped (or all of zero weight) aggregates to zeros. A
    contribution of zero weight is kept (not dropped) but counts for nothing."""
    n = len(contributions)
    if n == 0 or len(weights) != n:
        raise ValueError("need one weight per contribution, and at least one contribution")
    numel = contributions[0].numel()
    if any(x.dtype != torch.float32 or x.dim() != 1 or x.numel() != numel for x in contributions):
        raise ValueError("contributions must be 1-D fp32 tensors of equal length")
    gram = gram_matrix(contributions)
    coefficients, fates = robust_coefficients(gram, weights, tau_factor=tau_factor, absurd_factor=absurd_factor)
    return combine(contributions, coefficients), fates


def robust_coefficients(
    gram: list[list[float]],
    weights: list[float],
    *,
    tau_factor: float = TAU_FACTOR,
    absurd_factor: float = ABSURD_FACTOR,
) -> tuple[list[float], list[Fate]]:
    """The rule on the Gram matrix alone: coefficients a_k of the aggregate sum_k a_k x_k."""
    n = len(gram)
    fates: list[Fate | None] = [None] * n
    for k in range(n):
        if not (math.isfinite(weights[k]) and weights[k] >= 0):
            fates[k] = Fate(dropped="bad weight")
        elif not math.isfinite(gram[k][k]):
            fates[k] = Fate(dropped="not finite")
    kept = [k for k in range(n) if fates[k] is None and weights[k] > 0]
    norms = {k: math.sqrt(gram[k][k]) for k in kept}
    limit = absurd_factor * weighted_median([norms[k] for k in kept], [weights[k] for k in kept])
    for k in list(kept):
        if norms[k] > limit:
            fates[k] = Fate(dropped=f"absurd: norm {norms[k]:.3g} > {absurd_factor:g} x median")
            kept.remove(k)
    while any(not math.isfinite(gram[i][j]) for i in kept for j in kept):  # fp32 products overflowed
        worst = max(kept, key=lambda k: (norms[k], k))
        fates[worst] = Fate(dropped="absurd: products overflow")
        kept.remove(worst)
    if not kept:
        return [0.0] * n, [f if f is not None else Fate() for f in fates]
    w = [weights[k] for k in kept]
    g = [[gram[i][j] for j in kept] for i in kept]
    tau = tau_factor * spread(g, w)
    a, clips = centered_clip(g, w, geometric_median(g, w), tau)
    coefficients = [0.0] * n
    for slot, k in enumerate(kept):
        coefficients[k] = a[slot]
        fates[k] = Fate(clip=clips[slot])
    return coefficients, [f if f is not None else Fate() for f in fates]  # zero weights: kept, unused


def weighted_median(values: list[float], weights: list[float]) -> float:
    """The lower weighted median: the smallest value with at least half the weight at or below it
    (so with two equal weights, the smaller value)."""
    if not values:
        return 0.0
    order = sorted(range(len(values)), key=lambda i: (values[i], i))
    total, seen = math.fsum(weights), 0.0
    for i in order:
        seen += weights[i]
        if seen >= total / 2:
            return values[i]
    return values[order[-1]]


def spread(g: list[list[float]], w: list[float]) -> float:
    """The honest majority's spread: for each contribution, the weighted median of its
    distances to the others; then the weighted median of those. (With two contributions: their
    distance, so that two honest members are never clipped.)"""
    m = len(w)
    if m < 2:
        return 0.0
    typical = []
    for i in range(m):
        others = [j for j in range(m) if j != i]
        pair = [math.sqrt(max(g[i][i] + g[j][j] - 2 * g[i][j], 0.0)) for j in others]
        typical.append(weighted_median(pair, [w[j] for j in others]))
    return weighted_median(typical, w)


def distances(g: list[list[float]], a: list[float]) -> list[float]:
    """|x_i - v| for v = sum_k a_k x_k, from the Gram matrix g of the x."""
    m = len(a)
    ga = [math.fsum(g[i][k] * a[k] for k in range(m)) for i in range(m)]
    vv = math.fsum(a[i] * ga[i] for i in range(m))
    return [math.sqrt(max(g[i][i] - 2 * ga[i] + vv, 0.0)) for i in range(m)]


def geometric_median(g: list[list[float]], w: list[float]) -> list[float]:
    """Weiszfeld's iteration from the weighted mean, as coefficients over the contributions."""
    total = math.fsum(w)
    a = [wk / total for wk in w]
    for _ in range(WEISZFELD_ITERATIONS):
        d = distances(g, a)
        scale = max(d)
        if scale == 0:
            return a
        floor = scale * 1e-9  # a point at the median itself: Weiszfeld's 1/d would blow up
        inv = [wk / max(dk, floor) for wk, dk in zip(w, d, strict=True)]
        norm = math.fsum(inv)
        new = [v / norm for v in inv]
        if max(abs(x - y) for x, y in zip(a, new, strict=True)) < CONVERGED:
            return new
        a = new
    return a


def centered_clip(g: list[list[float]], w: list[float], a: list[float], tau: float) -> tuple[list[float], list[float]]:
    """CenteredClip iterations from a, to the fixed point (bounded); the coefficients and each
    contribution's clip factor there."""
    m, total = len(w), math.fsum(w)
    clips = [1.0] * m
    for _ in range(CLIP_ITERATIONS):
        d = distances(g, a)
        clips = [1.0 if dk <= tau else tau / dk for dk in d]
        step = [w[k] * clips[k] / total for k in range(m)]
        moved = math.fsum(step)
        new = [a[i] * (1 - moved) + step[i] for i in range(m)]  # v + sum_k step_k (x_k - v)
        if max(abs(x - y) for x, y in zip(a, new, strict=True)) < CONVERGED:
            a = new
            break
        a = new
    d = distances(g, a)
    return a, [1.0 if dk <= tau else tau / dk for dk in d]


def gram_matrix(xs: list[torch.Tensor]) -> list[list[float]]:
    """G_ij = <x_i, x_j> (see the module docstring: deterministic, snapped); inf or NaN where the
    fp32 products overflow or an element is not finite."""
    n, numel = len(xs), xs[0].numel()
    rows = numel // GRAM_ROW * GRAM_ROW  # the whole rows; the tail is summed on its own
    partials: list[list[list[float]]] = [[[] for _ in range(n)] for _ in range(n)]
    product = torch.empty(min(CHUNK, max(numel, 1)), dtype=torch.float32)
    bounds = [(lo, min(lo + CHUNK, rows)) for lo in range(0, rows, CHUNK)]
    if rows < numel:
        bounds.append((rows, numel))
    for lo, hi in bounds:
        chunks = [x[lo:hi] for x in xs]
        out = product[: hi - lo]
        for i in range(n):
            for j in range(i, n):
                torch.mul(chunks[i], chunks[j], out=out)
                width = GRAM_ROW if hi - lo >= GRAM_ROW else hi - lo
                partials[i][j] += out.view(-1, width).sum(dim=1).tolist()
    gram = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i, n):
            gram[i][j] = gram[j][i] = _fsum(partials[i][j])
    return [[_snap(gram[i][j], gram[i][i], gram[j][j]) for j in range(n)] for i in range(n)]


def _fsum(values: list[float]) -> float:
    if any(math.isnan(v) for v in values):
        return math.nan
    try:
        return math.fsum(values)
    except (OverflowError, ValueError):  # inf + -inf, or an intermediate overflow
        return math.nan


def _snap(value: float, gii: float, gjj: float) -> float:
    """value rounded to a multiple of 2**-SNAP_BITS x sqrt(gii gjj) (a power of two at or below
    it), which Cauchy-Schwarz says bounds |value|."""
    if not (math.isfinite(value) and math.isfinite(gii) and math.isfinite(gjj)) or gii <= 0 or gjj <= 0:
        return value
    exponent = math.frexp(math.sqrt(gii) * math.sqrt(gjj))[1] - SNAP_BITS
    return math.ldexp(round(math.ldexp(value, -exponent)), exponent)


def combine(xs: list[torch.Tensor], coefficients: list[float]) -> torch.Tensor:
    """sum_k fp32(a_k) * x_k, in index order, a multiply and an add per term (never fused)."""
    numel = xs[0].numel()
    out = torch.zeros(numel, dtype=torch.float32)
    terms = [(x, torch.tensor(c, dtype=torch.float32)) for x, c in zip(xs, coefficients, strict=True) if c != 0.0]
    if not terms:
        return out
    scratch = torch.empty(min(CHUNK, numel), dtype=torch.float32)
    for lo in range(0, numel, CHUNK):
        hi = min(lo + CHUNK, numel)
        acc, tmp = out[lo:hi], scratch[: hi - lo]
        torch.mul(terms[0][0][lo:hi], terms[0][1], out=acc)
        for x, c in terms[1:]:
            torch.mul(x[lo:hi], c, out=tmp)
            acc.add_(tmp)
    return out
