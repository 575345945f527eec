"""GridServing: the owner's side of a grid round (rounds/grid.py), the streams other members open.

Owner (r, c) serves avg.row (a row member's slice of part c, into the row partial), avg.col (a
row partial's sub-part r, from the owner of column c in another row) and avg.down (a final
sub-part or part it holds, for a backup or a member whose row owner failed); every member serves
avg.fetch (a final sub-part it holds, or its vote on it: rounds/confirm.py). Each checks who
asks, reads the payload into the reduction it belongs to, and answers with the final bytes once
they exist; the wire format is in rounds/grid.py's docstring.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import msgpack

from swarm.averaging.errors import AllReduceError
from swarm.averaging.rounds.confirm import backup_patience
from swarm.averaging.rounds.registry import COL, ROW
from swarm.averaging.rounds.streams import Final
from swarm.p2p.errors import BadRequest, NotFound, P2PError
from swarm.p2p.handlers import CallContext
from swarm.p2p.stream import Stream
from swarm_kernels import MalformedPayload

if TYPE_CHECKING:
    from swarm.averaging.config import AveragingConfig
    from swarm.averaging.messages import GroupInfo
    from swarm.averaging.rounds.confirm import Votes
    from swarm.averaging.rounds.grid_reduction import ColReduction, RowReduction
    from swarm.averaging.rounds.grid_shape import Grid
    from swarm.averaging.rounds.member import RoundReport
    from swarm.p2p.peer_id import PeerID

logger = logging.getLogger(__name__)

FAILURES = (P2PError, AllReduceError, MalformedPayload, TimeoutError, ValueError)  # an exchange that failed


class GridServing:
    """The avg.row, avg.col and avg.down handlers of one member's grid round (see the module
    docstring). A mixin of GridRound, which owns the state below and the column reductions
    (`_col_reduction` starts one, ours or one taken over from a dead owner); the round's
    registry routes each stream here by its group id."""

    # GridRound's state, read (and the reductions fed) here
    group: GroupInfo
    config: AveragingConfig
    report: RoundReport
    me: int
    row: int
    col: int
    grid: Grid
    peers: set[PeerID]
    final: dict[tuple[int, int], Final]
    part_done: asyncio.Future[None]
    row_reduction: RowReduction | None
    col_reductions: dict[int, ColReduction]
    votes: Votes
    finished: bool
    _answering: set[asyncio.Task[Any]]

    def _sender(self, ctx: CallContext, args: dict[str, Any], method: str) -> int:
        index, part = args.get("i"), args.get("p")
        members = self.group.members
        if not isinstance(index, int) or not 0 <= index < len(members) or members[index].peer_id != ctx.peer_id:
            raise BadRequest(f"{method}: sender index does not match the caller")
        if not isinstance(part, int) or part != self.col or part < 0 or index == self.me:
            raise BadRequest(f"{method}: no such part here")
        return index

    async def _drain(self, stream: Stream, incoming: Any) -> bool:
        """Read a sender's payload into `incoming`; False (sender left out) if it breaks."""
        try:
            while (chunk := await stream.read(timeout=self.config.part_timeout)) is not None:
                incoming.add(chunk)
                self.report.bytes_received += len(chunk)
            incoming.finish()
            self.note_download(incoming)
            return True
        except (P2PError, MalformedPayload, TimeoutError) as e:
            logger.info("round %s: sender %d left out of a partial: %s", self._tag(), incoming.index, e)
            incoming.failed = True
            return False

    async def serve_row(self, ctx: CallContext, args: dict[str, Any], stream: Stream) -> None:
        index = self._sender(ctx, args, ROW)
        if self.grid.row_of[index] != self.row or self.row_reduction is None:
            raise BadRequest("avg.row: the sender is not in this row")
        if self.finished and not self.part_done.done():
            raise BadRequest("avg.row: this member's round is over")
        try:
            incoming = self.row_reduction.incoming(index)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        try:
            if not await self._drain(stream, incoming):
                return
        finally:
            self.row_reduction.changed.set()
        await self._answer_part(stream, incoming.rate())

    async def serve_col(self, ctx: CallContext, args: dict[str, Any], stream: Stream) -> None:
        index = self._sender(ctx, args, COL)
        s, members, row = args.get("s"), args.get("inc"), self.grid.row_of[index]
        if self.grid.col_of[index] != self.col or not isinstance(s, int) or not 0 <= s < self.grid.rows or s == row:
            raise BadRequest("avg.col: no such sub-part for this sender")
        if (
            not isinstance(members, list)
            or not members
            or not all(isinstance(i, int) for i in members)
            or members != sorted(set(members))
            or not set(members) <= set(self.grid.row_members[row])
        ):
            raise BadRequest("avg.col: the partial's members must be its row's, sorted")
        if (self.col, s) in self.final and s not in self.col_reductions:  # we already hold it
            while await stream.read(timeout=self.config.part_timeout) is not None:
                pass
            await self._answer(stream, [self.final[(self.col, s)]])
            return
        if self.finished:
            raise BadRequest("avg.col: this member's round is over")
        reduction = self._col_reduction(s)
        try:
            incoming = reduction.incoming(row)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        reduction.set_row(row, members)
        try:
            try:
                if not await self._drain(stream, incoming):
                    return
            finally:
                reduction.changed.set()
            try:
                wait = 4 * self.config.part_timeout  # a sub-part taken over asks for copies first
                if s != self.row:
                    wait = backup_patience(wait, self.config.request_timeout)
                final = await asyncio.wait_for(asyncio.shield(reduction.result), wait)
            except FAILURES as e:  # the sender tries the next reducer
                raise NotFound(f"avg.col: sub-part {s} could not be reduced here: {e}") from None
            await self._answer(stream, [final], rate=incoming.rate())
        except asyncio.CancelledError:  # the sender cancelled its stream: it gave up on our answer
            incoming.gone = True
            if not incoming.done:
                incoming.failed = True
            reduction.changed.set()
            raise

    async def serve_down(self, ctx: CallContext, args: dict[str, Any], stream: Stream) -> None:
        part, s = args.get("p"), args.get("s")
        if ctx.peer_id not in self.peers:
            raise BadRequest("avg.down: only members of the group")
        if not isinstance(part, int) or part != self.col or part < 0:
            raise BadRequest("avg.down: no such part here")
        if not isinstance(s, int) or not -1 <= s < self.grid.rows:
            raise BadRequest("avg.down: no such sub-part")
        if s >= 0:
            final = self.final.get((part, s))
            if final is None:
                await stream.write(msgpack.packb({"none": True}))
                return
            await self._answer(stream, [final])
            return
        await self._answer_part(stream)

    async def serve_fetch(self, ctx: CallContext, args: dict[str, Any], stream: Stream) -> None:
        """A final sub-part we hold, or our vote on it (rounds/confirm.py), for any member."""
        key = args.get("p")
        if ctx.peer_id not in self.peers:
            raise BadRequest("avg.fetch: only members of the group")
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < self.grid.rows * self.grid.cols:
            raise BadRequest("avg.fetch: no such sub-part")
        if args.get("d") is True:
            await stream.write(await self.votes.answer(key))
            await stream.end()
            return
        if divmod(key, self.grid.rows) not in self.final:  # a copy its owner sends us now counts (rounds/confirm.py)
            await self.votes.held_or_not_coming(key)
        final = self.final.get(divmod(key, self.grid.rows))
        if final is None:
            await stream.write(msgpack.packb({"none": True}))
            await stream.end()
            return
        await self._answer(stream, [final])

    async def _answer_part(self, stream: Stream, rate: float | None = None) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self.part_done), 4 * self.config.part_timeout)
        except FAILURES as e:  # the sender asks another row for the part
            raise NotFound(f"part {self.col} could not be averaged here: {e}") from None
        empty: Final = ([], memoryview(b""))  # a sub-part too small to own any block
        finals = [self.final.get((self.col, s), empty) for s in range(self.grid.rows)]
        await self._answer(stream, finals, whole=True, rate=rate)

    async def _answer(
        self, stream: Stream, finals: list[Final], whole: bool = False, rate: float | None = None
    ) -> None:
        """Finals to a member; `rate`: the bytes/s its payload came at (rounds/bandwidth.py)."""
        header = msgpack.packb({"inc": [f[0] for f in finals] if whole else finals[0][0],
                                **({"r": rate} if rate is not None else {})})  # fmt: skip
        size = len(header) + sum(len(f[1]) for f in finals)
        self.report.bytes_sent += size  # counted as it starts, so that run() sees it (see run)
        answering = asyncio.current_task()
        if answering is not None:
            self._answering.add(answering)
        try:
            await stream.write(header)
            for _, payload in finals:
                if payload:
                    await stream.write(memoryview(payload))
            await stream.end()
        except P2PError as e:  # the caller left before its answer: its loss alone
            logger.info("round %s: a member left before its result: %s", self._tag(), e)
            self.report.bytes_sent -= size
        finally:
            self._answering.discard(answering)  # type: ignore[arg-type]
