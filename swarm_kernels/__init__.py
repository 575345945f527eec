"""swarm_kernels: the codecs of the swarm's all-reduce (imports nothing of ``swarm``).

Layout:
    reference.py   the specification, as a plain-torch implementation, and its constants
    int8.py        quantize / dequantize / dequantize_accumulate, choosing an implementation
    lowbit_reference.py  the int4 / int2 spec (grids, wire layout) as plain torch
    lowbit.py      int4 / int2 quantize / dequantize / dequantize_accumulate (reference or cpu)
    _cpu.py        the C++ path (csrc/int8_cpu.cpp, csrc/lowbit_cpu.cpp; built at first use by _build.py)
    gpu.py         the Triton path (CUDA only)
    codecs.py      get_codec("int8" | "int4" | "int2" | "fp16" | "none"): one byte buffer per vector
    bnb.py         bitsandbytes' blockwise 8-bit as the codec "bnb8" (CUDA only)
    errors.py      NonFiniteError, MalformedPayload, KernelUnavailable

    codes, scales = quantize(x, 4096)                    # int8[n], fp32[ceil(n/4096)]
    dequantize_accumulate(acc, codes, scales, 0.25)      # acc += 0.25 * dequantized, fused
"""

from .codecs import (
    CODECS,
    Codec,
    Fp16Codec,
    Int2Codec,
    Int4Codec,
    Int8Codec,
    NoneCodec,
    as_memoryview,
    as_uint8,
    get_codec,
)
from .errors import KernelUnavailable, MalformedPayload, NonFiniteError
from .int8 import (
    ENV_IMPL,
    IMPLS,
    available_impls,
    dequantize,
    dequantize_accumulate,
    gpu_available,
    quantize,
    resolve_impl,
)
from .reference import DEFAULT_BLOCK_SIZE

__all__ = [
    "CODECS",
    "DEFAULT_BLOCK_SIZE",
    "ENV_IMPL",
    "IMPLS",
    "Codec",
    "Fp16Codec",
    "Int2Codec",
    "Int4Codec",
    "Int8Codec",
    "KernelUnavailable",
    "MalformedPayload",
    "NonFiniteError",
    "NoneCodec",
    "as_memoryview",
    "as_uint8",
    "available_impls",
    "dequantize",
    "dequantize_accumulate",
    "get_codec",
    "gpu_available",
    "quantize",
    "resolve_impl",
]
