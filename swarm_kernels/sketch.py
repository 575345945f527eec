"""The owner audit's seeded sketch (swarm/averaging/audit/arithmetic.py), fast and reference.

    plan = SketchPlan(signs, shifts, buckets, numel)     # one per (seed, part): row parameters
    sq = sketch_accumulate(out, x, offset, plan)         # out += S(x placed at [offset, ...));
                                                         # sq: sum of x's squares (float64)

A part of `numel` elements is cut into rows of `buckets` elements; element i (row r = i //
buckets, column c = i % buckets) is added, times signs[r], to out[(c + shifts[r]) % buckets],
accumulated in float64. `offset` lets a part be sketched chunk by chunk (the sum of the
chunks' sketches is the part's). The C++ path (csrc/int8_cpu.cpp, swarm_sketch_f32) gives the
same sums as the reference, bit for bit: both add each row, in order, one element per bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _cpu
from .codecs import Codec, Int8Codec, Payload


@dataclass(frozen=True, slots=True)
class SketchPlan:
    signs: torch.Tensor  # float64[rows], each +1.0 or -1.0
    shifts: torch.Tensor  # int64[rows], each in [0, buckets)
    buckets: int
    numel: int

    def __post_init__(self) -> None:
        rows = -(-self.numel // self.buckets) if self.buckets > 0 else -1
        if self.buckets <= 0 or self.numel < 0 or self.signs.shape != (rows,) or self.shifts.shape != (rows,):
            raise ValueError("a sketch plan needs one sign and one shift per row of `buckets` elements")
        if self.signs.dtype != torch.float64 or self.shifts.dtype != torch.int64:
            raise ValueError("sketch plan: signs are float64, shifts int64")
        if rows and not (int(self.shifts.min()) >= 0 and int(self.shifts.max()) < self.buckets):
            raise ValueError("sketch plan: shifts must lie in [0, buckets)")


def sketch_accumulate(
    out: torch.Tensor, x: torch.Tensor, offset: int, plan: SketchPlan, *, impl: str = "auto"
) -> float:
    """out += the sketch of x, the part's elements [offset, offset + x.numel()); returns the sum
    of x's squares in float64 (the audit's norms, from the same pass; its last bits depend on the
    implementation's order of additions). impl: "auto" (C++ when built), "cpu" or "reference"."""
    if out.dtype != torch.float64 or out.shape != (plan.buckets,) or not out.is_contiguous():
        raise ValueError("sketch: out must be a contiguous float64[buckets]")
    if x.dtype != torch.float32 or x.dim() != 1 or x.device.type != "cpu":
        raise ValueError("sketch: x must be a 1-D fp32 CPU tensor")
    if not 0 <= offset <= offset + x.numel() <= plan.numel:
        raise ValueError(f"sketch: elements [{offset}, {offset + x.numel()}) lie outside the part of {plan.numel}")
    if impl == "reference" or (impl == "auto" and not _cpu.available()):
        return reference_accumulate(out, x, offset, plan)
    return _cpu.sketch_accumulate(out, x.contiguous(), offset, plan.signs, plan.shifts)


def sketch_payload_accumulate(
    out: torch.Tensor, codec: Codec, payload: Payload, numel: int, offset: int, plan: SketchPlan
) -> float:
    """out += the sketch of the `numel` elements an encoded payload holds (the part's elements
    [offset, offset + numel)): straight from the int8 codes where the C++ path is built (the
    same sums as decoding first), else decoded (MalformedPayload if it does not decode).
    Returns the decoded values' sum of squares (float64)."""
    if isinstance(codec, Int8Codec) and _cpu.available():
        inside = 0 <= offset <= offset + numel <= plan.numel
        if not inside or out.shape != (plan.buckets,) or out.dtype != torch.float64:
            raise ValueError("sketch: the payload lies outside the part, or out is not float64[buckets]")
        codes, scales = codec._split(payload, numel, torch.device("cpu"))
        return _cpu.sketch_int8_accumulate(out, codes, scales, codec.block_size, offset, plan.signs, plan.shifts)
    return sketch_accumulate(out, codec.decode(payload, numel), offset, plan)


def reference_accumulate(out: torch.Tensor, x: torch.Tensor, offset: int, plan: SketchPlan) -> float:
    """The specification: two torch ops per row stretch (slow: one Python step per row)."""
    buckets, k, n = plan.buckets, 0, x.numel()
    while k < n:
        i = offset + k
        r, c = divmod(i, buckets)
        size = min(n - k, buckets - c)
        row = x[k : k + size].double()
        t, s = int(plan.shifts[r]), float(plan.signs[r])
        start = (c + t) % buckets
        head = min(size, buckets - start)  # up to the wrap
        out[start : start + head].add_(row[:head], alpha=s)
        if size > head:
            out[: size - head].add_(row[head:], alpha=s)
        k += size
    return float(torch.dot(x.double(), x.double()))
