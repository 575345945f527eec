"""Robust aggregation of one part: a bounded-influence, deterministic replacement for the mean.

    aggregate, fates = robust_aggregate([x_0, x_1, ...], [w_0, w_1, ...])

The rule (CenteredClip, Karimireddy, He & Jaggi 2021, as used by Gorbunov et al. 2022,
"Secure Distributed Training at Scale", with a screen, and a radius chosen from the data):

1. Screen. A contribution whose squared norm is NaN or inf (a NaN/inf element, or elements
   beyond ~1.8e19 whose squares overflow fp32) is dropped ("not finite"). So is one whose norm
   exceeds ABSURD_FACTOR x the weighted median norm ("absurd": a 1e4-scaled or 1e30 delta).
2. Radius. tau = TAU_FACTOR x the spread: for each kept contribution the weighted median of its
   distances to the others, then the weighted median of those. It is the honest majority's
   pairwise distance, whatever the scale of the pseudo-gradients (two contributions: their
   distance, so two members are never clipped against each other).
3. Centre. Start from the weighted geometric median of the kept contributions (Weiszfeld's
   iteration), whose breakdown point is 1/2 of the weight.
4. Clip. CenteredClip to its fixed point: v <- v + sum_k w_k min(1, tau/|x_k - v|)(x_k - v) / W.
   A contribution within tau of the result counts fully; one beyond counts as if it sat at
   distance tau. With nobody beyond tau (no outlier) the fixed point IS the weighted mean.

Influence and breakdown point: while the malicious contributions hold a weight fraction
delta < 1/2, the median norm, the geometric median and the spread are set by the honest
majority: a contribution that is not dropped moves the result by at most about
(its weight / W) x tau, a fraction of the honest spread, whatever it sends. At delta >= 1/2
(a majority of the weight, e.g. 1 of 2 equal members) nothing can tell who is honest: the screen
keeps the smaller norms (lower weighted median) and nothing else is promised
(tests/averaging/test_robust.py pins both sides).

Measured (python -m scripts.bench.robust_reducer; 4 honest = shared direction + per-node noise
of the same norm, through the int8 codec, + 1 attacker of the same weight; relative error to the
honest mean; "none-uneq": 5 honest, noise 0.5x..2x, weights 0.5..2; "real": 5 real DiLoCo deltas
of the tiny model, 16 inner steps on different batches; ms per 16M-element part, 5 fp32
contributions, one thread, without / with a sign-flipping attacker):

    rule            none   none-uneq x1e4   x30   1e30    sign-flip NaN/inf  real   real flip ms
    mean            0.003  0.004     2.5e3  7.4   1.8e32  0.45      poison 0.002  0.44      88
    cclip (tau x1)  0.003  0.010     0.004  0.32  0.004   0.32      0.004  0.002  0.26      106/165
    cclip tau x0.5  0.003  0.080     0.004  0.25  0.004   0.20      0.004  0.020  0.17      147
    cclip tau x2    0.003  0.004     0.004  0.63  0.004   0.45      0.004  0.002  0.44      93
    geometric med.  0.003  0.108     0.26   0.26  0.004   0.20      0.004  0.020  0.17      160
    clip+trim mean  0.15   0.29      0.31   0.31  0.33    0.30      0.20   0.13   0.21      1160

In the swarm's reduction (int8 payloads, n = 4, 16M part, one thread) the robust rule takes
~97 ms against the mean's ~68 ms (n = 5: 111 vs 75). Round time of `python -m
scripts.bench.allreduce --sizes 4 --elements 64M --codecs int8 --repeats 5 --aggregators
mean,robust,robust,mean` on this shared machine: pooled medians 1.00 s (mean) and 0.98 s
(robust), i.e. the difference is below the noise; the 29 ms per part bounds it at ~3-6%.

CenteredClip with tau = 1 x the spread is the choice: no bias when nobody is an outlier (none on
real deltas, 1% with unequal honest norms and weights, against 2-11% for a smaller radius or the
geometric median and 13-29% for the trimmed mean, which cannot use weights and is the
median-like vector of non-iid deltas, not their mean), the attacks that can be told apart
(x1e4, 1e30, NaN, inf) leave only the codec's error, and one that cannot (an ordinary-norm sign
flip, or x30) is bounded at its weight share of the spread (0.32 vs the mean's 0.45 and 7.4;
0.26 vs 0.44 on real deltas). Coordinate-wise trimming costs a sort per coordinate (10x slower)
and was worse on nearly every column.

How it is computed: every candidate point (weighted mean, geometric median, CenteredClip
iterate) is a linear combination sum_k a_k x_k of the contributions, so all distances follow
from the Gram matrix G_ij = <x_i, x_j>: the rule itself runs on n x n numbers.

Determinism (all members and auditors must get the same bits). Members agree by construction
(one owner reduces, everyone gets its bytes); an auditor re-running the reduction needs the same
bits from the same inputs:
- the Gram matrix: per cache-sized piece of CHUNK elements, one fp32 (n x piece) @ (piece x n)
  product, accumulated in float64 piece after piece in a fixed order, then each entry snapped
  to a grid of 2**-SNAP_BITS x sqrt(G_ii G_jj). The BLAS product of n x n outputs over one piece
  does not depend on the thread count (tested: 1, 2, 4 threads), but its summation order may
  depend on the CPU's BLAS kernels (SIMD width): fp32 sums that differ by ~1e-7 relative land on
  the same 2**-20 grid point most of the time, not always. So bit agreement across CPU types is
  NOT guaranteed: an auditor on another CPU should compare within the codec's tolerance. An
  exact integer Gram over the int8 codes would make it so (not done: the owner's own slice is
  fp32);
- the iterations: plain Python float arithmetic in a fixed order (IEEE, the same everywhere);
- the result: sum_k fp32(a_k) * x_k per piece, as one matrix-vector product when every a_k is
  nonzero (BLAS, thread-independent as tested), else term by term in member order (a multiply
  and an add each, never fused).
Tested bit-identical across torch.set_num_threads(1), (2) and (4).

Cost: one pass over the part decodes a wire chunk of every contribution into an (n, chunk)
buffer and, piece by piece while it is in cache, adds to the Gram matrix and computes the
weighted mean; a second pass (decoding again) only when someone is dropped or clipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

ABSURD_FACTOR = 100.0  # a norm beyond this many median norms is dropped
TAU_FACTOR = 1.0  # clipping radius, in units of the spread (median pairwise distance)
BLOCK = 1 << 21  # elements per block that robust_aggregate stacks
CHUNK = 1 << 16  # elements per cache-sized piece of a block (one Gram update, one combine)
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


Blocks = Callable[[], Iterator[tuple[int, torch.Tensor]]]


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
    out, fates, _ = robust_reduce(
        stacked(contributions), numel, weights, tau_factor=tau_factor, absurd_factor=absurd_factor
    )
    return out, fates


def robust_reduce(
    blocks: Blocks,
    numel: int,
    weights: list[float],
    *,
    tau_factor: float = TAU_FACTOR,
    absurd_factor: float = ABSURD_FACTOR,
) -> tuple[torch.Tensor, list[Fate], list[list[float]]]:
    """robust_aggregate over contributions given block by block: `blocks()` yields (lo, block),
    block an (n, width) fp32 tensor (contribution k's elements [lo, lo + width) in row k), in
    order, covering [0, numel). One pass computes the Gram matrix and the weighted mean; a second
    call of `blocks()` happens only when the rule drops or clips someone. Also returns the Gram
    matrix the rule ran on (the owner audit's receipt carries it: audit/arithmetic.py)."""
    mean = mean_coefficients(weights)
    out = torch.empty(numel, dtype=torch.float32)
    gram = data_pass(blocks, numel, len(weights), out, mean, gram=True)
    coefficients, fates = robust_coefficients(gram, weights, tau_factor=tau_factor, absurd_factor=absurd_factor)
    if coefficients != mean:
        data_pass(blocks, numel, len(weights), out, coefficients, gram=False)
    return out, fates, gram


def stacked(xs: list[torch.Tensor]) -> Blocks:
    """Blocks over separate contributions: BLOCK elements of each, copied into one buffer."""

    def blocks() -> Iterator[tuple[int, torch.Tensor]]:
        numel = xs[0].numel()
        buffer = torch.empty(len(xs), min(BLOCK, numel), dtype=torch.float32)
        for lo in range(0, numel, BLOCK):
            hi = min(lo + BLOCK, numel)
            block = buffer[:, : hi - lo]
            for row, x in zip(block, xs, strict=True):
                row.copy_(x[lo:hi])
            yield lo, block

    return blocks


def mean_coefficients(weights: list[float]) -> list[float]:
    """w_k / W: the coefficients of the weighted mean (a bad weight counts as 0)."""
    usable = [w if math.isfinite(w) and w >= 0 else 0.0 for w in weights]
    total = math.fsum(usable)
    return [w / total if total > 0 else 0.0 for w in usable]


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
    final = [
        f if f is not None else Fate(clip=clips[kept.index(k)]) if k in kept else Fate() for k, f in enumerate(fates)
    ]
    if not any(f.touched for f in final):  # nobody dropped or clipped: exactly the weighted mean
        return mean_coefficients(weights), final
    coefficients = [0.0] * n
    for slot, k in enumerate(kept):
        coefficients[k] = a[slot]
    return coefficients, final


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


def data_pass(
    blocks: Blocks, numel: int, n: int, out: torch.Tensor, coefficients: list[float], *, gram: bool
) -> list[list[float]]:
    """One pass over the blocks: out = sum_k fp32(c_k) * x_k and, if asked, the Gram matrix (see
    the module docstring; DataPass is the same pass fed one block at a time)."""
    data = DataPass(numel, n, out, coefficients, gram=gram)
    for lo, block in blocks():
        data.add(lo, block)
    return data.finish()


class DataPass:
    """data_pass fed block by block, in order, as the blocks become available (a part owner that
    reduces each wire chunk as it arrives: rounds/reduction.py). With every c_k nonzero (every row
    finite, or the result is thrown away) the sum is one matrix-vector product (piece^T c) per
    piece; otherwise the nonzero terms, in member order, a multiply and an add each (a dropped
    row may hold NaN: 0 * NaN is NaN)."""

    def __init__(self, numel: int, n: int, out: torch.Tensor, coefficients: list[float], *, gram: bool) -> None:
        self.numel, self.n, self.out, self.gram = numel, n, out, gram
        self.row = torch.tensor(coefficients, dtype=torch.float32)
        self.terms = [k for k in range(n) if coefficients[k] != 0.0]
        self.total = torch.zeros(n, n, dtype=torch.float64)
        self.scratch = torch.empty(min(CHUNK, max(numel, 1)), dtype=torch.float32)
        self.covered = 0

    def add(self, lo: int, block: torch.Tensor) -> None:
        """Elements [lo, lo + width) of every contribution (row k: contribution k)."""
        if lo != self.covered or block.shape[0] != self.n:
            raise ValueError(f"blocks must cover the part in order: block at {lo}, expected {self.covered}")
        width, terms, row = block.shape[1], self.terms, self.row
        for start in range(0, width, CHUNK):
            piece = block[:, start : start + CHUNK]
            if self.gram:
                self.total += torch.mm(piece, piece.t()).double()
            target = self.out[lo + start : lo + start + piece.shape[1]]
            if len(terms) == self.n:
                torch.mv(piece.t(), row, out=target)
            elif not terms:
                target.zero_()
            else:
                torch.mul(piece[terms[0]], row[terms[0]], out=target)
                tmp = self.scratch[: piece.shape[1]]
                for k in terms[1:]:
                    torch.mul(piece[k], row[k], out=tmp)
                    target.add_(tmp)
        self.covered = lo + width

    def finish(self) -> list[list[float]]:
        """The Gram matrix, each entry snapped (zeros when not asked for)."""
        if self.covered != self.numel:
            raise ValueError(f"blocks covered {self.covered} of {self.numel} elements")
        raw = self.total.tolist()
        n = self.n
        return [[_snap(raw[i][j], raw[i][i], raw[j][j]) for j in range(n)] for i in range(n)]


def gram_matrix(xs: list[torch.Tensor]) -> list[list[float]]:
    """G_ij = <x_i, x_j>, as robust_aggregate computes it (inf or NaN where fp32 overflows)."""
    numel = xs[0].numel()
    return data_pass(stacked(xs), numel, len(xs), torch.empty(numel), [0.0] * len(xs), gram=True)


def combine(xs: list[torch.Tensor], coefficients: list[float]) -> torch.Tensor:
    """sum_k fp32(a_k) * x_k, as robust_aggregate computes it."""
    out = torch.empty(xs[0].numel(), dtype=torch.float32)
    data_pass(stacked(xs), out.numel(), len(xs), out, coefficients, gram=False)
    return out


def _snap(value: float, gii: float, gjj: float) -> float:
    """value rounded to a multiple of 2**-SNAP_BITS x sqrt(gii gjj) (a power of two at or below
    it), which Cauchy-Schwarz says bounds |value|."""
    if not (math.isfinite(value) and math.isfinite(gii) and math.isfinite(gjj)) or gii <= 0 or gjj <= 0:
        return value
    exponent = math.frexp(math.sqrt(gii) * math.sqrt(gjj))[1] - SNAP_BITS
    return math.ldexp(round(math.ldexp(value, -exponent)), exponent)
