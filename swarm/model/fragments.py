"""Fragments of a model's parameters, synced in turn (Streaming DiLoCo, Douillard et al. 2025).

With P fragments, outer step s averages and updates fragment s mod P alone: each fragment is
synced every P outer steps (P x --inner-steps inner steps: its own H), a round carries about 1/P
of the model, and the fragments' rounds are staggered through those inner steps. An overlapped
round (--overlap) then lands P times sooner relative to its fragment's H, and its late landing
moves 1/P of the model (scripts/experiments/fragment_sweep.py measures what that saves in loss).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

__all__ = ["fragments_of"]


def fragments_of(sizes: Sequence[int], fragments: int) -> list[range]:
    """`fragments` runs of consecutive tensor indices (the model's parameter order: a fragment is
    a few whole layers), each holding about 1/fragments of the elements `sizes` counts, and each
    at least one tensor."""
    count = len(sizes)
    if not 1 <= fragments <= count:
        raise ValueError(f"fragments must be in [1, {count}] (the model's parameter tensors), got {fragments}")
    if any(s < 1 for s in sizes):
        raise ValueError("every tensor of a fragment must hold at least one element")
    ends = list(itertools.accumulate(sizes))  # ends[i]: elements in tensors 0..i
    total, edges = ends[-1], [0]
    for f in range(1, fragments):
        # the first edge whose fragment reaches its share, leaving a tensor for each fragment after it
        edge = bisect.bisect_left(ends, total * f / fragments) + 1
        edges.append(min(max(edge, edges[-1] + 1), count - (fragments - f)))
    edges.append(count)
    return [range(edges[f], edges[f + 1]) for f in range(fragments)]
