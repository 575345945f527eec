"""GridReader: how a member of a grid round (rounds/grid.py) reads the finals another member sends
it, after the answer's header: the header's member lists, checked against the group and the grid,
then the encoded sub-parts of one column, whose sizes the grid and the codec fix. The wire format
is in rounds/grid.py's docstring; the round reads each header itself (it times its upload by it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from swarm.averaging.errors import AllReduceError
from swarm.averaging.rounds.partition import payload_layout, payload_size
from swarm.averaging.rounds.streams import Final, read_exactly

if TYPE_CHECKING:
    from swarm.averaging.rounds.grid_shape import Grid
    from swarm.averaging.rounds.member import RoundReport
    from swarm.p2p.stream import Stream
    from swarm_kernels import Codec


class GridReader:
    """Reads the finals of one member's grid round: `sub` one final sub-part, `part` a whole
    final part (its sub-parts in row order); every byte read counts in the round's `report`.
    A header or payload that does not fit raises AllReduceError."""

    def __init__(
        self, grid: Grid, members: int, codec: Codec, chunk_elements: int, timeout: float, report: RoundReport
    ) -> None:
        self.grid, self.members, self.codec, self.chunk_elements = grid, members, codec, chunk_elements
        self.timeout = timeout  # for each payload, after its header (the round's part_timeout)
        self.report = report

    def encoded_size(self, lo: int, hi: int) -> int:
        """The bytes of [lo, hi) of the vector, encoded chunk by chunk in the round's codec."""
        return payload_size(payload_layout(lo, hi, self.chunk_elements, self.codec.encoded_nbytes))

    async def sub(self, stream: Stream, c: int, s: int, header: dict[str, Any], header_size: int) -> Final:
        """Final sub-part s of column c, after its header (`header_size` bytes, read)."""
        return self.checked_members(header.get("inc")), await self.payload(stream, c, [s], header_size)

    async def part(self, stream: Stream, c: int, header: dict[str, Any], header_size: int) -> list[Final]:
        """Final part c, one Final per sub-part in row order, after its header (`header_size`
        bytes, read: one member list per sub-part)."""
        members = header.get("inc")
        if not isinstance(members, list) or len(members) != self.grid.rows:
            raise AllReduceError("malformed part header")
        members = [self.checked_members(m) for m in members]
        payload = await self.payload(stream, c, list(range(self.grid.rows)), header_size)
        finals, offset = [], 0
        for s, (lo, hi) in enumerate(self.grid.subs[c]):
            end = offset + self.encoded_size(lo, hi)
            finals.append((members[s], payload[offset:end]))
            offset = end
        return finals

    async def payload(self, stream: Stream, c: int, subs: list[int], header_size: int) -> memoryview:
        """The encoded sub-parts `subs` of column c, one after the other."""
        size = sum(self.encoded_size(*self.grid.subs[c][s]) for s in subs)
        payload = await read_exactly(stream, size, self.timeout)
        self.report.bytes_received += size + header_size
        return payload

    def checked_members(self, members: Any) -> list[int]:
        """A header's member list: member indices of the group, else AllReduceError."""
        if not isinstance(members, list) or not all(isinstance(i, int) and 0 <= i < self.members for i in members):
            raise AllReduceError("malformed member list")
        return members
