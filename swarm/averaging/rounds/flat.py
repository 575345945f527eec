"""Butterfly all-reduce of one group: every member reduces one part of the flattened vector.

Member i streams part j of its vector, encoded chunk by chunk (the next chunk is encoded in a
worker thread while this one is on the wire), to member j over one `avg.part` stream; member j
reduces the part (rounds/reduction.py) and writes the same encoded average back to every sender on the
stream that sender opened, behind a header naming the members the part includes. Every member,
the owner included, decodes those same bytes, so all hold bit-identical results (DESIGN
invariant 4). Client-mode members own no part (bandwidth 0) and open every stream themselves.

Faults (DESIGN invariant 5):
- a sender that dies, stalls or sends a malformed payload is left out of the part; weights
  renormalise over the members included. One whose stream has not begun when it is overdue is
  probed: a refused dial or a closed connection leaves it out at once (rounds/overdue.py);
- a part whose owner dies is taken over by a backup: the next member after the owner in group
  order that accepts connections (then the next, if that one is dead too). The backup first asks
  the other members whether they already received the owner's average (`avg.fetch`); if two of
  them hold the same bytes (rounds/confirm.py), everybody gets those very bytes. Otherwise it
  reduces the part itself from its own slice and the contributions the survivors re-send to it,
  the owner's among them when the owner is alive without a result of its own part (its senders
  came after its wait ran out): it sends to the backup as they do;
- an owner that a sender gave up on (its slice never came whole, or it cancelled its stream
  before our answer: a stalled owner reads those from its buffers once it runs again), or whose
  result is ready more than LATE_TIMEOUTS part timeouts after its group formed, uses its own
  result only if the group holds it, else the group's (rounds/confirm.py);
- the round fails with AllReduceError (the caller's tensors untouched) when a part ends up with
  fewer than min_group_size contributions or no member can reduce it. Every wait is bounded.

    avg.part   {"g": group_id, "i": sender index, "p": part}
               sender -> reducer: the encoded part (raw chunks), then end
               reducer -> sender: msgpack {"inc": [member indices]}, then the encoded average;
               or, streamed (the owner's own part: rounds/reduction.py), {"inc": [...], "st": 1}, then
               {"c": c} and chunk c's bytes as each chunk is reduced, while the senders' bytes
               still arrive, then {"fin": 1} (those bytes are the average) or {"inc": [...]}
               and the whole encoded average (reduced again without a sender that failed, or
               by the robust rule clipping someone: it replaces the streamed bytes)
    avg.fetch  {"g": group_id, "p": part}
               -> msgpack {"inc": [...]} and the encoded average, or {"none": true}
    avg.fetch  {"g": group_id, "p": part, "d": true}
               -> msgpack {"d": digest, "by": reducer} or {"none": true} (rounds/confirm.py)
    avg.receipt  the owner audit, each part once its result is final (audit/flat.py)

This module gets each part's average; the owner's side of these streams is flat_serving.py's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from swarm.averaging.audit.flat import RoundAudit
from swarm.averaging.config import AveragingConfig
from swarm.averaging.errors import AllReduceError
from swarm.averaging.messages import GroupInfo
from swarm.averaging.rounds.bandwidth import PACE_FACTOR, busy_rate
from swarm.averaging.rounds.confirm import (
    Unconfirmed,
    Votes,
    backup_patience,
    confirm_own_part,
    group_result,
    in_doubt,
    vouched_copy,
)
from swarm.averaging.rounds.flat_serving import FlatServing
from swarm.averaging.rounds.member import RoundMember, RoundReport, await_parts
from swarm.averaging.rounds.overdue import MIN_MARGIN_S
from swarm.averaging.rounds.partition import part_bounds, payload_layout, payload_size, upload_paces
from swarm.averaging.rounds.reduction import PartReduction, byte_buffer
from swarm.averaging.rounds.registry import FETCH, PART, RoundRegistry
from swarm.averaging.rounds.streams import Final, read_exactly, read_header, read_into, write_encoded
from swarm.p2p.errors import P2PError
from swarm.p2p.handlers import CallContext
from swarm.p2p.host import P2PHost
from swarm.p2p.pacing import MIN_RATE
from swarm.p2p.stream import Stream
from swarm.utils.eventloop import exception_seen
from swarm_kernels import MalformedPayload

logger = logging.getLogger(__name__)

SAMPLE_S = 0.05  # how often a round that measures bandwidth notes what the group acknowledged

# imported from here by callers: the round, what it reports and raises, and the registry it joins
__all__ = ["AllReduceRound"]


class AllReduceRound(RoundMember):
    """One member's side of one round: call `run()` once. `upload`: our link's upload rate
    (bytes/s, bandwidth.LinkEstimate.pace); when given, the round caps its sending to each member
    at that member's share of it (partition.upload_paces) and lifts the caps when it ends."""

    def __init__(
        self,
        host: P2PHost,
        registry: RoundRegistry,
        group: GroupInfo,
        vector: torch.Tensor,
        config: AveragingConfig,
        *,
        upload: float | None = None,
        formed_at: float | None = None,
        probe_after: float = MIN_MARGIN_S,
    ) -> None:
        super().__init__(host, registry, group, vector, config, probe_after=probe_after)
        # when we learned of the group (time.monotonic; None: as the round starts): rounds/confirm.py
        # asks whether our result of our part came late (confirm.LATE_TIMEOUTS)
        self.formed_at = time.monotonic() if formed_at is None else formed_at
        self.parts = part_bounds(vector.numel(), self.bandwidths, config.block_size)
        # member index -> the cap on our sending to it, while the round runs (`pace_to`); never under
        # the kernel's floor (a member announcing a tiny bandwidth owns a tiny part, so a tiny share)
        paces = upload_paces(self.parts, self.me, upload, PACE_FACTOR) if upload is not None else {}
        self.paces = {j: max(MIN_RATE, rate) for j, rate in paces.items()}
        self.paced: set[int] = set()
        self.final: dict[int, Final] = {}  # the encoded average of each part, as every member gets it
        self.reductions: dict[int, PartReduction] = {}
        self.reducer_of: dict[int, int] = {}  # part -> the member whose result we took (the audit asks it)
        self.votes = Votes(config.request_timeout)  # what we hold, for the other members' checks (confirm.py)
        self.audit = RoundAudit(self) if config.audit and config.aggregator == "robust" else None
        self.serving = FlatServing(self)  # answers the streams other members open (flat_serving.py)

    async def run(self) -> tuple[torch.Tensor, RoundReport]:
        """The averaged vector (a new tensor) and the report; AllReduceError when the round
        cannot complete. The input vector is never modified."""
        self._started = time.perf_counter()
        self.registry.add(self)
        parts = [j for j, (lo, hi) in enumerate(self.parts) if hi > lo]
        result = self.result  # release() below drops the round's own reference
        acked: list[tuple[float, int]] = []
        sampler = asyncio.ensure_future(self._sample_acked(acked)) if self.config.measure_bandwidth else None
        tasks = {j: asyncio.ensure_future(self._obtain(j)) for j in parts}
        try:  # the audit runs before the round's buffers are released
            await await_parts(tasks, self._tasks, lambda: None, self._answering, self.config.part_timeout)
            if self.audit is not None:
                self.report.audit_excluded = await self.audit.run(self.reducer_of)
        finally:
            self.registry.finished(self)
            if self.audit is not None:
                self.audit.cancel()
            for index in self.paced:
                self.host.pace(self.group.members[index].peer_id, None)
            if sampler is not None:
                sampler.cancel()
        self.report.busy = busy_rate(acked)
        self.report.total_s = time.perf_counter() - self._started
        return result, self.report

    async def _sample_acked(self, acked: list[tuple[float, int]]) -> None:
        """What the other members acknowledged of our sending, every SAMPLE_S, for the round's
        busy rate (bandwidth.busy_rate). Not what we wrote: up to 8 MiB a connection waits in
        buffers, so writes come in bursts seconds apart on a slow link."""
        peers = [m.peer_id for i, m in enumerate(self.group.members) if i != self.me]
        while True:
            acked.append((time.monotonic(), self.host.bytes_acked(peers)))
            await asyncio.sleep(SAMPLE_S)

    def pace_to(self, index: int) -> None:
        """Cap our sending to member `index` at its share of our upload, once a stream to or from
        it runs (the connection exists by then); `run` lifts the caps."""
        rate = self.paces.get(index)
        if rate is not None and index not in self.paced and self.host.pace(self.group.members[index].peer_id, rate):
            self.paced.add(index)

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
                    reduction = self.reduction_of(j)
                    final = await asyncio.wait_for(asyncio.shield(reduction.result), 3 * self.config.part_timeout)
                    # whose result of our part holds?
                    if j == self.me and in_doubt(self.formed_at, self.config.part_timeout, reduction):
                        own = final
                        final, reducer = await confirm_own_part(self, j, own)
                        if reducer != self.me and self.audit is not None:
                            self.audit.supersede(j, own[1])
                else:
                    final = await self._exchange(reducer, j)
                await asyncio.to_thread(self._decode_into, final[1], lo, hi)  # a garbage average: next reducer
                break
            except Unconfirmed:  # not the next reducer: asked for our part, a backup would reduce it again
                raise
            except (P2PError, AllReduceError, MalformedPayload, TimeoutError, ValueError) as e:
                errors.append(f"{reducer}: {e}")
                logger.info("round %s: part %d via member %d failed: %s", self._tag(), j, reducer, e)
                if reducer == j:  # the owner's answer was garbage, or did not come: a copy asked for is "none"
                    self.votes.not_coming(j)
        else:
            raise AllReduceError(f"no member could reduce part {j} ({'; '.join(errors)})")
        self.final[j], self.reducer_of[j] = final, reducer
        if (taken := self.reductions.get(j)) is not None:
            # a sender that could not reach part j's owner took us for its backup and waits on our
            # takeover: it gets the result we hold, now, not after our round dropped the takeover
            taken.settle(final)
        self.votes.hold(j, final[1], reducer)
        if self.audit is not None:
            self.audit.result_in(j, final[1], reducer)
        self.report.contributions[j] = final[0]
        if j == self.me:
            self.report.reduce_s = time.perf_counter() - self._started

    def reduction_of(self, j: int) -> PartReduction:
        """The reduction of part j here: our own part, or one we take over from a dead owner."""
        reduction = self.reductions.get(j)
        if reduction is None:
            lo, hi = self.parts[j]
            expected = {i for i in range(len(self.group.members)) if i not in (j, self.me)}
            # a part we take over: its owner may be alive and without a result of its own part (its
            # senders came after its wait ran out); it then sends its slice here as the others do.
            # Refused, it could not finish the round that everyone else finished (in a soak under
            # load: an owner whose senders were all late left its group and fetched the step)
            owner = frozenset({j}) if j != self.me else frozenset()
            reduction = PartReduction(
                j, lo, hi, self.me, self.vector[lo:hi], self.weights, expected, self.codec, self.config.chunk_elements,
                aggregator=self.config.aggregator, streams=self.config.stream_parts and j == self.me,
                watch=self.watch(), optional=owner,
            )  # fmt: skip
            self.reductions[j] = reduction
            self._tasks.append(asyncio.ensure_future(self._run_reduction(reduction, takeover=j != self.me)))
        return reduction

    async def _run_reduction(self, reduction: PartReduction, takeover: bool) -> None:
        j = reduction.part
        if takeover:
            # a copy of the dead owner's result that other members hold (checked: rounds/confirm.py)
            others = [i for i, m in enumerate(self.group.members) if i not in (j, self.me) and not m.client]
            copy = await vouched_copy(self, j, others)
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
        patience = 2 * timeout if reducer == j else backup_patience(2 * timeout, self.config.request_timeout)
        args = {"g": self.group.group_id, "i": self.me, "p": j}
        member = self.group.members[reducer]
        async with await self.host.open_stream(member.address(), PART, args, timeout=timeout) as stream:
            self.pace_to(reducer)
            started = time.monotonic()
            # read while we write: a streamed answer begins before our slice is all sent. Once the
            # owner's answer has begun, a backup asking us for a copy waits for it (confirm.Votes)
            begun = (lambda: self.votes.coming(j)) if reducer == j else None
            answer = asyncio.ensure_future(self._read_final(stream, lo, hi, patience, begun))
            answer.add_done_callback(exception_seen)
            try:
                sent = await write_encoded(stream, self.codec, self.vector, lo, hi, self.config.chunk_elements)
                local_s = time.monotonic() - started
                self.report.bytes_sent += sent  # not `+= await ...`: that reads the total before the await
                await stream.end()
                final, last = await answer
            finally:
                answer.cancel()
            self.note_upload(sent, started, local_s, last)  # the owner timed our bytes in its last map
            if last.get("fin") == 1:
                self.report.streamed.append(j)
            return final

    async def _read_final(
        self, stream: Stream, lo: int, hi: int, timeout: float, begun: Callable[[], None] | None = None
    ) -> tuple[Final, dict[str, Any]]:
        """A result (its header, then its payload, whole or streamed chunk by chunk), and the
        last map of the answer (a streamed one's trailer). `begun` is called once the header is in."""
        header, received = await read_header(stream, timeout)
        if begun is not None:
            begun()
        included = self._included(header)
        size = self._encoded_size(lo, hi)
        if not header.get("st"):
            payload = await read_exactly(stream, size, timeout)
            self.report.bytes_received += received + size
            return (included, payload), header
        layout = payload_layout(lo, hi, self.config.chunk_elements, self.codec.encoded_nbytes)
        payload, chunks = byte_buffer(size), 0
        while True:
            message, message_size = await read_header(stream, timeout)
            received += message_size
            if "c" not in message:
                break
            if message["c"] != chunks or chunks >= len(layout):
                raise AllReduceError("streamed result: chunks out of order")
            where = layout[chunks][2]
            await read_into(stream, payload[where], timeout)
            received, chunks = received + where.stop - where.start, chunks + 1
        if "inc" in message:  # reduced again: the whole average replaces the streamed bytes
            included = self._included(message)
            payload = await read_exactly(stream, size, timeout)
            received += size
        elif message.get("fin") != 1 or chunks != len(layout) or await stream.read(timeout=timeout) is not None:
            raise AllReduceError("streamed result: malformed end")
        self.report.bytes_received += received
        return (included, payload), message

    def _included(self, header: dict[str, Any]) -> list[int]:
        included = header.get("inc")
        if not isinstance(included, list) or not all(
            isinstance(i, int) and 0 <= i < len(self.weights) for i in included
        ):
            raise AllReduceError("malformed result header")
        return included

    async def take_group_result(self, j: int) -> Final | None:
        """Part j's owner says the group did not take the result it sent us: the group's
        result in its place, when the group confirms it (rounds/confirm.py); None when not."""
        found = await group_result(self, j, self.final[j])
        if found is None:
            return None
        final, reducer = found
        lo, hi = self.parts[j]
        await asyncio.to_thread(self._decode_into, final[1], lo, hi)
        self.final[j], self.reducer_of[j] = final, reducer
        self.votes.hold(j, final[1], reducer)  # a vote on part j is on these bytes now
        self.report.contributions[j] = final[0]
        return final

    async def fetch_result(self, member_index: int, j: int) -> Final:
        """The result of part j that member `member_index` holds (avg.fetch)."""
        lo, hi = self.parts[j]
        member = self.group.members[member_index]
        args = {"g": self.group.group_id, "p": j}
        timeout = self.config.request_timeout
        async with await self.host.open_stream(member.address(), FETCH, args, timeout=timeout) as stream:
            await stream.end()
            final, _ = await self._read_final(stream, lo, hi, timeout)
            return final

    def _decode_into(self, payload: memoryview, lo: int, hi: int) -> None:
        for a, b, where in payload_layout(lo, hi, self.config.chunk_elements, self.codec.encoded_nbytes):
            self.codec.decode(payload[where], b - a, out=self.result[a:b])

    def _encoded_size(self, lo: int, hi: int) -> int:
        return payload_size(payload_layout(lo, hi, self.config.chunk_elements, self.codec.encoded_nbytes))

    # --- serving: the registry routes these streams to the round; FlatServing answers them -------

    async def serve_part(self, ctx: CallContext, args: dict[str, Any], stream: Stream) -> None:
        await self.serving.serve_part(ctx, args, stream)

    async def serve_fetch(self, ctx: CallContext, args: dict[str, Any], stream: Stream) -> None:
        await self.serving.serve_fetch(ctx, args, stream)

    async def serve_receipt(self, ctx: CallContext, args: dict[str, Any], stream: Stream) -> None:
        await self.serving.serve_receipt(ctx, args, stream)
