"""Half of a weighted set: the quorum a lineage's endorsement and a group's leader both count."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Set
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def holds_half(weights: Mapping[K, float], chosen: Set[K]) -> bool:
    """Do `chosen` hold at least half of the keys of `weights`, by count and by weight?"""
    count = sum(1 for k in weights if k in chosen)
    weight = sum(w for k, w in weights.items() if k in chosen)
    return 2 * count >= len(weights) and 2 * weight >= sum(weights.values())
