"""`--compression CODEC[:DENSITY]`, parsed without torch (swarm-sim checks its flags before any
heavy import): the codec that carries the pseudo-gradients and the share of their blocks each
outer step sends (compression.py, sparse_blocks.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CompressionSpec:
    codec: str
    density: float = 1.0

    @classmethod
    def parse(cls, text: str, codecs: Sequence[str]) -> CompressionSpec:
        """ "int8", "int8:0.1": a codec of `codecs` and an optional density in (0, 1]."""
        codec, sep, density_text = text.partition(":")
        if codec not in codecs:
            raise ValueError(f"compression must be one of {', '.join(codecs)} (optionally :DENSITY), got {text!r}")
        density = 1.0
        if sep:
            try:
                density = float(density_text)
            except ValueError:
                raise ValueError(f"compression density must be a number in (0, 1], got {density_text!r}") from None
            if not (math.isfinite(density) and 0.0 < density <= 1.0):
                raise ValueError(f"compression density must be in (0, 1], got {density_text!r}")
            if codec == "none" and density < 1.0:
                raise ValueError("a density below 1 needs a codec (its blocks are the codec's)")
        return cls(codec, density)
