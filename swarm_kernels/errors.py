"""The codec's typed errors. Each is a ValueError (bad data), except KernelUnavailable."""

from __future__ import annotations


class NonFiniteError(ValueError):
    """The input to quantize (or to an fp16/none encode) holds NaN, inf, or a value the codec
    cannot carry (|x| > 2**127 for int8, > 65504 for fp16). Nothing is encoded."""


class MalformedPayload(ValueError):
    """A payload received from a peer is not one our encoder could have produced: wrong length,
    a scale that is negative, non-finite, subnormal or too large, the int8 code -128, or a
    non-finite fp16/fp32 value. The accumulator is left untouched, so the caller can drop the
    sender and carry on."""


class KernelUnavailable(RuntimeError):
    """An implementation was asked for by name but cannot run here (no CUDA, no Triton, ...)."""
