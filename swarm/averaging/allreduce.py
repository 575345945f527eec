"""Butterfly all-reduce of one group: every member reduces one part of the flattened vector.

Member i streams part j of its vector, encoded chunk by chunk (the next chunk is encoded in a
worker thread while this one is on the wire), to member j over one `avg.part` stream; member j
reduces the part (reduction.py) and writes the same encoded average back to every sender on the
stream that sender opened, behind a header naming the members the part includes. Every member,
the owner included, decodes those same bytes, so all hold bit-identical results (DESIGN
invariant 4). Client-mode members own no part (bandwidth 0) and open every stream themselves.

Faults (DESIGN invariant 5):
- a sender that dies, stalls or sends a malformed payload is left out of the part; weights
  renormalise over the members included;
- a part whose owner dies is taken over by a backup: the next member after the owner in group
  order that accepts connections (then the next, if that one is dead too). The backup first asks
  the other members whether one of them already received the owner's average (`avg.fetch`); if
  so, everybody gets those very bytes. Otherwise it reduces the part itself from its own slice
  and the contributions the survivors re-send to it;
- the round fails with AllReduceError (the caller's tensors untouched) when a part ends up with
  fewer than min_group_size contributions or no member can reduce it. Every wait is bounded.

    avg.part   {"g": group_id, "i": sender index, "p": part}
               sender -> reducer: the encoded part (raw chunks), then end
               reducer -> sender: msgpack {"inc": [member indices]}, then the encoded average
    avg.fetch  {"g": group_id, "p": part}
               -> msgpack {"inc": [...]} and the encoded average, or {"none": true}
    avg.receipt  the owner audit, once every part is final (audit_round.py)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from swarm.averaging.audit_round import RECEIPT, RoundAudit
from swarm.averaging.config import AveragingConfig
from swarm.averaging.errors import AllReduceError
from swarm.averaging.messages import GroupInfo
from swarm.averaging.partition import capped_bandwidths, chunk_bounds, part_bounds, payload_layout, payload_size
from swarm.averaging.reduction import PartReduction, byte_buffer
from swarm.averaging.robust import Fate
from swarm.p2p.errors import BadRequest, P2PError
from swarm.p2p.handlers import CallContext
from swarm.p2p.host import P2PHost
from swarm.p2p.stream import Stream
from swarm_kernels import MalformedPayload, as_memoryview, get_codec

logger = logging.getLogger(__name__)

PART = "avg.part"
FETCH = "avg.fetch"
# Every stream method a round may serve, and the round's method serving it: the flat round
# serves the first two, hierarchical.py's grid round the last three; a round asked for a method
# it does not serve answers BadRequest.
SERVED = {PART: "serve_part", FETCH: "serve_fetch", "avg.row": "serve_row", "avg.col": "serve_col",
          "avg.down": "serve_down", RECEIPT: "serve_receipt"}  # fmt: skip
MAX_HEADER_BYTES = 64 * 1024
MAX_PENDING_GROUPS = 64

Final = tuple[list[int], memoryview]  # (member indices included, encoded average)


async def read_exactly(stream: Stream, size: int, timeout: float) -> memoryview:
    """The rest of a stream, which must be `size` bytes, copied once into one buffer."""
    buffer, got = byte_buffer(size), 0
    while (chunk := await stream.read(timeout=timeout)) is not None:
        if got + len(chunk) > size:
            raise AllReduceError(f"more than the {size} bytes expected")
        buffer[got : got + len(chunk)] = chunk
        got += len(chunk)
    if got != size:
        raise AllReduceError(f"got {got} bytes, expected {size}")
    return buffer


async def await_parts(
    tasks: dict[int, asyncio.Future[Any]],
    helpers: list[asyncio.Task[Any]],
    finished: Callable[[], None],
    answering: set[asyncio.Future[Any]] | None = None,
    answer_timeout: float = 0.0,
) -> None:
    """Wait for every part's task of a round (and, bounded, for the answers it still owes),
    then cancel the round's helper tasks and call `finished`; AllReduceError names the parts
    that could not be averaged."""
    for task in tasks.values():  # a part that fails after the round was cancelled is not an error to report
        task.add_done_callback(_retrieve)
    try:
        await asyncio.wait(tasks.values())
        if answering:  # so that the report counts the answers we owe
            await asyncio.wait(set(answering), timeout=answer_timeout)
    finally:
        for task in [*tasks.values(), *helpers]:
            task.cancel()
        finished()
    failed = {j: t.exception() for j, t in tasks.items() if t.cancelled() or t.exception() is not None}
    if failed:
        reasons = "; ".join(f"part {j}: {e}" for j, e in failed.items())
        raise AllReduceError(f"{len(failed)} of {len(tasks)} parts could not be averaged ({reasons})")


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: await_parts reports it, or the round was cancelled before


async def write_encoded(stream: Stream, codec: Any, vector: torch.Tensor, lo: int, hi: int, chunk_elements: int) -> int:
    """Stream vector[lo:hi] encoded chunk by chunk (chunk i+1 is encoded in a worker thread
    while chunk i is on the wire), as payload_layout(lo, hi) lays it out; the bytes written."""
    chunks = chunk_bounds(lo, hi, chunk_elements)
    sent = 0
    encoding = asyncio.ensure_future(asyncio.to_thread(codec.encode, vector[lo : chunks[0][1]]))
    try:
        for c in range(len(chunks)):
            payload = await encoding
            if c + 1 < len(chunks):
                a, b = chunks[c + 1]
                encoding = asyncio.ensure_future(asyncio.to_thread(codec.encode, vector[a:b]))
            data = as_memoryview(payload)
            await stream.write(data)
            sent += len(data)
    finally:
        encoding.cancel()
    return sent


async def read_header(stream: Stream, timeout: float) -> tuple[dict[str, Any], int]:
    """The msgpack map that heads a result (and its size); AllReduceError on anything else,
    including {"none": true} (the peer holds no result)."""
    header_raw = await stream.read(timeout=timeout)
    if header_raw is None or len(header_raw) > MAX_HEADER_BYTES:
        raise AllReduceError("no result header")
    try:
        header = msgpack.unpackb(header_raw, raw=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise AllReduceError(f"unreadable result header: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise AllReduceError("malformed result header")
    if header.get("none"):
        raise AllReduceError("the peer holds no result for this part")
    return header, len(header_raw)


@dataclass
class RoundReport:
    group_id: bytes
    members: list[str]
    contributions: dict[int, list[int]]  # part index -> indices of the members it includes
    # part index (as in `contributions`) -> members whose contribution this member's robust
    # reduction of that part dropped or clipped: only the parts this member reduced (their
    # owners know the others). Grid round: a row stage is noted under its owner's own sub-part,
    # and at the column stage a row's partial counts as its sender's (the row owner's).
    clipped: dict[int, list[int]] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    reduce_s: float = 0.0  # from the start until this member's own part was averaged
    total_s: float = 0.0
    audit_excluded: list[Any] = field(default_factory=list)  # PeerIDs that misstated our contribution


class RoundRegistry:
    """Routes `avg.part` / `avg.fetch` streams to their round (one registry per host). A finished
    round lingers for part_timeout so that survivors can still fetch what it holds."""

    def __init__(self, host: P2PHost, config: AveragingConfig) -> None:
        self.host, self.config = host, config
        self.rounds: dict[bytes, Any] = {}  # an AllReduceRound or a hierarchical GridRound
        self._arrived: dict[bytes, asyncio.Event] = {}
        self._timers: dict[bytes, asyncio.TimerHandle] = {}
        for method, serve in SERVED.items():
            host.add_stream_handler(method, self._route(method, serve))

    def close(self) -> None:
        for method in SERVED:
            self.host.remove_handler(method)
        for timer in self._timers.values():
            timer.cancel()

    def add(self, round_: Any) -> None:
        group_id = round_.group.group_id
        self.rounds[group_id] = round_
        self._arrived.setdefault(group_id, asyncio.Event()).set()

    def finished(self, round_: Any) -> None:
        """Keep only what a finished round may still serve (its encoded averages), for a while."""
        round_.release()
        group_id = round_.group.group_id
        loop = asyncio.get_running_loop()
        self._timers[group_id] = loop.call_later(self.config.part_timeout, self._forget, group_id)

    def forget_finished(self) -> None:
        """Drop every finished round now (a caller that knows all members are done with them)."""
        for group_id in [g for g, r in self.rounds.items() if r.finished]:
            self._timers.pop(group_id).cancel()
            self._forget(group_id)

    def _forget(self, group_id: bytes) -> None:
        self.rounds.pop(group_id, None)
        self._arrived.pop(group_id, None)
        self._timers.pop(group_id, None)

    async def _find(self, args: Any) -> Any:
        if not isinstance(args, dict) or not isinstance(args.get("g"), bytes):
            raise BadRequest("needs a group id")
        group_id = args["g"]
        if group_id not in self.rounds and len(self._arrived) < MAX_PENDING_GROUPS:
            event = self._arrived.setdefault(group_id, asyncio.Event())  # the caller may be a moment ahead
            try:
                await asyncio.wait_for(event.wait(), self.config.request_timeout)
            except asyncio.TimeoutError:
                if group_id not in self.rounds:
                    self._arrived.pop(group_id, None)
        round_ = self.rounds.get(group_id)
        if round_ is None:
            raise BadRequest("no such group here")
        return round_

    def _route(self, method: str, serve: str) -> Any:
        async def handler(ctx: CallContext, args: Any, stream: Stream) -> None:
            serving = getattr(await self._find(args), serve, None)
            if serving is None:
                raise BadRequest(f"{method}: this group's round does not serve it")
            await serving(ctx, args, stream)

        return handler


class RoundMember:
    """What every kind of round knows of itself: the group, our index in it, our vector, the
    codec, the members' weights and bandwidths (0 for clients: they own nothing)."""

    def __init__(
        self, host: P2PHost, registry: RoundRegistry, group: GroupInfo, vector: torch.Tensor, config: AveragingConfig
    ) -> None:
        if vector.dtype != torch.float32 or vector.dim() != 1 or not vector.is_contiguous():
            raise ValueError("the all-reduce takes one contiguous 1-D fp32 vector")
        self.host, self.registry, self.group, self.config = host, registry, group, config
        self.me = group.index_of(host.peer_id)
        self.vector = vector
        self.codec = get_codec(config.codec, block_size=config.block_size)
        # self-announced numbers count only within the run's bounds (messages.py); both are
        # computed from the agreed group alone, so every member splits the vector alike
        self.weights = [min(m.weight, config.max_weight) for m in group.members]
        self.bandwidths = capped_bandwidths([0.0 if m.client else m.bandwidth for m in group.members])
        self.result = torch.empty_like(vector)
        self.report = RoundReport(group.group_id, [str(m.peer_id) for m in group.members], {})
        self._tasks: list[asyncio.Task[Any]] = []  # helpers, cancelled when the round ends
        self._started = 0.0
        self.finished = False

    def note_fates(self, part: int, touched: dict[int, tuple[int, Fate]]) -> None:
        """Log and report the contributions a robust reduction of `part` dropped or clipped:
        contribution index -> (the member who sent it, its fate)."""
        for _, (member, fate) in sorted(touched.items()):
            peer = self.group.members[member].peer_id
            what = f"dropped ({fate.dropped})" if fate.dropped else f"clipped to {fate.clip:.3g} of its distance"
            # a clip is routine among honest members whose data differ (it still counts, bounded):
            # said at INFO; a drop leaves a member out: a warning
            level = logging.WARNING if fate.dropped else logging.INFO
            logger.log(level, "round %s: part %d: the contribution of member %d (%s) was %s",
                       self.group.group_id.hex()[:8], part, member, peer, what)  # fmt: skip
        if touched:
            members = {member for member, _ in touched.values()} | set(self.report.clipped.get(part, []))
            self.report.clipped[part] = sorted(members)


class AllReduceRound(RoundMember):
    """One member's side of one round: call `run()` once."""

    def __init__(
        self, host: P2PHost, registry: RoundRegistry, group: GroupInfo, vector: torch.Tensor, config: AveragingConfig
    ) -> None:
        super().__init__(host, registry, group, vector, config)
        self.parts = part_bounds(vector.numel(), self.bandwidths, config.block_size)
        self.final: dict[int, Final] = {}  # the encoded average of each part, as every member gets it
        self.reductions: dict[int, PartReduction] = {}
        self.reducer_of: dict[int, int] = {}  # part -> the member whose result we took (the audit asks it)
        self.audit = RoundAudit(self) if config.audit and config.aggregator == "robust" else None

    async def run(self) -> tuple[torch.Tensor, RoundReport]:
        """The averaged vector (a new tensor) and the report; AllReduceError when the round
        cannot complete. The input vector is never modified."""
        self._started = time.perf_counter()
        self.registry.add(self)
        parts = [j for j, (lo, hi) in enumerate(self.parts) if hi > lo]
        result = self.result  # release() below drops the round's own reference
        tasks = {j: asyncio.ensure_future(self._obtain(j)) for j in parts}
        try:  # the audit runs before the round's buffers are released
            await await_parts(tasks, self._tasks, lambda: None)
            if self.audit is not None:
                self.report.audit_excluded = await self.audit.run(self.reducer_of)
        finally:
            self.registry.finished(self)
        self.report.total_s = time.perf_counter() - self._started
        return result, self.report

    def release(self) -> None:
        """Drop the vectors and buffers of a finished round; `final` stays for avg.fetch."""
        self.finished = True
        self.reductions.clear()
        self.vector = self.result = torch.empty(0)

    # --- getting each part's average ----------------------------------------------------------

    async def _obtain(self, j: int) -> None:
        """Get part j's average: reduce it (our own part), or send our slice to its owner and
        read the average back, or, when the owner is gone, the same with its backups."""
        n = len(self.group.members)
        reducers = [j] + [(j + k) % n for k in range(1, n) if not self.group.members[(j + k) % n].client]
        lo, hi = self.parts[j]
        errors = []
        for reducer in reducers:
            try:
                if reducer == self.me:
                    reduction = self._reduction(j)
                    final = await asyncio.wait_for(asyncio.shield(reduction.result), 3 * self.config.part_timeout)
                else:
                    final = await self._exchange(reducer, j)
                await asyncio.to_thread(self._decode_into, final[1], lo, hi)  # a garbage average: next reducer
                break
            except (P2PError, AllReduceError, MalformedPayload, TimeoutError, ValueError) as e:
                errors.append(f"{reducer}: {e}")
                logger.info("round %s: part %d via member %d failed: %s", self._tag(), j, reducer, e)
        else:
            raise AllReduceError(f"no member could reduce part {j} ({'; '.join(errors)})")
        self.final[j], self.reducer_of[j] = final, reducer
        if self.audit is not None:
            self.audit.result_in(j, final[1], reducer)
        self.report.contributions[j] = final[0]
        if j == self.me:
            self.report.reduce_s = time.perf_counter() - self._started

    def _reduction(self, j: int) -> PartReduction:
        """The reduction of part j here: our own part, or one we take over from a dead owner."""
        reduction = self.reductions.get(j)
        if reduction is None:
            lo, hi = self.parts[j]
            expected = {i for i in range(len(self.group.members)) if i not in (j, self.me)}
            reduction = PartReduction(
                j, lo, hi, self.me, self.vector[lo:hi], self.weights, expected, self.codec, self.config.chunk_elements,
                aggregator=self.config.aggregator,
            )  # fmt: skip
            self.reductions[j] = reduction
            self._tasks.append(asyncio.ensure_future(self._run_reduction(reduction, takeover=j != self.me)))
        return reduction

    async def _run_reduction(self, reduction: PartReduction, takeover: bool) -> None:
        if takeover:
            copy = await self._fetch_from_others(reduction.part)
            if copy is not None:
                reduction.settle(copy)
                return
        try:
            await reduction.reduce(self.config.part_timeout, self.config.min_group_size)
        except Exception as e:  # reduction.result carries it to everyone waiting for this part
            logger.info("round %s: part %d cannot be reduced: %s", self._tag(), reduction.part, e)
        self.note_fates(reduction.part, {i: (i, f) for i, f in reduction.touched().items()})

    async def _exchange(self, reducer: int, j: int) -> Final:
        lo, hi = self.parts[j]
        timeout = self.config.part_timeout
        args = {"g": self.group.group_id, "i": self.me, "p": j}
        member = self.group.members[reducer]
        async with await self.host.open_stream(member.address(), PART, args, timeout=timeout) as stream:
            sent = await write_encoded(stream, self.codec, self.vector, lo, hi, self.config.chunk_elements)
            self.report.bytes_sent += sent  # not `+= await ...`: that reads the total before the await
            await stream.end()
            return await self._read_final(stream, lo, hi, 2 * timeout)

    async def _read_final(self, stream: Stream, lo: int, hi: int, timeout: float) -> Final:
        header, header_size = await read_header(stream, timeout)
        included = header.get("inc")
        if not isinstance(included, list) or not all(
            isinstance(i, int) and 0 <= i < len(self.weights) for i in included
        ):
            raise AllReduceError("malformed result header")
        payload = await read_exactly(stream, self._encoded_size(lo, hi), timeout)
        self.report.bytes_received += len(payload) + header_size
        return included, payload

    async def _fetch_from_others(self, j: int) -> Final | None:
        """Does a member already hold part j's average from its original owner?"""
        lo, hi = self.parts[j]

        async def ask(member_index: int) -> Final:
            member = self.group.members[member_index]
            args = {"g": self.group.group_id, "p": j}
            timeout = self.config.request_timeout
            async with await self.host.open_stream(member.address(), FETCH, args, timeout=timeout) as stream:
                await stream.end()
                return await self._read_final(stream, lo, hi, timeout)

        others = [i for i, m in enumerate(self.group.members) if i not in (j, self.me) and not m.client]
        asks = [asyncio.ensure_future(ask(i)) for i in others]
        try:
            for next_done in asyncio.as_completed(asks):
                try:
                    return await next_done
                except (P2PError, AllReduceError, TimeoutError, ValueError):
                    continue
        finally:
            for task in asks:
                task.cancel()
        return None

    def _decode_into(self, payload: memoryview, lo: int, hi: int) -> None:
        for a, b, where in payload_layout(lo, hi, self.config.chunk_elements, self.codec.encoded_nbytes):
            self.codec.decode(payload[where], b - a, out=self.result[a:b])

    def _encoded_size(self, lo: int, hi: int) -> int:
        return payload_size(payload_layout(lo, hi, self.config.chunk_elements, self.codec.encoded_nbytes))

    def _tag(self) -> str:
        return self.group.group_id.hex()[:8]

    # --- serving -------------------------------------------------------------------------------

    async def serve_part(self, ctx: CallContext, args: dict[str, Any], stream: Stream) -> None:
        index, part = args.get("i"), args.get("p")
        members = self.group.members
        if not isinstance(index, int) or not 0 <= index < len(members) or members[index].peer_id != ctx.peer_id:
            raise BadRequest("avg.part: sender index does not match the caller")
        if not isinstance(part, int) or not 0 <= part < len(members) or members[self.me].client:
            raise BadRequest("avg.part: no such part here")
        if part in self.final and part not in self.reductions:  # we already hold its average
            while await stream.read(timeout=self.config.part_timeout) is not None:
                pass
            await self._reply(stream, self.final[part], index)
            return
        if self.finished:
            raise BadRequest("avg.part: this member's round is over")
        reduction = self._reduction(part)
        try:
            incoming = reduction.incoming(index)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        try:
            while (chunk := await stream.read(timeout=self.config.part_timeout)) is not None:
                incoming.add(chunk)
                self.report.bytes_received += len(chunk)
            incoming.finish()
        except (P2PError, MalformedPayload, TimeoutError) as e:
            logger.info("round %s: sender %d left out of part %d: %s", self._tag(), index, part, e)
            incoming.failed = True
            return
        finally:
            reduction.changed.set()
        final = await asyncio.wait_for(asyncio.shield(reduction.result), 2 * self.config.part_timeout)
        await self._reply(stream, final, index)

    async def serve_fetch(self, ctx: CallContext, args: dict[str, Any], stream: Stream) -> None:
        part = args.get("p")
        if not isinstance(part, int) or not 0 <= part < len(self.group.members):
            raise BadRequest("avg.fetch: no such part")
        final = self.final.get(part)
        if final is None:
            await stream.write(msgpack.packb({"none": True}))
            await stream.end()
            return
        await self._reply(stream, final, None)

    async def serve_receipt(self, ctx: CallContext, args: dict[str, Any], stream: Stream) -> None:
        if self.audit is None:
            raise BadRequest("avg.receipt: this round is not audited")
        await self.audit.serve(ctx, args, stream)

    async def _reply(self, stream: Stream, final: Final, index: int | None) -> None:
        header = msgpack.packb({"inc": final[0]})
        try:
            await stream.write(header)
            await stream.write(memoryview(final[1]))
            await stream.end()
        except P2PError as e:  # the caller left before its answer: its loss alone
            logger.info("round %s: member %s left before its result: %s", self._tag(), index, e)
            return
        self.report.bytes_sent += len(header) + len(final[1])
