"""Blockwise int4 and int2 on a lookup grid: quantize, dequantize, and the fused
dequantize_accumulate.

The arithmetic and the wire layout are specified in lowbit_reference.py; two implementations
give the same bytes:

- ``reference``: plain torch (the spec; slow; any device),
- ``cpu``: the C++ extension (csrc/lowbit_cpu.cpp: fused, AVX2 where present, multi-threaded
  over blocks).

There is no GPU kernel: CUDA tensors run the reference's torch ops on the device (the same bytes,
unfused), so ``impl="gpu"`` (or SWARM_KERNELS_IMPL=gpu) means the reference here. Otherwise the
implementation is chosen as for int8 (int8.resolve_impl: ``impl=``, then SWARM_KERNELS_IMPL, then
by device). This module checks every argument once, so the implementations only compute.

    packed, scales = quantize(x, INT4, 64)                   # uint8[ceil(n/2)], fp32[ceil(n/64)]
    dequantize_accumulate(acc, packed, scales, 0.25, INT4, 64)   # acc += 0.25 * dequantized
"""

from __future__ import annotations

import torch

from . import _cpu, lowbit_reference
from . import int8 as _int8
from .errors import MalformedPayload
from .lowbit_reference import FORMATS, INT2, INT4, Format
from .reference import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE, num_blocks, to_fp32_weight

__all__ = ["FORMATS", "INT2", "INT4", "Format", "dequantize", "dequantize_accumulate", "quantize", "resolve_impl"]


def as_format(fmt: Format | str) -> Format:
    if isinstance(fmt, Format):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"unknown low-bit format {fmt!r}: expected one of {', '.join(FORMATS)}")
    return FORMATS[fmt]


def check_block_size(block_size: int, fmt: Format | str) -> int:
    """1 <= block_size <= MAX_BLOCK_SIZE, a multiple of the format's codes a byte (ValueError)."""
    return lowbit_reference.check_block_size(block_size, as_format(fmt), MAX_BLOCK_SIZE)


def resolve_impl(impl: str | None, device: torch.device) -> str:
    """The implementation that runs for tensors on ``device``, "reference" or "cpu": int8's
    choice (int8.resolve_impl), with "gpu" meaning the reference (there is no GPU kernel)."""
    name = _int8.resolve_impl(impl, device)
    return "reference" if name == "gpu" else name


# the argument checks are int8's: the same rules for every codec's tensors
_flat, _out, _aligned = _int8._flat, _int8._out, _int8._aligned_scales


def quantize(
    x: torch.Tensor,
    fmt: Format | str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    impl: str | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8[ceil(n/k)], scales fp32[ceil(n/B)])`` of x (fp32 or bf16, read flat).

    ``out=(packed, scales)`` writes into given contiguous tensors (e.g. views of one send
    buffer). Raises NonFiniteError (nothing usable written) if x holds NaN, inf or |x| > 2**127.
    """
    fmt = as_format(fmt)
    check_block_size(block_size, fmt)
    x = _flat(x, "x", (torch.float32, torch.bfloat16)).contiguous()
    n, nb = x.numel(), num_blocks(x.numel(), block_size)
    if out is None:
        out = (
            torch.empty(fmt.packed_nbytes(n), dtype=torch.uint8, device=x.device),
            torch.empty(nb, dtype=torch.float32, device=x.device),
        )
    packed = _out(out[0], "out packed", torch.uint8, fmt.packed_nbytes(n), x.device)
    scales = _out(out[1], "out scales", torch.float32, nb, x.device)
    if resolve_impl(impl, x.device) == "reference":
        lowbit_reference.quantize_into(x, packed, scales, block_size, fmt)
    elif scales.data_ptr() % 4:
        tmp = torch.empty_like(scales)
        _cpu.lowbit_quantize_into(x, packed, tmp, block_size, fmt)
        scales.copy_(tmp)
    else:
        _cpu.lowbit_quantize_into(x, packed, scales, block_size, fmt)
    return out


def _payload(
    packed: torch.Tensor, scales: torch.Tensor, numel: int, fmt: Format, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """packed and scales checked for type and length (a wrong length is a malformed payload)."""
    check_block_size(block_size, fmt)
    packed = _flat(packed, "packed", (torch.uint8,)).contiguous()
    scales = _flat(scales, "scales", (torch.float32,)).contiguous()
    if scales.device != packed.device:
        raise ValueError(f"packed on {packed.device} but scales on {scales.device}")
    if packed.numel() != fmt.packed_nbytes(numel) or scales.numel() != num_blocks(numel, block_size):
        raise MalformedPayload(
            f"{fmt.name} payload: {packed.numel()} code bytes and {scales.numel()} scales for {numel} elements in "
            f"blocks of {block_size} (expected {fmt.packed_nbytes(numel)} and {num_blocks(numel, block_size)})"
        )
    return packed, scales


def dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    fmt: Format | str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    impl: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32[numel]: the decoded values. Raises MalformedPayload on a bad payload."""
    fmt = as_format(fmt)
    packed, scales = _payload(packed, scales, numel, fmt, block_size)
    if out is None:
        out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    flat = _out(out, "out", torch.float32, numel, packed.device)
    if resolve_impl(impl, packed.device) == "reference":
        lowbit_reference.dequantize_into(packed, scales, block_size, flat, fmt)
    else:
        _cpu.lowbit_dequantize_into(packed, _aligned(scales), block_size, flat, fmt)
    return out


def dequantize_accumulate(
    acc: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    weight: float,
    fmt: Format | str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    impl: str | None = None,
) -> None:
    """In place, without an fp32 copy: ``acc += weight * dequantize(...)``, exactly
    ``acc + fp32(w32 * v)`` per element (lowbit_reference.py, rule 6).

    acc: contiguous fp32 on the payload's device; its length is the payload's element count.
    The payload is checked before acc is written: on MalformedPayload acc is unchanged. weight
    must be finite (ValueError)."""
    fmt = as_format(fmt)
    if not isinstance(acc, torch.Tensor) or acc.dtype != torch.float32 or not acc.is_contiguous():
        raise TypeError("acc must be a contiguous torch.float32 tensor")
    packed, scales = _payload(packed, scales, acc.numel(), fmt, block_size)
    if acc.device != packed.device:
        raise ValueError(f"acc on {acc.device} but the payload on {packed.device}")
    w32 = to_fp32_weight(weight)
    if resolve_impl(impl, acc.device) == "reference":
        lowbit_reference.dequantize_accumulate(acc.view(-1), packed, scales, w32, block_size, fmt)
    else:
        _cpu.lowbit_dequantize_accumulate(acc.view(-1), packed, _aligned(scales), w32, block_size, fmt)
