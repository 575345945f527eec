"""bitsandbytes' blockwise dynamic 8-bit quantization as an alternative codec (CUDA only).

Not the same numbers as our int8 codec: bitsandbytes maps each value, scaled by its block's
absmax, to the nearest of 256 levels of its signed "dynamic" map (finer near zero), so its
error is smaller for small values and its decode is a table lookup. Layout on the wire:
``absmax fp32[ceil(n/B)]`` then ``indices uint8[n]``; both sides use
``create_dynamic_map(signed=True)``, so the map is not sent. Importing this module needs
bitsandbytes; get_codec("bnb8") also needs CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from bitsandbytes import functional as bnbf

from . import codecs
from .errors import KernelUnavailable, MalformedPayload
from .reference import DEFAULT_BLOCK_SIZE, num_blocks, to_fp32_weight

BNB_BLOCK_SIZES = (256, 512, 1024, 2048, 4096)  # what its CUDA kernels accept


@dataclass(frozen=True, slots=True)
class Bnb8Codec(codecs.Codec):
    block_size: int = DEFAULT_BLOCK_SIZE
    name: ClassVar[str] = "bnb8"

    def __post_init__(self) -> None:
        if not torch.cuda.is_available():
            raise KernelUnavailable("codec 'bnb8' needs CUDA")
        if self.block_size not in BNB_BLOCK_SIZES:
            raise ValueError(f"bnb8 block_size must be one of {BNB_BLOCK_SIZES}, got {self.block_size}")

    def encoded_nbytes(self, numel: int) -> int:
        return 4 * num_blocks(numel, self.block_size) + numel

    def _map(self, device: torch.device) -> torch.Tensor:
        return bnbf.create_dynamic_map(signed=True).to(device)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = codecs._flat_input(x).to("cuda", torch.float32)
        if not bool(torch.isfinite(x).all()):
            raise codecs.NonFiniteError("bnb8 encode: NaN or inf in the input")
        n, nb = x.numel(), num_blocks(x.numel(), self.block_size)
        indices, state = bnbf.quantize_blockwise(x, code=self._map(x.device), blocksize=self.block_size)
        out = torch.empty(4 * nb + n, dtype=torch.uint8, device=x.device)
        out[: 4 * nb].view(torch.float32).copy_(state.absmax.reshape(-1))
        out[4 * nb :].copy_(indices.reshape(-1))
        return out

    def _values(self, payload: codecs.Payload, numel: int) -> torch.Tensor:
        buf = codecs.as_uint8(payload)
        codecs._check_length(buf, self.encoded_nbytes(numel), self.name, numel)
        buf = buf.to("cuda")
        nb = num_blocks(numel, self.block_size)
        absmax = codecs._view_as(buf[: 4 * nb], torch.float32)
        if not bool((torch.isfinite(absmax) & (absmax >= 0)).all()):
            raise MalformedPayload("bnb8 payload: a block absmax is negative or not finite")
        indices = buf[4 * nb :]
        return bnbf.dequantize_blockwise(indices, absmax=absmax, code=self._map(buf.device), blocksize=self.block_size)

    def decode_accumulate(self, acc: torch.Tensor, payload: codecs.Payload, weight: float) -> None:
        acc = codecs._check_acc(acc)
        v = self._values(payload, acc.numel()).to(acc.device, torch.float32)
        v.mul_(to_fp32_weight(weight))
        acc.add_(v)

    def decode(self, payload: codecs.Payload, numel: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        v = self._values(payload, numel).float()
        if out is None:
            return v
        codecs._check_acc(out).copy_(v)
        return out
