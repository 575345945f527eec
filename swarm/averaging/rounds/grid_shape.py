"""The grid of a hierarchical round (rounds/grid.py): pure arithmetic, no I/O, tested on its own.

Owners are the members that accept connections and announce a bandwidth > 0 (bandwidth 0 means
client mode, as in the flat round), in group order. The first rows*cols owners fill the grid
row-major: owner k sits at (k // cols, k % cols). Every other member (client-mode, or an owner
left over when the owners do not fill whole rows) is a passenger: passenger j rides in row
j % rows, sends its slices like any member of that row and owns nothing, so it needs no inbound
connection.

Shape: for each cols in 1..min(cap, owners), rows = owners // cols; the smallest key wins:
  1. how far the largest row (passengers included) or the column height exceeds the cap (0
     when both fit): the cap bounds each member's fan-out;
  2. leftover owners (owners that ride as passengers): every bandwidth should serve;
  3. largest row + rows: a member talks to about that many peers;
  4. more columns first (shorter columns: fewer stage-2 exchanges).
With k*k owners and no passengers that is the square k x k; 12 owners, cap 4: 3 rows of 4.

Vector split: part c (column c) in proportion to the sum of its owners' bandwidths, and within
it sub-part (r, c) in proportion to owner (r, c)'s bandwidth; every boundary on a multiple of
block_size (partition.part_bounds), so each sub-part quantizes like that slice of the whole vector.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swarm.averaging.rounds.partition import part_bounds


@dataclass(frozen=True, slots=True)
class Grid:
    rows: int
    cols: int
    owners: tuple[tuple[int, ...], ...]  # owners[r][c]: the member index at (r, c)
    row_members: tuple[tuple[int, ...], ...]  # row r: its owners and passengers, in group order
    row_of: tuple[int, ...]  # member index -> its row
    col_of: tuple[int, ...]  # member index -> the column it owns, -1 for a passenger
    parts: tuple[tuple[int, int], ...]  # column c -> [lo, hi) of the vector
    subs: tuple[tuple[tuple[int, int], ...], ...]  # subs[c][r]: [lo, hi) of sub-part (r, c)

    def __post_init__(self) -> None:
        if len(self.owners) != self.rows or any(len(row) != self.cols for row in self.owners):
            raise ValueError("a grid's owners must fill rows x cols")


def grid_shape(owners: int, passengers: int, cap: int) -> tuple[int, int]:
    """(rows, cols) by the rule in the module docstring."""
    if owners < 1 or cap < 2 or passengers < 0:
        raise ValueError("a grid needs at least one owner and a cap >= 2")

    def key(cols: int) -> tuple[int, int, int, int]:
        rows = owners // cols
        riders = passengers + owners - rows * cols
        largest_row = cols + -(-riders // rows)
        widest = max(largest_row, rows)
        return widest if widest > cap else 0, owners - rows * cols, largest_row + rows, -cols

    cols = min(range(1, min(cap, owners) + 1), key=key)
    return owners // cols, cols


def make_grid(bandwidths: Sequence[float], numel: int, cap: int, block_size: int) -> Grid:
    """The grid of a group whose members announce `bandwidths` (0: client mode)."""
    if any(b < 0 for b in bandwidths):
        raise ValueError("bandwidths must be >= 0")
    able = [i for i, b in enumerate(bandwidths) if b > 0]
    if not able:
        raise ValueError("at least one member must accept connections")
    rows, cols = grid_shape(len(able), len(bandwidths) - len(able), cap)
    placed = able[: rows * cols]
    owners = tuple(tuple(placed[r * cols : (r + 1) * cols]) for r in range(rows))
    row_of, col_of = [0] * len(bandwidths), [-1] * len(bandwidths)
    for k, i in enumerate(placed):
        row_of[i], col_of[i] = k // cols, k % cols
    passengers = [i for i in range(len(bandwidths)) if col_of[i] < 0]
    for j, i in enumerate(passengers):
        row_of[i] = j % rows
    row_members = tuple(tuple(i for i in range(len(bandwidths)) if row_of[i] == r) for r in range(rows))
    column_bandwidth = [sum(bandwidths[owners[r][c]] for r in range(rows)) for c in range(cols)]
    parts = tuple(part_bounds(numel, column_bandwidth, block_size))
    subs = []
    for c, (lo, hi) in enumerate(parts):
        within = part_bounds(hi - lo, [bandwidths[owners[r][c]] for r in range(rows)], block_size)
        subs.append(tuple((lo + a, lo + b) for a, b in within))
    return Grid(rows, cols, owners, row_members, tuple(row_of), tuple(col_of), parts, tuple(subs))
