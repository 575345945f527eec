"""Audited part owners: every member checks that each part's owner broadcast the robust
reduction of the contributions it received, at a few hundred KB of extra traffic per round.

The problem: the owner of part j alone sees the contributions to part j; its encoded result is
what every member applies. An owner that lies (broadcasts -100x the average, or anything else)
would move θ_outer as it likes, however robust the rule it claims to run.

The receipt. After the round every member holds every part's result bytes. The seed of part
j's audit (`part_seed`) is SHA-256 over the group id, j and the BLAKE3 digest of part j's
result (`result_digest`): the owner cannot know it before it has committed to its result.
Re-picking its result re-rolls the seed: a dense lie has no null space to hide in, whatever
the seed, but a lie of a few huge coordinates lands in one bucket with cancelling signs about
once in 2 x buckets seeds; the exact, seed-free check |result|^2 = a^T G a below catches that
one. Every member knows the seed as soon as it holds part j's result, so the sketches of part
j are computed while the other parts are still on the wire. Each owner then answers
`avg.receipt` with:

    {"inc": [member indices, in order], "g": [G_kl row by row], "b": buckets,
     "sk": bytes of float32[len(inc)][buckets]}

G is the Gram matrix of the included contributions (robust.py's, the one the rule ran on) and
sk_k = S(x_k) a seeded linear sketch of contribution k (`sketch`): the part is cut into rows of
`buckets` elements, row r is multiplied by a sign s_r and rotated by an offset t_r (both from
the seed), and the rows are summed. S is linear, and <S x, S y> estimates <x, y> with a
relative error of about sqrt(2 / buckets) (2% at 4096).

The checks (`check_receipt`), by every member, for every part it did not reduce itself:
- consistency (every member gets the same verdict from the same receipt): the coefficients a
  of the rule recomputed from G (robust.robust_coefficients, deterministic) must reproduce the
  result: S(result) = sum_k a_k sk_k within the int8 rounding of the result, and
  |result|^2 = a^T G a. G should agree with the sketches (<sk_k, sk_l> = G_kl within the
  sketch's error), but a disagreement is only logged as suspect (SUSPECT below): a forged
  Gram matrix lets an owner reweight the real contributions, not invent a result;
- its own contribution: its G entry and its sketch must be those of what it sent (within the
  int8 rounding of its payload): an owner that misstates an honest member's input is caught by
  that member.
An owner that fails is reported; the round fails (the group averages again without it) and
the owner is excluded for the rest of the run (audit/flat.py, Averager.excluded).

Cost, per member and round at n = 4, 64M elements, int8: +0.2% bytes (the receipts); one
BLAKE3 pass over every result, one sketch pass (with its squared norm) over each result and
each of our slices, and one over each contribution to our own part (AVX2, straight from the
int8 codes): ~76 ms of one core when alone (was ~200 ms with SHA-256, scalar sketches and
separate norm passes), 24 ms per audited part and 51 ms per receipt measured inside
`scripts/bench/allreduce.py`'s 4 processes on 2 cores. There the round is CPU-bound and the
audit still adds +35-70% round time; on real links the round is bound by
the network and the audit's CPU runs beside it (it starts as each part's result arrives).

Sketch accuracy: <S x, S y> has the relative error above for generic vectors; a structured one
(constant rows, or rows that repeat at the rotation offsets) can be sketched far off its norm
(a constant vector's sketch is ~0 when the row signs cancel). The Gram check runs only on
contributions the rule keeps, with SKETCH_SIGMAS of slack; a kept honest contribution that is
that structured could still be flagged (not seen on real deltas; not measured beyond tests).

What this does not catch: an owner that misstates only its own contribution or a colluding
member's: those are inputs it controls anyway, and the robust rule bounds their weight.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np
import torch

from swarm.averaging.robust import robust_coefficients
from swarm_kernels.sketch import SketchPlan, sketch_accumulate

BUCKETS = 4096
MIN_BUCKETS = 16
AUDIT_BYTES = 1 / 128  # receipts add at most ~2 x this of the round's bytes (see audit_buckets)
MAX_BUCKETS = 1 << 16
QUANTIZATION_TOL = 0.03  # int8 blocks of 64 round by ~0.6% (rms); a lie of 3% of the norm is caught
# The low-bit codecs round far coarser (swarm_kernels/lowbit_reference.py; relative RMS error of
# one encoding): int4 ~0.10-0.13 at blocks of 64, up to ~0.35 on heavy-tailed data at blocks of
# 4096; int2 ~0.45-0.60 at 64, up to ~0.83 at 4096, and never above 1 (0 is on its grid:
# |x - v| <= |x|).
# With 0.03 every honest owner failed. The audit then catches only lies beyond these: with int4
# a result off by more than half its norm, with int2 a sign flip or a scaled result (the -100x
# owner, by its norm), not a part zeroed or shrunk by an owner.
CODEC_TOL = {"int4": 0.5, "int2": 1.0}
# A member checks what the receipt says of its own contribution against the sketch of the very
# payload it sent (Prepared.own_sent): the owner summed the same decoded values, so only float
# sums in another order and the receipt's float32 differ, for every codec. An owner that
# substitutes, shrinks or flips our input by more than this is caught by us.
SENT_TOL = 1e-3
SKETCH_SIGMAS = 8.0  # Gram entries may differ from the sketch estimate by this many standard errors
# A Gram entry the sketches disagree with is only suspect: on structured vectors (a few large
# coordinates colliding in a bucket) the sketch's estimate can be far off for an honest owner
# (seen in a real tiny-model run), so it is logged, never a reason to fail a round or exclude.
SUSPECT = "suspect:"


def quantization_tol(codec: str) -> float:
    """check_receipt's relative slack for the rounding of `codec` (AveragingConfig.codec)."""
    return CODEC_TOL.get(codec, QUANTIZATION_TOL)


class AuditFailure(Exception):
    """An owner's receipt does not match its result or the contributions it received."""


@dataclass(frozen=True, slots=True)
class Receipt:
    included: list[int]
    gram: list[list[float]]
    buckets: int
    sketches: torch.Tensor  # float32 [len(included), buckets]

    def encode(self) -> dict[str, Any]:
        flat = [value for row in self.gram for value in row]
        return {"inc": self.included, "g": flat, "b": self.buckets, "sk": self.sketches.numpy().tobytes()}

    @classmethod
    def decode(cls, msg: Any, members: int) -> Receipt:
        """A peer's receipt; AuditFailure when it is malformed (a lying owner may send anything)."""
        if not isinstance(msg, dict):
            raise AuditFailure("a receipt is a map")
        included, flat, buckets, raw = msg.get("inc"), msg.get("g"), msg.get("b"), msg.get("sk")
        if not isinstance(included, list) or not all(isinstance(i, int) and 0 <= i < members for i in included):
            raise AuditFailure("receipt: bad member list")
        n = len(included)
        if n == 0 or len(set(included)) != n or included != sorted(included):
            raise AuditFailure("receipt: the member list must be sorted, without repeats")
        if isinstance(buckets, bool) or not isinstance(buckets, int) or not 1 <= buckets <= MAX_BUCKETS:
            raise AuditFailure("receipt: bad bucket count")
        if not isinstance(flat, list) or len(flat) != n * n or not all(isinstance(v, float | int) for v in flat):
            raise AuditFailure("receipt: the Gram matrix must have len(inc)^2 numbers")
        if not isinstance(raw, bytes) or len(raw) != n * buckets * 4:
            raise AuditFailure("receipt: the sketches must be len(inc) x buckets float32")
        gram = [[float(flat[i * n + j]) for j in range(n)] for i in range(n)]
        sketches = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(n, buckets)
        return cls(included, gram, buckets, sketches)


def result_digest(payload: bytes | memoryview) -> bytes:
    """The commitment to a part's result bytes that its audit seed is made from: BLAKE3 (a
    cryptographic hash: an owner that could pick a result with a chosen digest could pick the
    seed, and hide a lie in that sketch's null space), 4x faster than SHA-256 here (5.5 GB/s
    against 1.4, single-threaded), and it runs over every result of every round."""
    return blake3.blake3(payload).digest()


def part_seed(group_id: bytes, part: int, digest: bytes) -> bytes:
    """The seed of part `part`'s audit, from its result's digest (result_digest)."""
    return hashlib.sha256(b"swarm-audit/3\x00" + group_id + part.to_bytes(4, "big") + digest).digest()


def audit_buckets(numel: int, members: int) -> int:
    """The sketch width of a part of `numel` elements in a group of `members`: BUCKETS (2%
    error) for large parts, narrower for small ones so that the receipts a member fetches
    ((members - 1) x members x buckets x 4 bytes) stay near 2 x AUDIT_BYTES of its round's
    traffic (2 x (members - 1) x the part in int8). Narrow sketches still catch a result that
    is not the described reduction, but the Gram check loses its power (its bound grows as
    1/sqrt(buckets)): on tiny parts a forged Gram matrix may pass."""
    fair = int(numel * AUDIT_BYTES) // max(1, members)
    return max(1, min(BUCKETS, numel, max(MIN_BUCKETS, fair)))


def _rows(seed: bytes, part: int, rows: int, buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row signs (float64 +-1) and rotations (int64) of part `part`'s sketch, from the seed alone
    (the same on every machine: SHAKE-256, not a library's random generator). Row r uses the
    big-endian 64-bit word r of the stream: its low bit picks the sign, the rest the shift."""
    stream = hashlib.shake_256(seed + part.to_bytes(4, "big")).digest(8 * rows)
    words = np.frombuffer(stream, dtype=">u8").astype(np.uint64)
    signs = np.where(words & np.uint64(1), 1.0, -1.0)
    shifts = ((words >> np.uint64(1)) % np.uint64(buckets)).astype(np.int64)
    return torch.from_numpy(signs), torch.from_numpy(shifts)


def sketch_plan(seed: bytes, part: int, numel: int, buckets: int = BUCKETS) -> SketchPlan:
    """The row parameters of part `part`'s sketch (numel elements), computed once per part."""
    buckets = max(1, min(buckets, numel))
    rows = -(-numel // buckets)
    signs, shifts = _rows(seed, part, rows, buckets)
    return SketchPlan(signs, shifts, buckets, numel)


def sketch(x: torch.Tensor, seed: bytes, part: int, buckets: int = BUCKETS) -> torch.Tensor:
    """S(x): the float64 sketch of a 1-D fp32 part (see the module docstring). Linear in x."""
    return _sketch(x, sketch_plan(seed, part, x.numel(), buckets))


def _sketch(x: torch.Tensor, plan: SketchPlan) -> torch.Tensor:
    out = torch.zeros(plan.buckets, dtype=torch.float64)
    sketch_accumulate(out, x, 0, plan)
    return out


def make_receipt(
    included: list[int], gram: list[list[float]], contributions: Sequence[torch.Tensor], seed: bytes, part: int
) -> Receipt:
    """The owner's receipt (run it in a worker thread: one pass over the part per contribution)."""
    buckets = max(1, min(BUCKETS, contributions[0].numel()))
    sketches = torch.stack([sketch(x, seed, part, buckets).float() for x in contributions])
    return Receipt(included, gram, buckets, sketches)


def check_receipt(
    receipt: Receipt,
    *,
    weights: Sequence[float],
    result: torch.Tensor,
    seed: bytes,
    part: int,
    me: int | None = None,
    mine: torch.Tensor | None = None,
    included: Sequence[int] | None = None,
    members: int | None = None,
    prepared: Prepared | None = None,
    tolerance: float = QUANTIZATION_TOL,
    buckets: int | None = None,
) -> list[str]:
    """What is wrong with an owner's receipt for part `part` (empty: nothing). `weights` are the
    members' agreed weights, `result` the decoded result of the part, `mine` this member's own
    exact fp32 slice of it (when it contributed), `included` the members the result's header
    says it includes (the rule, recomputed, must keep exactly those), `tolerance` the relative
    slack for the codec's rounding (quantization_tol). Pure; run it in a worker
    thread. `members`: the group's size, which sets the sketch width (audit_buckets; None: the
    full width, BUCKETS). `prepared`: the sketches of `result` and `mine` computed beforehand
    (`prepare`, while the round went on). `buckets`: the sketch width when the part is a piece
    of a wider sketched space (a grid round's sub-part), instead of audit_buckets'."""
    problems: list[str] = []
    n, width = len(receipt.included), receipt.buckets
    numel = result.numel()
    expected = max(1, min(BUCKETS, numel)) if members is None else audit_buckets(numel, members)
    expected = expected if buckets is None else buckets
    buckets = width
    if buckets != expected:
        return [f"receipt sketches have {buckets} buckets, expected {expected}"]
    gram = receipt.gram
    if any(math.isnan(v) for row in gram for v in row):
        return ["receipt Gram matrix holds NaN"]
    sk = receipt.sketches.double()
    coefficients, fates = robust_coefficients(gram, [weights[i] for i in receipt.included])
    # An absurd contribution (1e30) overflows fp32 products: inf in G (and maybe its sketch) is
    # legitimate for the contributions the rule drops, never for those it keeps. (A dropped
    # entry is not checked against its sketch: a structured vector, e.g. a constant one, can
    # have a sketch near 0. An owner that claims an honest contribution overflows is caught by
    # that member: its own norm check.)
    live = [k for k in range(n) if fates[k].dropped is None]
    if not all(math.isfinite(gram[k][m]) for k in live for m in live) or not torch.isfinite(sk[live]).all():
        return ["receipt Gram matrix or sketches are not finite where the rule keeps contributions"]
    sigma = math.sqrt(2.0 / buckets)
    for k in live:
        for m in live:
            if m < k:
                continue
            bound = SKETCH_SIGMAS * sigma * math.sqrt(max(gram[k][k], 0.0) * max(gram[m][m], 0.0))
            if abs(gram[k][m] - float(sk[k] @ sk[m])) > bound + 1e-30:
                where = f"G[{receipt.included[k]}][{receipt.included[m]}]"
                problems.append(f"{SUSPECT} {where} disagrees with the sketches")
                break
    kept = [i for i, fate in zip(receipt.included, fates, strict=True) if fate.dropped is None]
    if included is not None and sorted(included) != kept:
        problems.append(f"the result says it includes {sorted(included)}, the receipt's rule keeps {kept}")
    claimed = torch.zeros(buckets, dtype=torch.float64)
    for k in live:
        if coefficients[k] != 0.0:
            claimed += coefficients[k] * sk[k]
    if prepared is None or prepared.observed.numel() != buckets:
        prepared = prepare(result, mine, seed, part, buckets)
    observed, result_sq = prepared.observed, prepared.result_sq
    # relative to the result's exact norm too: a structured result can sketch far below its norm
    # while its int8 rounding does not, which made honest owners fail
    scale = max(float(observed.norm()), float(claimed.norm()), math.sqrt(max(result_sq, 0.0)))
    if float((observed - claimed).norm()) > tolerance * scale + 1e-30:
        problems.append("the result is not the robust reduction the receipt describes")
    # Exact, seed-free: |result|^2 = a^T G a. A lie the sketch could miss for one lucky seed (a
    # few huge coordinates an owner re-rolls its result for) cannot keep the result's norm.
    expected_sq = math.fsum(coefficients[k] * coefficients[m] * gram[k][m] for k in live for m in live)
    if math.isfinite(result_sq) and abs(result_sq - expected_sq) > (2 * tolerance * max(expected_sq, 0.0) + 1e-30):
        problems.append("the result's norm is not the norm of the reduction the receipt describes")
    # our own input is one the rule drops when its squared norm is not finite in fp32 (1e30s):
    # nothing an owner wrote of it can be checked against it, and blaming the owner would split
    # the group
    own_checkable = prepared.own_sq < FP32_SAFE_SQUARES
    if me is not None and mine is not None and me in receipt.included and own_checkable:
        k = receipt.included.index(me)
        own, own_sq = prepared.own, prepared.own_sq
        own_tol = SENT_TOL if prepared.own_sent else tolerance
        if abs(gram[k][k] - own_sq) > 2 * own_tol * own_sq + 1e-30:
            problems.append("the receipt misstates our contribution's norm")
        if float((own - sk[k]).norm()) > own_tol * max(float(own.norm()), math.sqrt(own_sq)) + 1e-30:
            problems.append("the receipt misstates our contribution")
    return problems


# The robust rule drops a contribution whose fp32 squared norm overflows; our own norm, summed
# in float64, is judged as the rule did only below this (up to 2**128, it may have gone either way)
FP32_SAFE_SQUARES = 2.0**127


@dataclass(frozen=True, slots=True)
class Prepared:
    """What check_receipt computes from this member's own data: S(result), S(mine), |mine|^2,
    |result|^2 (float64 sums from the sketches' passes). `own_sent`: S(mine) and |mine|^2 are of
    the decoded payload we sent (checked to SENT_TOL), not of our exact slice (the codec's
    tolerance)."""

    observed: torch.Tensor
    own: torch.Tensor
    own_sq: float
    result_sq: float
    own_sent: bool = False


def prepare(result: torch.Tensor, mine: torch.Tensor | None, seed: bytes, part: int, buckets: int) -> Prepared:
    """check_receipt's passes over the part (worker thread), before the receipt is in."""
    plan = sketch_plan(seed, part, result.numel(), buckets)
    observed = torch.zeros(plan.buckets, dtype=torch.float64)
    result_sq = sketch_accumulate(observed, result, 0, plan)
    own = torch.zeros(plan.buckets, dtype=torch.float64)
    own_sq = 0.0 if mine is None else sketch_accumulate(own, mine, 0, plan)
    return Prepared(observed, own, own_sq, result_sq)
