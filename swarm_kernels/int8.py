"""Blockwise absmax int8: quantize, dequantize, and the fused dequantize_accumulate.

The arithmetic is specified in reference.py; three implementations give the same bytes:

- ``reference``: plain torch (the spec; slow; any device),
- ``cpu``: the C++ extension (fused, AVX2 where present, multi-threaded over blocks),
- ``gpu``: Triton kernels, for CUDA tensors.

The implementation is chosen by the ``impl=`` argument, else the SWARM_KERNELS_IMPL environment
variable, else automatically by device: ``cpu`` for CPU tensors (the reference, with one
warning, if the extension cannot be built), ``gpu`` for CUDA tensors (the reference if Triton is
missing). This module checks every argument once, so the implementations only compute.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

import torch

from . import _cpu, reference
from .errors import KernelUnavailable, MalformedPayload
from .reference import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE, num_blocks, to_fp32_weight

IMPLS = ("reference", "cpu", "gpu")
ENV_IMPL = "SWARM_KERNELS_IMPL"
_warned_no_triton = False


def _gpu_module() -> ModuleType:
    from . import gpu  # imports triton: only ever on a machine with CUDA

    return gpu


def gpu_available() -> bool:
    """CUDA is present and Triton imports."""
    if not torch.cuda.is_available():
        return False
    try:
        _gpu_module()
    except ImportError:
        return False
    return True


def available_impls() -> list[str]:
    """The implementations that can run here (reference always can)."""
    return ["reference"] + (["cpu"] if _cpu.available() else []) + (["gpu"] if gpu_available() else [])


def resolve_impl(impl: str | None, device: torch.device) -> str:
    """The implementation that will run for tensors on ``device`` (see the module docstring)."""
    global _warned_no_triton
    name = impl or os.environ.get(ENV_IMPL) or "auto"
    if name not in (*IMPLS, "auto"):
        source = "impl" if impl else ENV_IMPL
        raise ValueError(f"{source}={name!r}: expected one of {', '.join((*IMPLS, 'auto'))}")
    if name == "auto":
        name = "gpu" if device.type == "cuda" else "cpu"
        if name == "gpu" and not gpu_available():
            if not _warned_no_triton:
                _warned_no_triton = True
                warnings.warn("swarm_kernels: Triton is missing; CUDA tensors use the reference", RuntimeWarning, 2)
            return "reference"
    if name == "cpu":
        if device.type != "cpu":
            raise KernelUnavailable(f"impl 'cpu' needs CPU tensors, got {device}")
        return "cpu" if _cpu.available() else "reference"  # _cpu warned once
    if name == "gpu" and (device.type != "cuda" or not gpu_available()):
        raise KernelUnavailable(f"impl 'gpu' needs CUDA tensors and Triton (tensors on {device})")
    return name


def _backend(impl: str) -> ModuleType:
    return {"reference": reference, "cpu": _cpu}.get(impl) or _gpu_module()


def check_block_size(block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be an int in [1, {MAX_BLOCK_SIZE}], got {block_size!r}")
    return block_size


def _flat(t: torch.Tensor, what: str, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{what} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    return t.reshape(-1)


def _out(t: torch.Tensor, what: str, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
    if t.dtype != dtype or t.numel() != numel or t.device != device or not t.is_contiguous():
        raise ValueError(f"{what}: need a contiguous {dtype} tensor of {numel} elements on {device}")
    return t.view(-1)


def _aligned_scales(scales: torch.Tensor) -> torch.Tensor:
    return scales if scales.data_ptr() % 4 == 0 else scales.clone()


def quantize(
    x: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    impl: str | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes int8[n], scales fp32[ceil(n/B)])`` of x (fp32 or bf16, any shape, read flat).

    ``out=(codes, scales)`` writes into given contiguous tensors (e.g. views of one send
    buffer). Raises NonFiniteError (nothing usable written) if x holds NaN, inf or |x| > 2**127.
    """
    check_block_size(block_size)
    x = _flat(x, "x", (torch.float32, torch.bfloat16)).contiguous()
    n, nb = x.numel(), num_blocks(x.numel(), block_size)
    if out is None:
        codes = torch.empty(n, dtype=torch.int8, device=x.device)
        scales = torch.empty(nb, dtype=torch.float32, device=x.device)
    else:
        codes, scales = out
    flat_codes = _out(codes, "out codes", torch.int8, n, x.device)
    flat_scales = _out(scales, "out scales", torch.float32, nb, x.device)
    name = resolve_impl(impl, x.device)
    if name == "cpu" and flat_scales.data_ptr() % 4:
        tmp = torch.empty_like(flat_scales)
        _cpu.quantize_into(x, flat_codes, tmp, block_size)
        flat_scales.copy_(tmp)
    else:
        _backend(name).quantize_into(x, flat_codes, flat_scales, block_size)
    return codes, scales


def _payload(codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """codes and scales checked for type and length (a wrong length is a malformed payload)."""
    check_block_size(block_size)
    codes = _flat(codes, "codes", (torch.int8,)).contiguous()
    scales = _flat(scales, "scales", (torch.float32,)).contiguous()
    if scales.device != codes.device:
        raise ValueError(f"codes on {codes.device} but scales on {scales.device}")
    if scales.numel() != num_blocks(codes.numel(), block_size):
        raise MalformedPayload(
            f"int8 payload: {scales.numel()} scales for {codes.numel()} codes in blocks of {block_size} "
            f"(expected {num_blocks(codes.numel(), block_size)})"
        )
    return codes, scales


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    impl: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32[n]: ``code * scale`` per element. Raises MalformedPayload on a bad payload."""
    codes, scales = _payload(codes, scales, block_size)
    n = codes.numel()
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=codes.device)
    flat = _out(out, "out", torch.float32, n, codes.device)
    name = resolve_impl(impl, codes.device)
    if name == "cpu":
        scales = _aligned_scales(scales)
    _backend(name).dequantize_into(codes, scales, block_size, flat)
    return out


def dequantize_accumulate(
    acc: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    weight: float,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    impl: str | None = None,
) -> None:
    """In place, without an fp32 copy: ``acc += weight * dequantize(codes, scales)``, exactly
    ``acc + fp32(w32 * fp32(code * scale))`` per element (reference.py, rule 6).

    acc: contiguous fp32 with as many elements as codes. The payload is checked before acc is
    written: on MalformedPayload acc is unchanged. weight must be finite (ValueError)."""
    codes, scales = _payload(codes, scales, block_size)
    if not isinstance(acc, torch.Tensor) or acc.dtype != torch.float32 or not acc.is_contiguous():
        raise TypeError("acc must be a contiguous torch.float32 tensor")
    if acc.device != codes.device:
        raise ValueError(f"acc on {acc.device} but codes on {codes.device}")
    if acc.numel() != codes.numel():
        raise MalformedPayload(f"int8 payload: {codes.numel()} codes for an accumulator of {acc.numel()}")
    w32 = to_fp32_weight(weight)
    name = resolve_impl(impl, acc.device)
    if name == "cpu":
        scales = _aligned_scales(scales)
    _backend(name).dequantize_accumulate(acc.view(-1), codes, scales, w32, block_size)
