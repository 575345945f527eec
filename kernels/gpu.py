"""The GPU implementation: Triton kernels for CUDA tensors (imported only when CUDA is present).

The kernels perform reference.py's operations exactly: ``tl.div_rn`` for the two divisions
(Triton's ``/`` on fp32 is an approximate division), ``rint`` for round-half-even, and every
launch passes ``enable_fp_fusion=False`` so no multiply-add is fused into an FMA. The payload
check runs as torch ops on the device before the accumulate kernel writes anything.

Not exercised on the CPU-only development machines: tests/kernels/test_gpu.py compares every
kernel with the reference bit for bit where a GPU is present.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from .reference import MAX_ABS_BITS, QMAX, TINY_BITS, num_blocks

try:  # Triton >= 3.0
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older Triton
    from triton.language.extra.cuda import libdevice

_div_rn = tl.div_rn if hasattr(tl, "div_rn") else tl.math.div_rn
TILE = 2048  # elements per loop step (a power of two)
# Triton kernels may read only constexpr globals.
_QMAX = tl.constexpr(float(QMAX))
_TINY_BITS = tl.constexpr(TINY_BITS)
_MAX_ABS_BITS = tl.constexpr(MAX_ABS_BITS)
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
def _dequant_kernel(acc_ptr, codes_ptr, scales_ptr, w, n, B: tl.constexpr, T: tl.constexpr, ACC: tl.constexpr):
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


def _launch_dequant(
    out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, w32: float, block_size: int, acc: bool
) -> None:
    n = codes.numel()
    if n == 0:
        return
    with torch.cuda.device(codes.device):
        grid = (triton.cdiv(n, TILE),)
        _dequant_kernel[grid](out, codes, scales, w32, n, B=block_size, T=TILE, ACC=acc, enable_fp_fusion=False)


def dequantize_into(codes: torch.Tensor, scales: torch.Tensor, block_size: int, out: torch.Tensor) -> None:
    reference.check_payload(codes, scales)
    _launch_dequant(out, codes, scales, 1.0, block_size, acc=False)


def dequantize_accumulate(
    acc: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, w32: float, block_size: int
) -> None:
    reference.check_payload(codes, scales)  # before acc is written
    _launch_dequant(acc, codes, scales, w32, block_size, acc=True)
