"""The GPU implementation: Triton kernels for CUDA tensors (imported only when CUDA is present).

The kernels perform reference.py's operations exactly: ``tl.div_rn`` for the two divisions
(Triton's ``/`` on fp32 is an approximate division), ``rint`` for round-half-even, and every
launch passes ``enable_fp_fusion=False`` so no multiply-add is fused into an FMA. The payload
checks are kernels that raise a flag on the device; the (accumulating) dequantize kernel after
them writes nothing once it is raised, so a malformed payload leaves the output unchanged.

Not exercised on the CPU-only development machines: tests/kernels/test_gpu.py compares every
kernel with the reference bit for bit where a GPU is present.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from .reference import MAX_ABS_BITS, MAX_SCALE_BITS, MIN_SCALE_BITS, QMAX, TINY_BITS, num_blocks

try:  # Triton >= 3.0
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older Triton
    from triton.language.extra.cuda import libdevice

_div_rn = tl.div_rn if hasattr(tl, "div_rn") else tl.math.div_rn
TILE = 2048  # elements per loop step (a power of two)
CHECK_TILE = 8192  # codes (and scales) per program of the payload checks
# elements per program and warps of (de)quantize+accumulate: read at each launch, so that
# scripts/experiments/gpu_check.py --sweep can time other shapes
DEQUANT_TILE = 2048
DEQUANT_WARPS = 4
# Triton kernels may read only constexpr globals.
_QMAX = tl.constexpr(float(QMAX))
_TINY_BITS = tl.constexpr(TINY_BITS)
_MAX_ABS_BITS = tl.constexpr(MAX_ABS_BITS)
_MIN_SCALE_BITS = tl.constexpr(MIN_SCALE_BITS)
_MAX_SCALE_BITS = tl.constexpr(MAX_SCALE_BITS)
_NAN_BITS = tl.constexpr(0x7FC00000)  # the scale of a block with a bad input; the host looks for it


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, scales_ptr, n, B: tl.constexpr, T: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    start = k * B
    m = tl.zeros([T], dtype=tl.int32)
    for i in range(0, B, T):  # pass 1: absmax as the max of |x|'s bits (also finds NaN / inf)
        offs = start + i + tl.arange(0, T)
        mask = (i + tl.arange(0, T) < B) & (offs < n)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.maximum(m, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    mb = tl.max(m, axis=0)
    normal = (mb >= _TINY_BITS) & (mb <= _MAX_ABS_BITS)
    safe = tl.where(normal, mb.to(tl.float32, bitcast=True), 1.0)
    qmax = tl.full([], _QMAX, tl.float32)
    scale = tl.where(normal, _div_rn(safe, qmax), 0.0)
    inv = tl.where(normal, _div_rn(qmax, safe), 0.0)
    scale = tl.where(mb > _MAX_ABS_BITS, tl.full([], _NAN_BITS, tl.int32).to(tl.float32, bitcast=True), scale)
    tl.store(scales_ptr + k, scale)
    for i in range(0, B, T):  # pass 2: codes
        offs = start + i + tl.arange(0, T)
        mask = (i + tl.arange(0, T) < B) & (offs < n)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        q = libdevice.rint(x * inv)
        tl.store(codes_ptr + offs, q.to(tl.int8), mask=mask)


@triton.jit
def _dequant_kernel(
    acc_ptr, codes_ptr, scales_ptr, flag_ptr, w, n, B: tl.constexpr, T: tl.constexpr, ACC: tl.constexpr
):
    if tl.load(flag_ptr) == 0:  # the payload checks found nothing: out is written only then
        offs = tl.program_id(0).to(tl.int64) * T + tl.arange(0, T)
        mask = offs < n
        c = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.float32)
        s = tl.load(scales_ptr + offs // B, mask=mask, other=0.0)
        v = c * s
        if ACC:
            a = tl.load(acc_ptr + offs, mask=mask, other=0.0)
            tl.store(acc_ptr + offs, a + w * v, mask=mask)
        else:
            tl.store(acc_ptr + offs, v, mask=mask)


@triton.jit
def _bad_code_kernel(codes_ptr, flag_ptr, n, T: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * T + tl.arange(0, T)
    c = tl.load(codes_ptr + offs, mask=offs < n, other=0)
    if tl.max((c == -128).to(tl.int32), axis=0) > 0:
        tl.store(flag_ptr, 1)  # every writer writes the same 1: no atomic needed


@triton.jit
def _bad_scale_kernel(scales_ptr, flag_ptr, nb, T: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * T + tl.arange(0, T)
    bits = tl.load(scales_ptr + offs, mask=offs < nb, other=0.0).to(tl.int32, bitcast=True)
    ok = (bits == 0) | ((bits >= _MIN_SCALE_BITS) & (bits <= _MAX_SCALE_BITS))
    if tl.min(ok.to(tl.int32), axis=0) == 0:
        tl.store(flag_ptr, 1)


def _checked_dequant(
    out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, w32: float, block_size: int, acc: bool
) -> None:
    """reference.check_payload and the (accumulating) dequantize in three kernels and one host
    sync: the checks raise a flag on the device, the dequantize kernel writes nothing when it is
    raised, and the reference names the bad code or scale afterwards (out unchanged). Checked by
    torch ops (`(codes == -128).any()` writes and reads an n-byte mask) with two syncs before the
    launch, the accumulate ran at 45-47% of an H200's device copy rate; this way at 62%."""
    n = codes.numel()
    if n == 0:
        reference.check_scales(scales)
        return
    flag = torch.zeros(1, dtype=torch.int32, device=codes.device)
    with torch.cuda.device(codes.device):
        _bad_scale_kernel[(triton.cdiv(scales.numel(), CHECK_TILE),)](scales, flag, scales.numel(), T=CHECK_TILE)
        _bad_code_kernel[(triton.cdiv(n, CHECK_TILE),)](codes, flag, n, T=CHECK_TILE)
        _dequant_kernel[(triton.cdiv(n, DEQUANT_TILE),)](out, codes, scales, flag, w32, n, B=block_size,
                                                           T=DEQUANT_TILE, ACC=acc, num_warps=DEQUANT_WARPS,
                                                           enable_fp_fusion=False)  # fmt: skip
    if int(flag.item()):
        reference.check_payload(codes, scales)  # raises MalformedPayload naming the first bad one
        raise RuntimeError("the GPU payload check flagged a payload the reference accepts")


def _tile(block_size: int) -> int:
    return min(TILE, triton.next_power_of_2(block_size))


def quantize_into(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> None:
    n = x.numel()
    if n == 0:
        return
    with torch.cuda.device(x.device):
        grid = (num_blocks(n, block_size),)
        _quantize_kernel[grid](x, codes, scales, n, B=block_size, T=_tile(block_size), enable_fp_fusion=False)
    if bool(torch.isnan(scales).any()):
        raise reference.nonfinite_error(x)


def dequantize_into(codes: torch.Tensor, scales: torch.Tensor, block_size: int, out: torch.Tensor) -> None:
    _checked_dequant(out, codes, scales, 1.0, block_size, acc=False)


def dequantize_accumulate(
    acc: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, w32: float, block_size: int
) -> None:
    _checked_dequant(acc, codes, scales, w32, block_size, acc=True)
