"""Codecs for the averaging layer: a flat fp32 vector <-> one byte buffer on the wire.

    codec = get_codec("int8", block_size=4096)          # or "int4", "int2", "fp16", "none" ("bnb8" on CUDA)
    payload = codec.encode(x)                           # uint8 tensor, contiguous
    sock.send(as_memoryview(payload))                   # zero-copy (no numpy needed)
    codec.decode_accumulate(acc, received, weight)      # acc += weight * decode(received)

Wire layouts (little-endian; ``encoded_nbytes(n)`` is their exact length):

- ``int8``: ``scales fp32[ceil(n/B)]`` then ``codes int8[n]`` (reference.py is the spec);
- ``int4`` / ``int2``: ``scales fp32[ceil(n/B)]`` then the codes packed 2 / 4 a byte, first in
  the low bits (lowbit_reference.py is the spec); B must be a multiple of 2 / 4;
- ``fp16``: ``half[n]`` (IEEE binary16, round to nearest even);
- ``none``: ``fp32[n]``.

Chunking: encoding a slice ``x[a:b]`` whose start ``a`` is a multiple of the block size and
whose end ``b`` is one too (or the vector's end) gives the whole vector's scales
``[a/B : ceil(b/B)]`` followed by its codes ``[a:b]`` (int4 / int2: its code bytes
``[a/k : ceil(b/k)]``, k codes a byte: B is a multiple of k, so a block starts on a byte; for
fp16/none simply the byte slice), so a sender may encode a big vector chunk by chunk.

Decoding checks the length and every value (MalformedPayload) before it writes anything, so a
sender's garbage never reaches the accumulator. Encoding refuses NaN, inf and values the codec
cannot carry (NonFiniteError). The accumulate step is ``acc + fp32(w32 * fp32(value))`` for
every codec, with ``w32`` the weight rounded once to fp32.
"""

from __future__ import annotations

import ctypes
import sys
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from . import int8 as _int8
from . import lowbit as _lowbit
from .errors import KernelUnavailable, MalformedPayload, NonFiniteError
from .lowbit_reference import INT2, INT4, Format
from .reference import DEFAULT_BLOCK_SIZE, num_blocks, to_fp32_weight

Payload = bytes | bytearray | memoryview | torch.Tensor
CODECS = ("int8", "int4", "int2", "fp16", "none")
FP16_MAX = 65504.0

if sys.byteorder != "little":  # pragma: no cover - the layouts above are native views
    raise ImportError("swarm_kernels codecs assume a little-endian machine")

# torch.frombuffer warns (once per process) that a read-only buffer such as ``bytes`` gives a
# tensor it cannot protect. We only ever read received payloads, so spend that one warning here,
# at import, instead of in the middle of a reduce.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)


def as_uint8(payload: Payload) -> torch.Tensor:
    """A flat uint8 tensor over the payload's bytes, without a copy (tensors: their data)."""
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8:
            raise TypeError(f"payload tensor must be uint8, got {payload.dtype}")
        return payload.reshape(-1)
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"payload must be bytes, bytearray, memoryview or a uint8 tensor, not {type(payload).__name__}")
    view = memoryview(payload).cast("B")  # refuses a non-contiguous view
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)


def as_memoryview(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view (format "B") of a contiguous CPU tensor's data, e.g. a payload for
    ``socket.send`` or ``writer.write``; it keeps the tensor alive while it lives. Unlike
    ``memoryview(t.numpy())`` it needs no numpy (not a dependency of this project)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("as_memoryview needs a contiguous CPU tensor")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    array = (ctypes.c_uint8 * nbytes).from_address(t.data_ptr())
    array._tensor = t  # type: ignore[attr-defined]  # the memory's owner lives as long as the view
    return memoryview(array).cast("B")


def _view_as(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """buf (uint8) reinterpreted as dtype; copied first if its address is not aligned for it."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if buf.data_ptr() % itemsize or buf.storage_offset() % itemsize:
        buf = buf.clone()
    return buf.view(dtype)


def _flat_input(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"x must be a float32 (or bfloat16) tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    return x.reshape(-1).contiguous()


def _check_length(buf: torch.Tensor, expected: int, codec: str, numel: int) -> None:
    if buf.numel() != expected:
        raise MalformedPayload(f"{codec} payload of {buf.numel()} bytes for {numel} elements (expected {expected})")


def _check_acc(acc: torch.Tensor) -> torch.Tensor:
    if not isinstance(acc, torch.Tensor) or acc.dtype != torch.float32 or not acc.is_contiguous():
        raise TypeError("acc must be a contiguous torch.float32 tensor")
    return acc.view(-1)


def _scaled_payload(
    codec: Codec, payload: Payload, numel: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A blockwise codec's payload, length checked, split into its codes (uint8, after the
    scales) and its fp32 scales (one per block of `codec.block_size`), on `device`."""
    buf = as_uint8(payload)
    _check_length(buf, codec.encoded_nbytes(numel), codec.name, numel)
    buf = buf.to(device)
    nb = num_blocks(numel, codec.block_size)  # type: ignore[attr-defined]
    return buf[4 * nb :], _view_as(buf[: 4 * nb], torch.float32)


class Codec(ABC):
    """Encode a flat fp32 vector to one uint8 buffer; decode (and weighted-accumulate) it."""

    name: ClassVar[str]

    @abstractmethod
    def encoded_nbytes(self, numel: int) -> int:
        """The exact payload length for ``numel`` elements."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x (fp32, read flat) -> a new contiguous uint8 tensor of encoded_nbytes(x.numel())."""

    @abstractmethod
    def decode_accumulate(self, acc: torch.Tensor, payload: Payload, weight: float) -> None:
        """``acc += weight * decode(payload, acc.numel())`` in place; acc untouched on error."""

    @abstractmethod
    def decode(self, payload: Payload, numel: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 vector of ``numel`` elements the payload encodes (into ``out`` if given)."""


@dataclass(frozen=True, slots=True)
class Int8Codec(Codec):
    """Blockwise absmax int8 (reference.py): n + 4*ceil(n/B) bytes, ~4x smaller than fp32."""

    block_size: int = DEFAULT_BLOCK_SIZE
    impl: str | None = None  # None: SWARM_KERNELS_IMPL, else by device (int8.resolve_impl)
    name: ClassVar[str] = "int8"

    def __post_init__(self) -> None:
        _int8.check_block_size(self.block_size)
        if self.impl is not None and self.impl not in (*_int8.IMPLS, "auto"):
            raise ValueError(f"impl={self.impl!r}: expected one of {', '.join((*_int8.IMPLS, 'auto'))}")

    def encoded_nbytes(self, numel: int) -> int:
        return 4 * num_blocks(numel, self.block_size) + numel

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = _flat_input(x)
        n, nb = x.numel(), num_blocks(x.numel(), self.block_size)
        out = torch.empty(4 * nb + n, dtype=torch.uint8, device=x.device)
        codes, scales = out[4 * nb :].view(torch.int8), out[: 4 * nb].view(torch.float32)
        _int8.quantize(x, self.block_size, impl=self.impl, out=(codes, scales))
        return out

    def _split(self, payload: Payload, numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scales = _scaled_payload(self, payload, numel, device)
        return codes.view(torch.int8), scales

    def decode_accumulate(self, acc: torch.Tensor, payload: Payload, weight: float) -> None:
        acc = _check_acc(acc)
        codes, scales = self._split(payload, acc.numel(), acc.device)
        _int8.dequantize_accumulate(acc, codes, scales, weight, self.block_size, impl=self.impl)

    def decode(self, payload: Payload, numel: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        device = out.device if out is not None else torch.device("cpu")
        codes, scales = self._split(payload, numel, device)
        return _int8.dequantize(codes, scales, self.block_size, impl=self.impl, out=out)


@dataclass(frozen=True, slots=True)
class _LowBitCodec(Codec):
    """Blockwise absmax on a lookup grid, codes packed below a byte (lowbit_reference.py)."""

    block_size: int = DEFAULT_BLOCK_SIZE
    impl: str | None = None  # None: SWARM_KERNELS_IMPL, else by device (lowbit.resolve_impl)
    fmt: ClassVar[Format]

    def __post_init__(self) -> None:
        _lowbit.check_block_size(self.block_size, self.fmt)
        if self.impl is not None and self.impl not in (*_int8.IMPLS, "auto"):
            raise ValueError(f"impl={self.impl!r}: expected one of {', '.join((*_int8.IMPLS, 'auto'))}")

    def encoded_nbytes(self, numel: int) -> int:
        return self.fmt.nbytes(numel, self.block_size)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = _flat_input(x)
        nb = num_blocks(x.numel(), self.block_size)
        out = torch.empty(self.encoded_nbytes(x.numel()), dtype=torch.uint8, device=x.device)
        _lowbit.quantize(
            x, self.fmt, self.block_size, impl=self.impl, out=(out[4 * nb :], out[: 4 * nb].view(torch.float32))
        )
        return out

    def _split(self, payload: Payload, numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return _scaled_payload(self, payload, numel, device)

    def decode_accumulate(self, acc: torch.Tensor, payload: Payload, weight: float) -> None:
        acc = _check_acc(acc)
        packed, scales = self._split(payload, acc.numel(), acc.device)
        _lowbit.dequantize_accumulate(acc, packed, scales, weight, self.fmt, self.block_size, impl=self.impl)

    def decode(self, payload: Payload, numel: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        device = out.device if out is not None else torch.device("cpu")
        packed, scales = self._split(payload, numel, device)
        return _lowbit.dequantize(packed, scales, numel, self.fmt, self.block_size, impl=self.impl, out=out)


@dataclass(frozen=True, slots=True)
class Int4Codec(_LowBitCodec):
    """Codes -7..7 on a fitted grid: n/2 + 4*ceil(n/B) bytes, ~7x smaller than fp32."""

    name: ClassVar[str] = "int4"
    fmt: ClassVar[Format] = INT4


@dataclass(frozen=True, slots=True)
class Int2Codec(_LowBitCodec):
    """Ternary {-0.4, 0, 0.4} * absmax: n/4 + 4*ceil(n/B) bytes, ~13x smaller than fp32."""

    name: ClassVar[str] = "int2"
    fmt: ClassVar[Format] = INT2


class _RawCodec(Codec):
    """fp16 / fp32 values as they are; every decoded value must be finite."""

    dtype: ClassVar[torch.dtype]
    limit: ClassVar[float]  # largest |x| the format carries

    def encoded_nbytes(self, numel: int) -> int:
        return numel * torch.empty(0, dtype=self.dtype).element_size()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = _flat_input(x)
        values = x.to(self.dtype, copy=True)  # fp16: overflow -> inf, refused just below
        if not bool(torch.isfinite(values).all()):
            i = int((~torch.isfinite(values)).nonzero()[0, 0])
            raise NonFiniteError(
                f"{self.name} encode: element {i} of {x.numel()} is {float(x[i])!r}; "
                f"NaN, inf and values that overflow {self.name} (|x| > ~{self.limit:g}) are refused"
            )
        return values.view(torch.uint8)

    def _values(self, payload: Payload, numel: int, device: torch.device) -> torch.Tensor:
        buf = as_uint8(payload)
        _check_length(buf, self.encoded_nbytes(numel), self.name, numel)
        values = _view_as(buf.to(device), self.dtype)
        finite = torch.isfinite(values)
        if not bool(finite.all()):
            raise MalformedPayload(f"{self.name} payload: value {int((~finite).nonzero()[0, 0])} is not finite")
        return values

    def decode_accumulate(self, acc: torch.Tensor, payload: Payload, weight: float) -> None:
        acc = _check_acc(acc)
        w32 = to_fp32_weight(weight)
        v = self._values(payload, acc.numel(), acc.device).to(torch.float32, copy=True)
        v.mul_(w32)
        acc.add_(v)

    def decode(self, payload: Payload, numel: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        values = self._values(payload, numel, out.device if out is not None else torch.device("cpu"))
        if out is None:
            return values.to(torch.float32, copy=True)
        _check_acc(out).copy_(values)
        return out


@dataclass(frozen=True, slots=True)
class Fp16Codec(_RawCodec):
    """IEEE half: 2 bytes per element; |x| up to 65504."""

    name: ClassVar[str] = "fp16"
    dtype: ClassVar[torch.dtype] = torch.float16
    limit: ClassVar[float] = FP16_MAX


@dataclass(frozen=True, slots=True)
class NoneCodec(_RawCodec):
    """Raw fp32 (a copy of x): 4 bytes per element."""

    name: ClassVar[str] = "none"
    dtype: ClassVar[torch.dtype] = torch.float32
    limit: ClassVar[float] = 3.4028234663852886e38


def get_codec(name: str, *, block_size: int = DEFAULT_BLOCK_SIZE, impl: str | None = None) -> Codec:
    """The codec called ``name``: "int8", "int4", "int2" (block_size, impl apply; int4 / int2 need
    a block size that is a multiple of 2 / 4), "fp16", "none", or "bnb8" (bitsandbytes' blockwise
    dynamic 8-bit; needs CUDA and bitsandbytes)."""
    if name == "int8":
        return Int8Codec(block_size=block_size, impl=impl)
    if name == "int4":
        return Int4Codec(block_size=block_size, impl=impl)
    if name == "int2":
        return Int2Codec(block_size=block_size, impl=impl)
    if name == "fp16":
        return Fp16Codec()
    if name == "none":
        return NoneCodec()
    if name == "bnb8":
        try:
            from .bnb import Bnb8Codec
        except ImportError as e:
            raise KernelUnavailable(f"codec 'bnb8' needs bitsandbytes: {e}") from e
        return Bnb8Codec(block_size=block_size)
    raise ValueError(f"unknown codec {name!r}: expected one of {', '.join((*CODECS, 'bnb8'))}")
