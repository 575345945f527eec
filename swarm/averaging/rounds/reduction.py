"""PartReduction: one member reducing one part of the vector for its group.

It collects each sender's encoded payload for the part, waits until every expected sender has
finished or failed, or was found gone before its stream began (rounds/overdue.py probes the
overdue ones: `watch`), at most the part timeout, then reduces this member's own exact fp32 slice and every complete
sender's decoded slice, weighted by the weights agreed at matchmaking, with the configured
aggregator, and encodes the result once. Those bytes, and the list of members they include, are
`result`: every sender gets exactly them. A payload that fails to decode (MalformedPayload) drops
its sender, so a bad sender leaves no trace.

Aggregators (AveragingConfig.aggregator):
- "robust" (default): robust.py's CenteredClip over the contributions, decoded one wire chunk
  at a time (one pass for the Gram matrix and the weighted mean; a second only when someone is
  dropped or clipped); non-finite and absurd contributions are dropped (left out of
  `included`), far ones clipped; `fates` says what happened to whom;
- "mean": the exact weighted mean, summed in member order, then divided by the total weight.

With "robust", `order` and `gram` keep what the owner audit's receipt needs (audit/flat.py):
the contributions the rule ran on (dropped ones included) and their Gram matrix; the payload
buffers stay until the round has built its receipts.

Streamed (`streams`, an owner's own part in a flat round): as soon as every expected sender's
bytes of a wire chunk are in, that chunk is reduced and encoded, and `chunks_out[c]` says so:
the owner's answers (rounds/flat.py) send it at once, while later chunks are still arriving. The
chunks are those of the weighted mean over every expected sender (the robust rule's first pass,
robust.DataPass, accumulates the Gram matrix alongside). If every chunk went out and the rule
keeps everybody unclipped, those bytes are the result, bit-identical to the whole-part
reduction's. If a sender fails or sends garbage mid-way, or the rule drops or clips someone,
streaming stops and the part is reduced whole as above, from the senders that completed: that
result follows the streamed bytes and replaces them.

The hierarchical round's two stages subclass it (rounds/grid_reduction.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from swarm.averaging.robust import Blocks, DataPass, Fate, mean_coefficients, robust_coefficients, robust_reduce
from swarm.averaging.rounds.overdue import Watch, watch
from swarm.averaging.rounds.partition import payload_layout, payload_size
from swarm_kernels import MalformedPayload, as_memoryview

logger = logging.getLogger(__name__)


def byte_buffer(size: int) -> memoryview:
    """A writable buffer without the zero-fill of bytearray(size): it is overwritten anyway."""
    return as_memoryview(torch.empty(size, dtype=torch.uint8))


class SenderMalformed(Exception):
    """A sender's payload failed to decode during a robust reduction."""

    def __init__(self, index: int, error: MalformedPayload) -> None:
        super().__init__(f"sender {index}: {error}")
        self.index, self.error = index, error


@dataclass
class Incoming:
    """One sender's payload for this part."""

    index: int
    buffer: memoryview
    received: int = 0
    done: bool = False
    failed: bool = False
    gone: bool = False  # the sender cancelled its stream: it gave up on our answer (rounds/confirm.py)
    started: float = 0.0  # monotonic times of the first chunk and, once done, of the last:
    ended: float = 0.0  # the rate the sender's bytes came at (rounds/bandwidth.py)

    def add(self, chunk: bytes | memoryview) -> None:
        end = self.received + len(chunk)
        if end > len(self.buffer):
            raise MalformedPayload(f"sender {self.index} sent more than {len(self.buffer)} bytes")
        if not self.received:
            self.started = time.monotonic()
        self.buffer[self.received : end] = chunk
        self.received = end

    def finish(self) -> None:
        if self.received != len(self.buffer):
            raise MalformedPayload(f"sender {self.index} sent {self.received} of {len(self.buffer)} bytes")
        self.done = True
        self.ended = time.monotonic()

    def span(self) -> tuple[int, float, float] | None:
        """(bytes, first chunk, last chunk) of a payload that came whole (bandwidth.Sample), None
        when it cannot be timed."""
        timed = self.done and self.received > 0 and self.ended > self.started
        return (self.received, self.started, self.ended) if timed else None

    def rate(self) -> float | None:
        """Bytes/s the payload arrived at, None when it cannot be timed."""
        span = self.span()
        return span[0] / (span[2] - span[1]) if span is not None else None


class PartReduction:
    def __init__(
        self,
        part: int,
        lo: int,
        hi: int,
        own_index: int,
        own_slice: torch.Tensor,
        weights: list[float],
        expected: set[int],
        codec: object,
        chunk_elements: int,
        *,
        aggregator: str = "robust",
        streams: bool = False,
        watch: Watch | None = None,
        optional: frozenset[int] = frozenset(),
    ) -> None:
        self.part, self.lo, self.hi = part, lo, hi
        self.own_index, self.own_slice = own_index, own_slice
        self.weights, self.expected = weights, expected
        # senders taken in when their slice comes in time, never waited for (a backup's: the part's
        # own owner, alive but without a result of its own part, sends to it as the others do)
        self.optional = optional
        self.codec, self.chunk_elements = codec, chunk_elements
        self._layout: list[tuple[int, int, slice]] | None = None
        self.aggregator = aggregator
        self.fates: dict[int, Fate] = {}  # contribution index -> what the robust rule did with it
        # what the owner audit's receipt needs (robust aggregator only; audit/flat.py): the
        # contributions the rule ran on (dropped ones included) and their Gram matrix
        self.order: list[int] = []
        self.gram: list[list[float]] = []
        self.senders: dict[int, Incoming] = {}
        # expected senders a probe found gone before their stream began (rounds/overdue.py): the
        # wait does not wait for them; None: nobody probes them, the part timeout alone ends the wait
        self.watch = watch
        self.gone: set[int] = set()
        self.changed = asyncio.Event()
        loop = asyncio.get_running_loop()
        self.result: asyncio.Future[tuple[list[int], memoryview]] = loop.create_future()
        # streaming (module docstring): decided once every sender is here (True) or not (False)
        self.streams = streams
        self.streaming: asyncio.Future[bool] = loop.create_future()
        self.streamed_included: list[int] = []
        self.streamed_payload = memoryview(b"")
        self.chunks_out: list[asyncio.Future[bool]] = []  # True: chunk c is in streamed_payload

    @property
    def encoded_size(self) -> int:
        return payload_size(self.layout)

    @property
    def layout(self) -> list[tuple[int, int, slice]]:
        """The part's chunks, relative to the part: (lo, hi, where in the payload)."""
        if self._layout is None:  # asked as every frame arrives (_streamable): computed once
            self._layout = payload_layout(0, self.hi - self.lo, self.chunk_elements, self.codec.encoded_nbytes)
        return self._layout

    def incoming(self, index: int) -> Incoming:
        """Register a sender; ValueError if it already sent or is not expected."""
        if (index not in self.expected and index not in self.optional) or index in self.senders:
            raise ValueError(f"sender {index} is not expected for part {self.part} (or sent twice)")
        incoming = self.senders[index] = Incoming(index, byte_buffer(self.encoded_size))
        return incoming

    def settled(self) -> bool:
        senders, gone = self.senders, self.gone
        return all((x.done or x.failed) if (x := senders.get(i)) is not None else i in gone for i in self.expected)

    def missing(self) -> set[int]:
        """The expected senders whose stream has not begun and that no probe found gone."""
        return self.expected - self.senders.keys() - self.gone

    def found_gone(self, index: int) -> None:
        """A probe found sender `index` gone (rounds/overdue.py): the part goes on without it."""
        if index in self.expected and index not in self.senders:
            logger.info("part %d: sender %d is gone (its dial was refused or closed): left out", self.part, index)
            self.gone.add(index)
            self.changed.set()

    def unanswered(self) -> set[int]:
        """The expected senders whose slice did not come whole or who gave up on our answer:
        they may take the part from a backup (rounds/confirm.py)."""
        waiting = {i for i, x in self.senders.items() if x.received == len(x.buffer) and not (x.failed or x.gone)}
        return self.expected - waiting

    def settle(self, result: tuple[list[int], memoryview]) -> None:
        """Adopt a result computed elsewhere (the bytes another member already received)."""
        if not self.result.done():
            self.result.set_result(result)

    async def reduce(self, timeout: float, min_contributions: int) -> tuple[list[int], memoryview]:
        """Wait for the senders (at most `timeout`), then reduce and encode; sets `result`.
        Streamed (module docstring) when every sender is here in time."""
        deadline = asyncio.get_running_loop().time() + timeout
        stream = self.streams and len(self.expected) + 1 >= min_contributions
        watching = asyncio.ensure_future(watch(self.missing, self.watch, self.found_gone)) if self.watch else None
        try:
            await self._wait_until(deadline, lambda: self.settled() or (stream and self._streamable(0)))
            stream = stream and not self.result.done() and self._streamable(0)
            if stream and await self._stream(deadline):
                return self.result.result()
            await self._wait_until(deadline, self.settled)
        except Exception as e:  # everyone waiting for the part learns it, not only our log
            if not self.result.done():
                self.result.set_exception(e)
                self.result.exception()
            raise
        finally:
            if watching is not None:
                watching.cancel()
            if not self.streaming.done():
                self.streaming.set_result(False)
            for chunk in self.chunks_out:  # streaming stopped: the answers wait for the whole part
                if not chunk.done():
                    chunk.set_result(False)
        if self.result.done():  # settled from outside (a copy of the original owner's result)
            return self.result.result()
        complete = [i for i in self.expected | self.optional if i in self.senders and self.senders[i].done]
        try:
            included, average = await asyncio.to_thread(self._reduce, complete)
            if len(included) < min_contributions:
                raise ValueError(f"part {self.part}: only {len(included)} contributions, need {min_contributions}")
            payload = await asyncio.to_thread(self._encode, average)
        except Exception as e:
            if not self.result.done():
                self.result.set_exception(e)
                self.result.exception()  # retrieved: the senders may all be gone
            raise
        self.settle((included, payload))
        return self.result.result()

    async def _wait_until(self, deadline: float, done: Callable[[], bool]) -> None:
        """Until done() (checked as senders' bytes come in), the result is set, or the deadline."""
        loop = asyncio.get_running_loop()
        while not done() and not self.result.done() and loop.time() < deadline:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                break

    def _streamable(self, c: int) -> bool:
        """Every expected sender is here, none failed, and each has sent chunk c whole."""
        end = self.layout[c][2].stop if self.layout else 0
        return all((x := self.senders.get(i)) is not None and not x.failed and x.received >= end for i in self.expected)

    async def _stream(self, deadline: float) -> bool:
        """Reduce and encode chunk after chunk as the senders' bytes come in; True when the
        streamed bytes are the result (set), False when the part must be reduced whole."""
        layout, loop = self.layout, asyncio.get_running_loop()
        order = self.streamed_included = sorted({self.own_index, *self.expected})
        weights = [self.weights[i] for i in order]
        payload = torch.empty(payload_size(layout), dtype=torch.uint8)
        self.streamed_payload = as_memoryview(payload)
        self.chunks_out = [loop.create_future() for _ in layout]
        self.streaming.set_result(True)
        average = torch.empty(self.hi - self.lo, dtype=torch.float32)
        robust = self.aggregator == "robust"
        data = DataPass(average.numel(), len(order), average, mean_coefficients(weights), gram=True)
        rows = torch.empty(len(order), max((b - a for a, b, _ in layout), default=0), dtype=torch.float32)
        total = sum(weights)

        def reduce_chunk(a: int, b: int, where: slice) -> None:
            if robust:
                block = rows[:, : b - a]
                self._decode_rows(block, order, a, b, where)
                data.add(a, block)
            else:
                self._mean_chunk(average[a:b], a, b, where, order, total)
            payload[where] = self._encode_chunk(average[a:b])

        for c, (a, b, where) in enumerate(layout):
            await self._wait_until(deadline, lambda c=c: self._streamable(c) or self._any_failed())
            if not self._streamable(c):
                logger.info("part %d: a sender failed or timed out at chunk %d: the part follows whole", self.part, c)
                return False
            try:
                await asyncio.to_thread(reduce_chunk, a, b, where)
            except (MalformedPayload, SenderMalformed) as e:
                logger.info("part %d: streaming stopped at chunk %d: %s", self.part, c, e)
                return False
            self.chunks_out[c].set_result(True)
        if robust:  # the rule on n x n numbers (6 ms of Python at n = 64), off the loop as before
            gram = data.finish()
            coefficients, fates = await asyncio.to_thread(robust_coefficients, gram, weights)
            if coefficients != mean_coefficients(weights):  # someone dropped or clipped
                return False
            self.fates, self.order, self.gram = dict(zip(order, fates, strict=True)), order, gram
        self.settle((order, self.streamed_payload))
        return True

    def _any_failed(self) -> bool:
        return bool(self.gone - self.senders.keys()) or any(x.failed for x in self.senders.values())

    def touched(self) -> dict[int, Fate]:
        """The contributions the robust rule dropped or clipped (after reduce)."""
        return {i: f for i, f in self.fates.items() if f.touched}

    def _reduce(self, complete: list[int]) -> tuple[list[int], torch.Tensor]:
        if self.aggregator == "mean":
            return self._mean(complete)
        return self._robust(complete)

    def _robust(self, complete: list[int]) -> tuple[list[int], torch.Tensor]:
        order = sorted({self.own_index, *complete})
        while True:
            try:
                blocks = self._blocks(order)
                average, fates, gram = robust_reduce(blocks, self.hi - self.lo, [self.weights[i] for i in order])
            except SenderMalformed as e:  # found in the first pass: start over without it
                logger.info("part %d: dropping sender %d, malformed payload: %s", self.part, e.index, e.error)
                order.remove(e.index)
                continue
            self.fates = dict(zip(order, fates, strict=True))
            self.order, self.gram = order, gram
            return [i for i in order if self.fates[i].dropped is None], average

    def _blocks(self, order: list[int]) -> Blocks:
        """The contributions of `order`, one wire chunk at a time: our own slice and each sender's
        payload decoded into one reused (n, chunk) buffer."""

        def blocks() -> Iterator[tuple[int, torch.Tensor]]:
            layout = self.layout
            buffer = torch.empty(len(order), max((b - a for a, b, _ in layout), default=0), dtype=torch.float32)
            for a, b, where in layout:
                block = buffer[:, : b - a]
                self._decode_rows(block, order, a, b, where)
                yield a, block

        return blocks

    def _decode_rows(self, block: torch.Tensor, order: list[int], a: int, b: int, where: slice) -> None:
        """Row k of block: contribution order[k]'s elements [a, b) (ours exact, the others decoded)."""
        for row, i in zip(block, order, strict=True):
            if i == self.own_index:
                row.copy_(self.own_slice[a:b])
                continue
            try:
                self.codec.decode(self.senders[i].buffer[where], b - a, out=row)
            except MalformedPayload as e:
                raise SenderMalformed(i, e) from None

    def _mean(self, complete: list[int]) -> tuple[list[int], torch.Tensor]:
        candidates = sorted({self.own_index, *complete})
        while True:
            acc = torch.empty(self.hi - self.lo, dtype=torch.float32)
            total = sum(self.weights[i] for i in candidates)
            try:
                for a, b, where in self.layout:
                    self._mean_chunk(acc[a:b], a, b, where, candidates, total)
            except SenderMalformed as e:
                logger.info("part %d: dropping sender %d, malformed payload: %s", self.part, e.index, e.error)
                candidates.remove(e.index)
                continue
            return candidates, acc

    def _mean_chunk(self, acc: torch.Tensor, a: int, b: int, where: slice, candidates: list[int], total: float) -> None:
        """acc = the weighted mean of the candidates' elements [a, b): summed in member order, then
        divided by the total weight (chunk by chunk, the same bits as over the whole part)."""
        acc.zero_()
        for i in candidates:
            if i == self.own_index:
                acc.add_(self.own_slice[a:b], alpha=self.weights[i])
                continue
            try:
                self.codec.decode_accumulate(acc, self.senders[i].buffer[where], self.weights[i])
            except MalformedPayload as e:
                raise SenderMalformed(i, e) from None
        if total > 0:
            acc.mul_(1.0 / total)

    def _encode(self, average: torch.Tensor) -> memoryview:
        layout = self.layout
        out = torch.empty(payload_size(layout), dtype=torch.uint8)
        for a, b, where in layout:
            out[where] = self._encode_chunk(average[a:b])
        return as_memoryview(out)

    def _encode_chunk(self, values: torch.Tensor) -> torch.Tensor:
        """One chunk of the result, encoded (whole or streamed alike)."""
        return self.codec.encode(values)
