"""FlatServing: the owner's side of a flat round (rounds/flat.py), the streams other members open.

A member serves avg.part (a sender's slice of the part it reduces, or of one it took over from a
dead owner), avg.fetch (a part's average it already holds, for a backup) and avg.receipt (the
owner audit, audit/flat.py). Each checks who asks, feeds the slice to the part's reduction and
answers with the average: chunk by chunk while the part is reduced when the reduction streams,
else whole once it exists. The wire format is in rounds/flat.py's docstring.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from swarm.averaging.errors import AllReduceError
from swarm.averaging.rounds.confirm import backup_patience
from swarm.averaging.rounds.reduction import Incoming, PartReduction
from swarm.averaging.rounds.streams import Final
from swarm.p2p.errors import BadRequest, NotFound, P2PError
from swarm.p2p.handlers import CallContext
from swarm.p2p.stream import Stream
from swarm_kernels import MalformedPayload

if TYPE_CHECKING:
    from swarm.averaging.audit.flat import RoundAudit
    from swarm.averaging.config import AveragingConfig
    from swarm.averaging.messages import GroupInfo
    from swarm.averaging.rounds.confirm import Votes
    from swarm.averaging.rounds.member import RoundReport

logger = logging.getLogger(__name__)


class ServedRound(Protocol):
    """What FlatServing reads of its round (rounds/flat.py's AllReduceRound), and the round's
    methods it calls: `reduction_of` starts the reduction of a part here (ours, or one taken over
    from a dead owner), `pace_to` caps our sending to a member once its stream runs."""

    group: GroupInfo
    me: int
    config: AveragingConfig
    final: dict[int, Final]
    reductions: dict[int, PartReduction]
    report: RoundReport
    votes: Votes
    audit: RoundAudit | None
    finished: bool
    _answering: set[asyncio.Task[Any]]

    def _tag(self) -> str: ...

    def pace_to(self, index: int) -> None: ...

    def reduction_of(self, j: int) -> PartReduction: ...

    def note_download(self, incoming: Incoming) -> None: ...


class FlatServing:
    """The avg.part, avg.fetch and avg.receipt handlers of one member's flat round (the module
    docstring); the round's registry routes each stream to the round, which hands it here."""

    def __init__(self, round_: ServedRound) -> None:
        self.round = round_

    async def serve_part(self, ctx: CallContext, args: dict[str, Any], stream: Stream) -> None:
        r = self.round
        index, part = args.get("i"), args.get("p")
        members = r.group.members
        if not isinstance(index, int) or not 0 <= index < len(members) or members[index].peer_id != ctx.peer_id:
            raise BadRequest("avg.part: sender index does not match the caller")
        if not isinstance(part, int) or not 0 <= part < len(members) or members[r.me].client:
            raise BadRequest("avg.part: no such part here")
        if part in r.final and part not in r.reductions:  # we already hold its average
            while await stream.read(timeout=r.config.part_timeout) is not None:
                pass
            await self._reply(stream, r.final[part], index)
            return
        if r.finished:
            raise BadRequest("avg.part: this member's round is over")
        r.pace_to(index)
        reduction = r.reduction_of(part)
        try:
            incoming = reduction.incoming(index)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        uploaded = asyncio.get_running_loop().create_future()
        answer = asyncio.ensure_future(self._stream_answer(stream, reduction, incoming, uploaded))
        try:
            await self._take_slice(stream, reduction, incoming, uploaded, answer)
        except asyncio.CancelledError:  # the sender cancelled its stream: it gave up on our answer
            incoming.gone = True
            if not incoming.done:
                incoming.failed = True
            reduction.changed.set()
            raise
        finally:
            answer.cancel()

    async def _take_slice(
        self,
        stream: Stream,
        reduction: PartReduction,
        incoming: Incoming,
        uploaded: asyncio.Future[None],
        answer: asyncio.Future[bool],
    ) -> None:
        """Read a sender's slice into the part's reduction, then answer it (whole, unless
        `answer` streamed it)."""
        r, index, part = self.round, incoming.index, reduction.part
        try:
            while (chunk := await stream.read(timeout=r.config.part_timeout)) is not None:
                incoming.add(chunk)
                r.report.bytes_received += len(chunk)
                reduction.changed.set()  # a chunk of the part may be complete: streaming
            incoming.finish()
        except (P2PError, MalformedPayload, TimeoutError) as e:
            logger.info("round %s: sender %d left out of part %d: %s", r._tag(), index, part, e)
            incoming.failed = True
            return
        finally:
            reduction.changed.set()
        uploaded.set_result(None)
        r.note_download(incoming)
        # from here we owe the sender its answer: registered before the part's result can exist
        # (no await since its last chunk), so a round that returns with our part waits for it
        answering = asyncio.current_task()
        if answering is not None:
            r._answering.add(answering)
        try:
            await self._answer_slice(stream, reduction, incoming, answer)
        finally:
            r._answering.discard(answering)  # type: ignore[arg-type]

    async def _answer_slice(
        self, stream: Stream, reduction: PartReduction, incoming: Incoming, answer: asyncio.Future[bool]
    ) -> None:
        """The part's result to a sender whose slice we took (unless `answer` streamed it)."""
        r, part = self.round, reduction.part
        try:
            if await answer:
                return
            wait = 2 * r.config.part_timeout  # a part taken over asks for copies first: as long again as a sender waits
            if part != r.me:
                wait = backup_patience(wait, r.config.request_timeout)
            final = await asyncio.wait_for(asyncio.shield(reduction.result), wait)
        except (AllReduceError, ValueError, TimeoutError) as e:  # the sender tries the next reducer
            raise NotFound(f"avg.part: part {part} could not be reduced here: {e}") from None
        await self._reply(stream, final, incoming.index, incoming.rate())

    async def _stream_answer(
        self, stream: Stream, reduction: PartReduction, incoming: Incoming, uploaded: asyncio.Future[None]
    ) -> bool:
        """Answer a sender chunk by chunk as the part is reduced (the module docstring); False
        when the reduction is not streamed (the whole result is sent once it exists)."""
        r = self.round
        timeout = 2 * r.config.part_timeout
        if not reduction.streams or not await asyncio.wait_for(asyncio.shield(reduction.streaming), timeout):
            return False
        sent, streamed = 0, 0
        try:
            header = msgpack.packb({"inc": reduction.streamed_included, "st": 1})
            await stream.write(header)
            sent += len(header)
            for c, (_, _, where) in enumerate(reduction.layout):
                if not await asyncio.wait_for(asyncio.shield(reduction.chunks_out[c]), timeout):
                    break  # streaming stopped: the whole result follows
                mark = msgpack.packb({"c": c})
                await stream.write(mark)
                await stream.write(reduction.streamed_payload[where])
                sent, streamed = sent + len(mark) + where.stop - where.start, streamed + 1
            await asyncio.wait_for(asyncio.shield(uploaded), timeout)  # then the rate its bytes came at
            final = await asyncio.wait_for(asyncio.shield(reduction.result), timeout)
            rate = incoming.rate()
            timed = {"r": rate} if rate is not None else {}
            if streamed == len(reduction.layout) and final[1] is reduction.streamed_payload:
                last = msgpack.packb({"fin": 1, **timed})
                await stream.write(last)
            else:
                last = msgpack.packb({"inc": final[0], **timed})
                await stream.write(last)
                await stream.write(memoryview(final[1]))
                sent += len(final[1])
            await stream.end()
        except P2PError as e:  # the caller left before its answer: its loss alone
            logger.info("round %s: member %s left before its result: %s", r._tag(), incoming.index, e)
            return True
        r.report.bytes_sent += sent + len(last)
        return True

    async def serve_fetch(self, ctx: CallContext, args: dict[str, Any], stream: Stream) -> None:
        r = self.round
        part = args.get("p")
        if not isinstance(part, int) or not 0 <= part < len(r.group.members):
            raise BadRequest("avg.fetch: no such part")
        if args.get("d") is True:  # a vote on the part's result (rounds/confirm.py)
            await stream.write(await r.votes.answer(part))
            await stream.end()
            return
        if part not in r.final:  # a copy the owner is sending us now counts (rounds/confirm.py)
            await r.votes.held_or_not_coming(part)
        final = r.final.get(part)
        if final is None:
            await stream.write(msgpack.packb({"none": True}))
            await stream.end()
            return
        await self._reply(stream, final, None)

    async def serve_receipt(self, ctx: CallContext, args: dict[str, Any], stream: Stream) -> None:
        r = self.round
        if r.audit is None:
            raise BadRequest("avg.receipt: this round is not audited")
        await r.audit.serve(ctx, args, stream)

    async def _reply(self, stream: Stream, final: Final, index: int | None, rate: float | None = None) -> None:
        """The result to a sender (index; None: a fetch), with the rate its slice came at."""
        r = self.round
        header = msgpack.packb({"inc": final[0], **({"r": rate} if rate is not None else {})})
        try:
            await stream.write(header)
            await stream.write(memoryview(final[1]))
            await stream.end()
        except P2PError as e:  # the caller left before its answer: its loss alone
            logger.info("round %s: member %s left before its result: %s", r._tag(), index, e)
            return
        r.report.bytes_sent += len(header) + len(final[1])
