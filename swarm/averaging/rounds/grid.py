"""Hierarchical butterfly all-reduce: a group larger than max_group_size averages over a grid.

The grid (rounds/grid_shape.py): owner (r, c) in row r, column c; passengers (client-mode members and owners
left over) ride in a row and own nothing. Part c of the vector belongs to column c; sub-part
(r, c), a block-aligned slice of part c, to owner (r, c). For a member x of row r:

1. rows (avg.row): x streams its slice of every part c, encoded, to (r, c); the owner of column c
   keeps its own slice exact. (r, c) reduces its row (reduction.PartReduction, with the
   configured aggregator: robust.py by default): the reduction of the complete payloads, the
   members included, and so the row's weight (the sum of their agreed weights). It encodes this
   row partial ONCE, sub-part by sub-part, in the round's codec: row partials travel in the
   precision members send in (int8 blockwise, fp16 or fp32), which keeps the bytes exactly
   those of the flat round; it keeps the fp32 partial for its own use.
2. columns (avg.col): (r, c) streams sub-part r' of its row partial, with the members it
   includes, to (r', c). (r', c) reduces its own exact partial and every complete row partial,
   rows in order, each weighted by its row's weight (the receiver computes it from the agreed
   member weights), with the same aggregator, and ENCODES THE FINAL SUB-PART ONCE. Robust here
   too, because a row partial is whatever its row owner (any member) chose to send: with 3 or
   more rows a bad partial is dropped or bounded like a bad member. Honest partials (means of
   whole rows) lie closer together than members do, so the rule leaves them alone (exactly the
   weighted mean), and it costs a Gram matrix of rows x rows over one sub-part. With 2 rows
   there is no majority: nothing is clipped, only a non-finite or absurd partial is dropped.
3. back: (r', c) answers each avg.col stream with the final sub-part; once it holds every
   sub-part of part c it answers each avg.row stream of its row with the whole final part c:
   the bytes it received, never re-encoded. Every member decodes the very same bytes for every
   sub-part, so all hold bit-identical results (DESIGN invariant 4).

Cost: with equal bandwidths, E the encoded vector and n = rows*cols, (r, c) sends E - E/C
(stage 1) + (C-1)E/C (row answers) + E/C - E/n (stage 2) + (R-1)E/n (column answers)
= 2(n-1)/n E, exactly the flat round, and receives as much; it talks to about row size + rows
peers instead of n.

    avg.row   {"g": group id, "i": sender index, "p": column}
              sender -> (r, p): its encoded slice of part p, then end
              (r, p) -> sender: {"inc": [[member indices] per sub-part, in row order]}, then the
              final part p (the sub-parts' payloads in row order)
    avg.col   {"g", "i": sender index, "p": column, "s": sub-part row, "inc": [member indices]}
              (r, p) -> the reducer of sub-part s: its row partial's sub-part s, then end
              reducer -> sender: {"inc": [member indices]}, then the final sub-part s
    avg.down  {"g", "p": column, "s": sub-part row, or -1 for the whole part}
              -> {"inc": [...]} and the final sub-part s if held now, else {"none": true};
              s = -1: waits (bounded) for the whole final part p, answered as on avg.row
    avg.fetch {"g", "p": sub-part key (column x rows + row)}, any member: as avg.down's s >= 0;
              with "d": true, the member's vote on that sub-part's final (rounds/confirm.py)

Faults (DESIGN invariant 5):
- a row member that dies, stalls or sends garbage, or is found gone (rounds/overdue.py), is left
  out of its row's partial; a row partial that does not arrive whole or does not decode, or whose
  owner is found gone, leaves its row out of that sub-part (weights renormalise; the header names
  the members included);
- owner (r, c) dying: sub-part (r, c) is taken over by (r+1, c), then (r+2, c)..., as in the
  flat round: the backup first asks the members (avg.fetch) whether they already hold (r, c)'s
  final sub-part, and if two hold the same bytes (rounds/confirm.py) everyone gets those;
  otherwise it reduces it from the row partials the column re-sends to it (row r's partial died
  with its owner). The members of row r whose avg.row stream fails fetch final part c from
  (r+1, c), (r+2, c)... (avg.down, s = -1): their part-c slices are lost, and the part's headers
  say so. Survivors stay bit-identical;
- an owner that a sender of its column gave up on, or whose own sub-part's final is ready late
  (a stalled process: it reads the others' bytes from its buffers once it runs again), uses it
  only if the group holds it, else the group's: rounds/confirm.py, as the flat round's owner;
- a sub-part with fewer than min_group_size members, or that no owner of its column could
  reduce, fails the round with AllReduceError (the caller's tensors untouched) for every member
  that needs it, i.e. every member that did not already receive it.
Every wait is bounded by part_timeout (a chunk, a sender, a row), a few of them end to end.

Audit (audit/grid.py, robust aggregator): once part c is final, its owners build receipts of
the sub-part they reduced and of their row partial; after the parts, every member checks them
before the round's buffers go (and the round lingers to serve them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch

from swarm.averaging.audit.grid import GridAudit
from swarm.averaging.config import AveragingConfig
from swarm.averaging.errors import AllReduceError
from swarm.averaging.messages import GroupInfo
from swarm.averaging.rounds.confirm import Unconfirmed, Votes, backup_patience, confirm_own_part, in_doubt, vouched_copy
from swarm.averaging.rounds.grid_reading import GridReader
from swarm.averaging.rounds.grid_reduction import ColReduction, RowReduction
from swarm.averaging.rounds.grid_serving import FAILURES, GridServing
from swarm.averaging.rounds.grid_shape import make_grid
from swarm.averaging.rounds.member import RoundMember, RoundReport, await_parts
from swarm.averaging.rounds.overdue import MIN_MARGIN_S
from swarm.averaging.rounds.partition import payload_layout
from swarm.averaging.rounds.registry import COL, DOWN, FETCH, ROW, RoundRegistry
from swarm.averaging.rounds.streams import Final, read_header, write_encoded
from swarm.p2p.errors import BadRequest
from swarm.p2p.handlers import CallContext
from swarm.p2p.host import P2PHost
from swarm.p2p.stream import Stream
from swarm.utils.eventloop import exception_seen

logger = logging.getLogger(__name__)

__all__ = ["COL", "DOWN", "ROW", "GridRound"]  # the method names are rounds/registry.py's, imported from here too


def _fail(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
        future.exception()  # retrieved: nobody may be waiting any more


class GridRound(GridServing, RoundMember):
    """One member's side of one hierarchical round: call `run()` once (as AllReduceRound).

    The member's side of each stage is here; the owner's side, which answers the other members'
    avg.row, avg.col and avg.down streams, is GridServing's (rounds/grid_serving.py)."""

    def __init__(
        self,
        host: P2PHost,
        registry: RoundRegistry,
        group: GroupInfo,
        vector: torch.Tensor,
        config: AveragingConfig,
        *,
        formed_at: float | None = None,
        probe_after: float = MIN_MARGIN_S,
    ) -> None:
        super().__init__(host, registry, group, vector, config, probe_after=probe_after)
        # asks whether our result of our own sub-part came late (rounds/confirm.py)
        self.formed_at = time.monotonic() if formed_at is None else formed_at
        self.grid = make_grid(self.bandwidths, vector.numel(), config.max_group_size, config.block_size)
        self.row, self.col = self.grid.row_of[self.me], self.grid.col_of[self.me]
        # the finals the other members send us, after their headers (rounds/grid_reading.py)
        self.reader = GridReader(
            self.grid, len(group.members), self.codec, config.chunk_elements, config.part_timeout, self.report
        )
        self.peers = {m.peer_id for m in group.members}
        self.final: dict[tuple[int, int], Final] = {}  # (column, sub-part row) -> as every member gets it
        self.part_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # our column
        self.row_reduction: RowReduction | None = None  # None: a passenger
        if self.col >= 0:
            lo, hi = self.grid.parts[self.col]
            subs = [(a - lo, b - lo) for a, b in self.grid.subs[self.col]]
            expected = set(self.grid.row_members[self.row]) - {self.me}
            self.row_reduction = RowReduction(subs, self.col, lo, hi, self.me, vector[lo:hi], self.weights,
                                              expected, self.codec, config.chunk_elements,
                                              aggregator=config.aggregator, watch=self.watch())  # fmt: skip
        self.col_reductions: dict[int, ColReduction] = {}
        self.votes = Votes(config.request_timeout)  # what we hold, for the other members' checks (confirm.py)
        self.audit = GridAudit(self) if config.audit and config.aggregator == "robust" else None

    async def run(self) -> tuple[torch.Tensor, RoundReport]:
        """The averaged vector (a new tensor) and the report; AllReduceError when the round
        cannot complete. The input vector is never modified."""
        self._started = time.perf_counter()
        self.registry.add(self)
        result = self.result  # release() drops the round's own reference
        live = [c for c, (lo, hi) in enumerate(self.grid.parts) if hi > lo]
        jobs = {c: self._own_part() if c == self.col else self._via_row(c) for c in live}
        tasks = {c: asyncio.ensure_future(job) for c, job in jobs.items()}
        try:  # the audit runs before the round's buffers are released
            await await_parts(tasks, self._tasks, lambda: None, self._answering, self.config.part_timeout)
            if self.audit is not None:
                self.report.audit_excluded = await self.audit.run()
        finally:
            self.registry.finished(self)
        self.report.total_s = time.perf_counter() - self._started
        return result, self.report

    def release(self) -> None:
        """Drop the vectors and buffers of a finished round; `final` stays for avg.down."""
        self.finished = True
        self.col_reductions.clear()
        if self.row_reduction is not None:
            self.row_reduction.senders.clear()
            self.row_reduction.own_slice = self.row_reduction.average = torch.empty(0)
        self.vector = self.result = torch.empty(0)

    # --- our own column: row partial, then every sub-part of it ----------------------------------

    async def _own_part(self) -> None:
        assert self.row_reduction is not None  # an owner has one
        self._tasks.append(asyncio.ensure_future(self._reduce_row(self.row_reduction)))
        live = [s for s, (lo, hi) in enumerate(self.grid.subs[self.col]) if hi > lo]
        tasks = [asyncio.ensure_future(self._obtain_sub(s)) for s in live]
        for task in tasks:  # one that fails after the round ended (its buffers released) is not an error to report
            task.add_done_callback(exception_seen)
        try:
            await asyncio.wait(tasks)
            for task in tasks:
                task.result()  # the first failure, if any
        except Exception as e:
            _fail(self.part_done, e)
            raise
        finally:
            for task in tasks:
                task.cancel()
        self.part_done.set_result(None)

    async def _reduce_row(self, reduction: RowReduction) -> None:
        try:
            await reduction.reduce(self.config.part_timeout, 1)
        except Exception as e:  # reduction.result carries it to whoever waits for the partial
            logger.info("round %s: row partial of part %d failed: %s", self._tag(), self.col, e)
        self.note_fates(self.col * self.grid.rows + self.row, {i: (i, f) for i, f in reduction.touched().items()})

    async def _row_partial(self) -> tuple[list[int], memoryview, torch.Tensor]:
        assert self.row_reduction is not None
        inc, payload = await asyncio.wait_for(asyncio.shield(self.row_reduction.result), 2 * self.config.part_timeout)
        return inc, payload, self.row_reduction.average

    async def _obtain_sub(self, s: int) -> None:
        """Sub-part s of our column: reduce it (ours), or send our row partial of it to its owner
        and read the final back, or, when that owner is gone, the same with its backups."""
        rows = self.grid.rows
        reducers = [s] if s == self.row else [(s + k) % rows for k in range(rows)]
        errors = []
        for reducer in reducers:
            try:
                by = self.grid.owners[reducer][self.col]
                if reducer == self.row:
                    reduction = self._col_reduction(s)
                    final = await asyncio.wait_for(asyncio.shield(reduction.result), 4 * self.config.part_timeout)
                    # whose result of our sub-part holds? the column's owners say (rounds/confirm.py)
                    if s == self.row and in_doubt(self.formed_at, self.config.part_timeout, reduction):
                        column = [self.grid.owners[r][self.col] for r in range(rows) if r != s]
                        final, by = await confirm_own_part(self, self.col * rows + s, final, column)
                else:
                    final = await self._exchange_col(reducer, s)
                    if reducer == s:  # the owner's answer is here: a backup asking for copies waits for it
                        self.votes.coming(self.col * rows + s)
                await asyncio.to_thread(self._decode, self.col, s, final[1])  # garbage: the next reducer
                break
            except Unconfirmed:  # not the next reducer: asked for our sub-part, a backup would reduce it again
                raise
            except FAILURES as e:
                errors.append(f"{reducer}: {e}")
                logger.info("round %s: sub-part %d/%d via row %d failed: %s", self._tag(), self.col, s, reducer, e)
                if reducer == s:  # the owner's answer was garbage, or did not come: a copy asked for is "none"
                    self.votes.not_coming(self.col * rows + s)
        else:
            raise AllReduceError(f"no owner could reduce sub-part {s} of part {self.col} ({'; '.join(errors)})")
        self._store(self.col, s, final, by)
        if s == self.row:
            self.report.reduce_s = time.perf_counter() - self._started

    def _col_reduction(self, s: int) -> ColReduction:
        """The reduction of sub-part s here: our own, or one we take over from a dead owner."""
        reduction = self.col_reductions.get(s)
        if reduction is None:
            lo, hi = self.grid.subs[self.col][s]
            expected = set(range(self.grid.rows)) - {s, self.row}
            reduction = ColReduction(self.weights, s, lo, hi, self.row, torch.empty(0), [0.0] * self.grid.rows,
                                     expected, self.codec, self.config.chunk_elements,
                                     aggregator=self.config.aggregator,
                                     watch=self.watch(lambda r: self.grid.owners[r][self.col]))  # fmt: skip
            self.col_reductions[s] = reduction
            self._tasks.append(asyncio.ensure_future(self._reduce_col(reduction, takeover=s != self.row)))
        return reduction

    async def _reduce_col(self, reduction: ColReduction, takeover: bool) -> None:
        try:
            if takeover:  # a copy of the dead owner's final that other members hold (checked: rounds/confirm.py)
                dead = self.grid.owners[reduction.part][self.col]
                others = [i for i, m in enumerate(self.group.members) if i not in (dead, self.me) and not m.client]
                if (copy := await vouched_copy(self, self.col * self.grid.rows + reduction.part, others)) is not None:
                    reduction.settle(copy)
                    return
            inc, _, average = await self._row_partial()
            part_lo = self.grid.parts[self.col][0]
            reduction.own_slice = average[reduction.lo - part_lo : reduction.hi - part_lo]
            reduction.set_row(self.row, inc)
            await reduction.reduce(self.config.part_timeout, self.config.min_group_size)
        except Exception as e:  # reduction.result carries it to everyone waiting for the sub-part
            _fail(reduction.result, e)
            logger.info("round %s: sub-part %d/%d cannot be reduced: %s", self._tag(), self.col, reduction.part, e)
        owners = {r: (self.grid.owners[r][self.col], f) for r, f in reduction.touched().items()}  # rows' partials
        self.note_fates(self.col * self.grid.rows + reduction.part, owners)

    async def _exchange_col(self, reducer: int, s: int) -> Final:
        inc, payload, _ = await self._row_partial()
        offsets = [0]
        for lo, hi in self.grid.subs[self.col]:
            offsets.append(offsets[-1] + self.reader.encoded_size(lo, hi))
        args = {"g": self.group.group_id, "i": self.me, "p": self.col, "s": s, "inc": inc}
        owner = self.group.members[self.grid.owners[reducer][self.col]]
        timeout = self.config.part_timeout
        async with await self.host.open_stream(owner.address(), COL, args, timeout=timeout) as stream:
            started = time.monotonic()
            await stream.write(payload[offsets[s] : offsets[s + 1]])
            self.report.bytes_sent += offsets[s + 1] - offsets[s]
            await stream.end()
            patience = 3 * timeout if reducer == s else backup_patience(3 * timeout, self.config.request_timeout)
            header, size = await read_header(stream, patience)
            self.note_upload(offsets[s + 1] - offsets[s], started, time.monotonic() - started, header)
            return await self.reader.sub(stream, self.col, s, header, size)

    # --- another column's part: through our row's owner of it, else another row's ---------------

    async def _via_row(self, c: int) -> None:
        owner = self.group.members[self.grid.owners[self.row][c]]
        timeout = self.config.part_timeout
        try:
            args = {"g": self.group.group_id, "i": self.me, "p": c}
            async with await self.host.open_stream(owner.address(), ROW, args, timeout=timeout) as stream:
                lo, hi = self.grid.parts[c]
                started = time.monotonic()
                sent = await write_encoded(stream, self.codec, self.vector, lo, hi, self.config.chunk_elements)
                self.report.bytes_sent += sent  # not `+= await ...`: that reads the total before the await
                await stream.end()
                finals = await self._read_part(stream, c, 4 * timeout, (sent, started, time.monotonic() - started))
            self._forwarded(c, self.row)
            await self._decode_part(c, finals, self.row)
            return
        except FAILURES as e:
            errors = [f"{self.row}: {e}"]
            logger.info("round %s: part %d via row %d failed: %s", self._tag(), c, self.row, e)
        for k in range(1, self.grid.rows):  # our slice is lost: fetch the part another row holds
            row = (self.row + k) % self.grid.rows
            try:
                finals = await self._ask_down(row, c, -1)
                self._forwarded(c, row)
                await self._decode_part(c, finals, row)
                return
            except FAILURES as e:
                errors.append(f"{row}: {e}")
        raise AllReduceError(f"no owner of column {c} gave its final part ({'; '.join(errors)})")

    async def fetch_result(self, member_index: int, key: int) -> Final:
        """The final of sub-part `key` (column x rows + row) that member `member_index` holds
        (avg.fetch; rounds/confirm.py takes the group's result so)."""
        c, s = divmod(key, self.grid.rows)
        member = self.group.members[member_index]
        args = {"g": self.group.group_id, "p": key}
        timeout = self.config.request_timeout
        async with await self.host.open_stream(member.address(), FETCH, args, timeout=timeout) as stream:
            await stream.end()
            header, size = await read_header(stream, timeout)
            return await self.reader.sub(stream, c, s, header, size)

    async def _ask_down(self, row: int, c: int, s: int) -> list[Final]:
        owner = self.group.members[self.grid.owners[row][c]]
        timeout = self.config.part_timeout
        args = {"g": self.group.group_id, "p": c, "s": s}
        async with await self.host.open_stream(owner.address(), DOWN, args, timeout=timeout) as stream:
            await stream.end()
            if s >= 0:
                header, size = await read_header(stream, timeout)
                return [await self.reader.sub(stream, c, s, header, size)]
            return await self._read_part(stream, c, 4 * timeout)

    async def _decode_part(self, c: int, finals: list[Final], row: int) -> None:
        """Part c as row `row`'s owner of it forwarded it (that owner is whom our votes name)."""
        for s, final in enumerate(finals):
            if final[1]:
                await asyncio.to_thread(self._decode, c, s, final[1])
        for s, final in enumerate(finals):
            if final[1]:
                self._store(c, s, final, self.grid.owners[row][c])

    # --- what peers send: read (GridReader), decoded into our result, noted ---------------------

    async def _read_part(
        self, stream: Stream, c: int, timeout: float, upload: tuple[int, float, float] | None = None
    ) -> list[Final]:
        header, size = await read_header(stream, timeout)
        if upload is not None:  # what we sent on this stream, as its owner timed it
            self.note_upload(*upload, header)
        return await self.reader.part(stream, c, header, size)

    def _decode(self, c: int, s: int, payload: memoryview) -> None:
        lo, hi = self.grid.subs[c][s]
        for a, b, where in payload_layout(lo, hi, self.config.chunk_elements, self.codec.encoded_nbytes):
            self.codec.decode(payload[where], b - a, out=self.result[a:b])

    def _store(self, c: int, s: int, final: Final, by: int) -> None:
        self.final[(c, s)] = final
        self.report.contributions[c * self.grid.rows + s] = final[0]
        self.votes.hold(c * self.grid.rows + s, final[1], by)
        if self.audit is not None:
            self.audit.part_in(c)

    def _forwarded(self, c: int, row: int) -> None:
        if self.audit is not None:
            self.audit.forwarder[c] = row

    async def serve_receipt(self, ctx: CallContext, args: dict[str, Any], stream: Stream) -> None:
        if self.audit is None:
            raise BadRequest("avg.receipt: this round is not audited")
        await self.audit.serve(ctx, args, stream)
