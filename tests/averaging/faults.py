"""Misbehaving codecs for the fault tests (imported by the tests and by member.py)."""

from __future__ import annotations

from typing import Any

import torch

NAN_SCALE = list(b"\x00\x00\xc0\x7f")  # a float32 NaN, little-endian


def garbage_codec(codec: Any) -> Any:
    """A codec that encodes honestly, then overwrites the first block's scale with NaN."""

    class Garbage:
        encoded_nbytes = staticmethod(codec.encoded_nbytes)
        decode = staticmethod(codec.decode)
        decode_accumulate = staticmethod(codec.decode_accumulate)

        @staticmethod
        def encode(x: torch.Tensor) -> torch.Tensor:
            payload = codec.encode(x).clone()
            payload[:4] = torch.tensor(NAN_SCALE, dtype=torch.uint8)
            return payload

    return Garbage()
