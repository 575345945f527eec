"""Pure arithmetic of a round: which slice of the flattened vector each member reduces (its
part), and how a part travels in chunks. No I/O; tested on its own. (Who is in the group and
who leads it: matchmaking/ready.py.)"""

from __future__ import annotations

from collections.abc import Callable, Sequence

BANDWIDTH_CAP = 4.0  # a member's bandwidth counts at most this many times the group's median


def capped_bandwidths(bandwidths: Sequence[float]) -> list[float]:
    """The bandwidths parts are split by: each announced one capped at BANDWIDTH_CAP times the
    lower median of the positive announcements (0 stays 0: a client owns nothing). Every member
    computes it from the agreed group alone, so all get the same parts; one member announcing
    1e12 MB/s owns at most BANDWIDTH_CAP / (BANDWIDTH_CAP + n - 1) of the vector, not all of it.
    The lower median: with two owners, the honest one's figure bounds the other's."""
    positive = sorted(b for b in bandwidths if b > 0)
    if not positive:
        return list(bandwidths)
    cap = BANDWIDTH_CAP * positive[(len(positive) - 1) // 2]
    return [min(b, cap) for b in bandwidths]


def part_bounds(numel: int, bandwidths: Sequence[float], block_size: int) -> list[tuple[int, int]]:
    """Split [0, numel) into one contiguous part per member, in member order, proportional to
    bandwidth (0 for client-mode members: an empty part), boundaries on multiples of block_size
    so that every part quantizes exactly like the same slice of the whole vector."""
    if not bandwidths or any(b < 0 for b in bandwidths) or sum(bandwidths) <= 0:
        raise ValueError("at least one member must own a part, and bandwidths must be >= 0")
    blocks = -(-numel // block_size)
    total = sum(bandwidths)
    bounds, cumulative, start = [], 0.0, 0
    for bandwidth in bandwidths:
        cumulative += bandwidth
        end_block = round(blocks * cumulative / total)
        end = min(numel, end_block * block_size)
        bounds.append((start, max(start, end)))
        start = max(start, end)
    last_owner = max(i for i, b in enumerate(bandwidths) if b > 0)
    lo, _ = bounds[last_owner]
    bounds[last_owner] = (lo, numel)  # rounding never leaves a tail unowned
    for i in range(last_owner + 1, len(bounds)):
        bounds[i] = (numel, numel)
    return bounds


def chunk_bounds(start: int, end: int, chunk_elements: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + chunk_elements, end)) for lo in range(start, end, chunk_elements)]


def payload_layout(
    start: int, end: int, chunk_elements: int, encoded_nbytes: Callable[[int], int]
) -> list[tuple[int, int, slice]]:
    """Where each chunk of [start, end) lies in the part's encoded payload: (lo, hi, byte slice)."""
    layout, offset = [], 0
    for lo, hi in chunk_bounds(start, end, chunk_elements):
        size = encoded_nbytes(hi - lo)
        layout.append((lo, hi, slice(offset, offset + size)))
        offset += size
    return layout


def payload_size(layout: list[tuple[int, int, slice]]) -> int:
    return layout[-1][2].stop if layout else 0


def upload_paces(parts: Sequence[tuple[int, int]], me: int, upload: float, factor: float) -> dict[int, float]:
    """Bytes/s to cap our sending to each other member at (p2p/pacing.py says why): our upload
    rate times `factor`, split in proportion to what we send each one in a round: our slice of its
    part, plus our own part's average, which every member gets. Members we send nothing get no
    cap (an empty dict when we send nobody anything)."""
    if not (upload > 0 and factor > 0):
        raise ValueError(f"upload rate and factor must be positive, got {upload} and {factor}")
    mine = parts[me][1] - parts[me][0]
    load = {j: hi - lo + mine for j, (lo, hi) in enumerate(parts) if j != me}
    total = sum(load.values())
    return {j: factor * upload * b / total for j, b in load.items() if b > 0}
