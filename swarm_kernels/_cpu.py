"""The CPU implementation: thin ctypes bindings to csrc/int8_cpu.cpp and csrc/lowbit_cpu.cpp
(one library, built by _build.py).

The callers (int8.py, lowbit.py) have already checked dtypes, lengths, devices, contiguity and scale
alignment; this module only passes addresses. ctypes releases the GIL for each call, so encode
and decode in worker threads run beside the event loop; inside a call at::parallel_for spreads
the blocks over torch's intra-op threads (torch.set_num_threads).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import warnings

import torch

from . import _build, lowbit_reference, reference
from .errors import MalformedPayload
from .lowbit_reference import Format

log = logging.getLogger(__name__)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None  # why the build failed, once it has

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_SIGNATURES = {
    "swarm_int8_simd": ([], ctypes.c_int),
    "swarm_int8_set_simd": ([ctypes.c_int], ctypes.c_int),
    "swarm_int8_quantize_f32": ([_P, _I64, _I64, _P, _P], _I64),
    "swarm_int8_quantize_bf16": ([_P, _I64, _I64, _P, _P], _I64),
    "swarm_int8_dequantize": ([_P, _P, _I64, _I64, _P, _P], ctypes.c_int),
    "swarm_int8_dequantize_accumulate": ([_P, _P, _P, _I64, _I64, ctypes.c_float, _P], ctypes.c_int),
    "swarm_lowbit_simd": ([], ctypes.c_int),
    "swarm_lowbit_set_simd": ([ctypes.c_int], ctypes.c_int),
    "swarm_lowbit_quantize": ([ctypes.c_int, ctypes.c_int, _P, _I64, _I64, _P, _P], _I64),
    "swarm_lowbit_dequantize": ([ctypes.c_int, _P, _P, _I64, _I64, _P, _P], ctypes.c_int),
    "swarm_lowbit_dequantize_accumulate": ([ctypes.c_int, _P, _P, _P, _I64, _I64, ctypes.c_float, _P], ctypes.c_int),
    "swarm_sketch_f32": ([_P, _I64, _I64, _I64, _P, _P, _P, _P], ctypes.c_int),
    "swarm_sketch_i8": ([_P, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P], ctypes.c_int),
}


def library() -> ctypes.CDLL | None:
    """The built library, or None (with one warning per process) if it cannot be built."""
    global _lib, _error
    if _lib is not None or _error is not None:
        return _lib
    with _lock:
        if _lib is None and _error is None:
            try:
                lib = _build.load_extension()
                for fn, (argtypes, restype) in _SIGNATURES.items():
                    getattr(lib, fn).argtypes = argtypes
                    getattr(lib, fn).restype = restype
                _lib = lib
            except Exception as e:  # no compiler, no ninja, a compile error: fall back, loudly
                _error = f"{type(e).__name__}: {e}".strip()
                log.warning("swarm_kernels: CPU extension unavailable (%s)", _error)
                warnings.warn(
                    f"swarm_kernels: the C++ CPU codec could not be built ({_error[:500]}); "
                    "using the slow plain-torch reference instead",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return _lib


def available() -> bool:
    return library() is not None


def build_error() -> str | None:
    """Why the extension is unavailable (after library() failed), else None."""
    return _error


def simd() -> str:
    """'avx2' or 'scalar': the loop set the extension runs."""
    lib = _require()
    return "avx2" if lib.swarm_int8_simd() and lib.swarm_lowbit_simd() else "scalar"


def set_simd(avx2: bool) -> str:
    """Tests only (not thread-safe): force the scalar loops, or back to AVX2 where supported."""
    _require().swarm_int8_set_simd(int(avx2))
    _require().swarm_lowbit_set_simd(int(avx2))
    return simd()


def _require() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"swarm_kernels CPU extension unavailable: {_error}")
    return lib


def quantize_into(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> None:
    lib = _require()
    fn = lib.swarm_int8_quantize_bf16 if x.dtype == torch.bfloat16 else lib.swarm_int8_quantize_f32
    k = fn(x.data_ptr(), x.numel(), block_size, codes.data_ptr(), scales.data_ptr())
    if k == -2:
        raise RuntimeError("swarm_kernels CPU quantize failed inside the extension")
    if k >= 0:
        raise reference.nonfinite_error(x.reshape(-1))


def _raise_malformed(status: int, where: int) -> None:
    if status == 1:
        raise MalformedPayload(f"int8 payload: scale {where} is negative, non-finite, subnormal or too large")
    if status == 2:
        raise MalformedPayload(f"int8 payload: code {where} is -128")
    raise RuntimeError(f"swarm_kernels CPU decode failed inside the extension (status {status})")


def dequantize_into(codes: torch.Tensor, scales: torch.Tensor, block_size: int, out: torch.Tensor) -> None:
    where = ctypes.c_int64(0)
    status = _require().swarm_int8_dequantize(
        codes.data_ptr(), scales.data_ptr(), codes.numel(), block_size, out.data_ptr(), ctypes.byref(where)
    )
    if status:
        _raise_malformed(status, where.value)


def dequantize_accumulate(
    acc: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, w32: float, block_size: int
) -> None:
    where = ctypes.c_int64(0)
    status = _require().swarm_int8_dequantize_accumulate(
        acc.data_ptr(), codes.data_ptr(), scales.data_ptr(), codes.numel(), block_size, w32, ctypes.byref(where)
    )
    if status:
        _raise_malformed(status, where.value)


def lowbit_quantize_into(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, block_size: int, fmt: Format
) -> None:
    """lowbit.py's contract: x flat contiguous fp32 or bf16, packed uint8[ceil(n/k)], scales fp32
    (aligned), block_size a multiple of the codes a byte."""
    bf16 = int(x.dtype == torch.bfloat16)
    k = _require().swarm_lowbit_quantize(
        fmt.bits, bf16, x.data_ptr(), x.numel(), block_size, packed.data_ptr(), scales.data_ptr()
    )
    if k < -1:
        raise RuntimeError(f"swarm_kernels CPU {fmt.name} quantize failed inside the extension ({k})")
    if k >= 0:
        raise lowbit_reference.nonfinite_error(fmt, x.reshape(-1))


def _raise_lowbit(fmt: Format, status: int, where: int, numel: int) -> None:
    if status == 1:
        raise MalformedPayload(f"{fmt.name} payload: scale {where} is negative, non-finite or out of range")
    if status == 2:
        raise MalformedPayload(f"{fmt.name} payload: code {where} is -0 (the sign bit alone)")
    if status == 3:
        raise MalformedPayload(f"{fmt.name} payload: the padding bits after code {numel - 1} are not 0")
    raise RuntimeError(f"swarm_kernels CPU {fmt.name} decode failed inside the extension (status {status})")


def lowbit_dequantize_into(
    packed: torch.Tensor, scales: torch.Tensor, block_size: int, out: torch.Tensor, fmt: Format
) -> None:
    where = ctypes.c_int64(0)
    status = _require().swarm_lowbit_dequantize(
        fmt.bits, packed.data_ptr(), scales.data_ptr(), out.numel(), block_size, out.data_ptr(), ctypes.byref(where)
    )
    if status:
        _raise_lowbit(fmt, status, where.value, out.numel())


def lowbit_dequantize_accumulate(
    acc: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, w32: float, block_size: int, fmt: Format
) -> None:
    where = ctypes.c_int64(0)
    status = _require().swarm_lowbit_dequantize_accumulate(
        fmt.bits, acc.data_ptr(), packed.data_ptr(), scales.data_ptr(), acc.numel(), block_size, w32,
        ctypes.byref(where),
    )  # fmt: skip
    if status:
        _raise_lowbit(fmt, status, where.value, acc.numel())


def sketch_accumulate(
    out: torch.Tensor, x: torch.Tensor, offset: int, signs: torch.Tensor, shifts: torch.Tensor
) -> float:
    """sketch.py's contract (checked there): out (float64[buckets]) += the sketch of x; returns
    x's sum of squares (double)."""
    squares = ctypes.c_double(0.0)
    status = _require().swarm_sketch_f32(
        x.data_ptr(), x.numel(), offset, out.numel(), signs.data_ptr(), shifts.data_ptr(), out.data_ptr(),
        ctypes.byref(squares),
    )  # fmt: skip
    if status:
        raise ValueError("swarm_sketch_f32: a row shift outside [0, buckets)")
    return squares.value


def sketch_int8_accumulate(
    out: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    block_size: int,
    offset: int,
    signs: torch.Tensor,
    shifts: torch.Tensor,
) -> float:
    """sketch_accumulate of the int8 payload (codes, scales) without decoding it (sketch.py);
    returns the decoded values' sum of squares (double)."""
    squares = ctypes.c_double(0.0)
    status = _require().swarm_sketch_i8(
        codes.data_ptr(), scales.data_ptr(), codes.numel(), block_size, offset, out.numel(),
        signs.data_ptr(), shifts.data_ptr(), out.data_ptr(), ctypes.byref(squares),
    )  # fmt: skip
    if status:
        raise ValueError("swarm_sketch_i8: a row shift outside [0, buckets)")
    return squares.value
