"""RowReduction and ColReduction: the two stages of the hierarchical round (rounds/grid.py).

Both are PartReduction's arithmetic (rounds/reduction.py): over a row's members, encoded sub-part
by sub-part for the column stage, then over the rows' partials, weighted by the members each
partial includes.
"""

from __future__ import annotations

from typing import Any

import torch

from swarm.averaging.rounds.partition import payload_layout, payload_size
from swarm.averaging.rounds.reduction import PartReduction
from swarm_kernels import as_memoryview


class RowReduction(PartReduction):
    """Stage 1 at (r, c): the row's reduction of part c (the configured aggregator), encoded
    sub-part by sub-part (each sub-part's bytes go to its own owner); `average` keeps it in fp32."""

    def __init__(self, subs: list[tuple[int, int]], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.subs = subs  # relative to the part
        self.average = torch.empty(0)

    def _encode(self, average: torch.Tensor) -> memoryview:
        self.average = average
        pieces = []
        for lo, hi in self.subs:
            layout = payload_layout(lo, hi, self.chunk_elements, self.codec.encoded_nbytes)
            out = torch.empty(payload_size(layout), dtype=torch.uint8)
            for a, b, where in layout:
                out[where] = self.codec.encode(average[a:b])
            pieces.append(out)
        return as_memoryview(torch.cat(pieces))


class ColReduction(PartReduction):
    """Stage 2: sub-part s from the rows' partials. Indices are rows; a row's weight is the sum of
    the agreed weights of the members its partial includes (set as its stream arrives); the
    result's `included` lists those members."""

    def __init__(self, member_weights: list[float], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.member_weights = member_weights
        self.row_members: dict[int, list[int]] = {}

    def set_row(self, row: int, members: list[int]) -> None:
        self.row_members[row] = members
        self.weights[row] = sum(self.member_weights[i] for i in members)

    def _reduce(self, complete: list[int]) -> tuple[list[int], torch.Tensor]:
        rows, acc = super()._reduce(complete)
        return sorted(i for r in rows for i in self.row_members[r]), acc
