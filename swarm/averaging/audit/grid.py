"""GridAudit: the owner audit of a grid round (rounds/grid.py), audit/flat.py's checks for both stages.
This module prepares our side, fetches the others' receipts and serves ours; the checks of the
receipts are grid_checks.py's.

A grid round has two kinds of owners a member must not have to trust: the owner (r, c) that
reduces its row's slices of part c into a row partial (stage 1), and the owner (s, c) that
reduces the rows' partials of sub-part s into the final sub-part everyone takes (stage 2).

One seed per column, unknown to every owner of the column before it committed: the BLAKE3
digest of the whole final part c (its sub-parts in row order), which every owner of column c
holds (it forwards it to its row) and every member receives. Everything of column c is sketched
with that seed's plan over part c's index space (a sub-part at its offset), so the sketches of
the stages add up.

Receipts (`avg.receipt`, args {"g", "c": column, "k": sub-part row, or -1 for the row receipt,
"s": seed}), built in a worker thread once part c is final and served by owners of column c only
after checking the asker's seed against their own bytes:
- column receipt (c, s), by (s, c): the rows its rule ran on, their Gram matrix over sub-part s,
  the sketch of each row partial's sub-part s, and each row's member list ("rm");
- row receipt (c, -1), by (r, c): the members of row r its rule ran on, their Gram matrix over
  part c and the sketch of each one's slice.

Checks (worker threads), by every member:
- every column receipt of every sub-part it did not reduce: the final sub-part is the robust
  reduction the receipt describes, with row weights from the members each row partial includes,
  and the kept rows' members are those of the final's header (audit.check_receipt). Every member
  holding the same bytes sees the same receipt: the round fails (AuditError) and the owner is
  excluded. A row owner also checks its own row's entry against the partial it sent (to
  audit.SENT_TOL), and the members listed for it: a misstatement excludes the owner;
- the row receipt of its own row's owner of each other column (when that owner's part was used):
  its own slice against the payload it sent, and the row partial (the sum of its sketches in the
  column receipts, its norm the sum of their Gram entries) against the reduction the row receipt
  describes. Only the row's members can see these: the owner is excluded, the round NOT failed
  (failing alone forks the row from the others; the column stage's robust rule bounds a bad
  partial meanwhile).
- a seed mismatch (an owner of column c holds other bytes of part c than we do): somebody
  equivocated, but the seed covers the whole part and so cannot say who: the round fails here,
  nobody is excluded.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Protocol

import blake3
import msgpack
import torch

from swarm.averaging.audit.arithmetic import (
    AuditFailure,
    audit_buckets,
    part_seed,
    sketch_plan,
)
from swarm.averaging.audit.flat import (
    WRONG_SEED,
    holds,
    receipt_limit,
    receipt_of,
    retrieved,
    succeeded,
)
from swarm.averaging.audit.grid_checks import (
    ROW_RECEIPT,
    CheckedGrid,
    ColumnSide,
    RowEntry,
    check_column_receipt,
    check_row_receipt,
    live_subparts,
)
from swarm.averaging.audit.verdicts import NOT_FINAL, Verdict, judge, verdict_of
from swarm.averaging.rounds.partition import payload_layout
from swarm.averaging.rounds.registry import RECEIPT
from swarm.p2p.errors import BadRequest, NotFound, P2PError, RemoteError
from swarm.p2p.handlers import CallContext
from swarm.p2p.peer_id import PeerID
from swarm.p2p.stream import Stream
from swarm_kernels import as_memoryview
from swarm_kernels.sketch import SketchPlan, sketch_accumulate, sketch_payload_accumulate

if TYPE_CHECKING:
    from swarm.averaging.rounds.grid_reduction import ColReduction
    from swarm.averaging.rounds.member import RoundReport
    from swarm.p2p.host import P2PHost
    from swarm_kernels import Codec

logger = logging.getLogger(__name__)


class AuditedGrid(CheckedGrid, Protocol):
    """What GridAudit reads of its round (rounds/grid.py's GridRound) beyond what the checks
    read: the codec and our vector (our sketches), the sub-parts we reduced (our receipts), and
    the host and report (fetching the others' receipts)."""

    codec: Codec
    vector: torch.Tensor
    col_reductions: dict[int, ColReduction]
    host: P2PHost
    report: RoundReport


class GridAudit:
    """The audit of one GridRound (module docstring): `part_in` as each part c is final, `run`
    once the round's parts are in, `serve` answers avg.receipt while the round lingers."""

    def __init__(self, round_: AuditedGrid) -> None:
        self.round = round_
        self.seeds: dict[int, asyncio.Future[bytes]] = {}  # column -> its seed, from our bytes
        self.receipts: dict[tuple[int, int], asyncio.Future[bytes]] = {}  # (column, k) -> ours, encoded
        self.sides: dict[int, asyncio.Future[ColumnSide | None]] = {}
        self.forwarder: dict[int, int] = {}  # column -> the row whose owner gave us that part

    def part_in(self, c: int) -> None:
        """A sub-part of column c is final: once all are, prepare the column (seed, our receipts,
        our sketches) while the other parts still move."""
        live = self._live(c)
        if c not in self.sides and live and all((c, s) in self.round.final for s in live):
            self.sides[c] = asyncio.ensure_future(self._prepare(c))

    def _seed(self, c: int) -> asyncio.Future[bytes]:
        if c not in self.seeds:
            self.seeds[c] = asyncio.get_running_loop().create_future()
        return self.seeds[c]

    def _live(self, c: int) -> list[int]:
        return live_subparts(self.round.grid, c)

    async def _prepare(self, c: int) -> ColumnSide | None:
        r = self.round
        try:
            payloads = [r.final[(c, s)][1] for s in self._live(c)]
            seed = part_seed(r.group.group_id, c, await asyncio.to_thread(_digest, payloads))
            lo, hi = r.grid.parts[c]
            plan = sketch_plan(seed, c, hi - lo, audit_buckets(hi - lo, len(r.group.members)))
            side = ColumnSide(seed, plan)
            if c == r.col:  # our row partial as the column's owners got it: in our receipt, and what we check
                partial = r.row_reduction.result if r.row_reduction is not None else None
                if partial is not None and succeeded(partial):
                    side.sent = await asyncio.to_thread(self._partial_sketches, c, plan)
                self._build_receipts(c, side)
            self._seed(c).set_result(seed)
            await asyncio.to_thread(self._sketch_side, c, side)
            return side
        except Exception as e:  # the round was released under us (it failed): nothing to audit
            logger.info("round %s: audit: column %d not prepared: %r", r._tag(), c, e)
            return None

    def _build_receipts(self, c: int, side: ColumnSide) -> None:
        """Our receipts of column c (we own (row, c)): the sub-part we reduced, our row partial."""
        r, plan = self.round, side.plan
        part_lo = r.grid.parts[c][0]
        ours = r.col_reductions.get(r.row)
        final = r.final.get((c, r.row))
        if ours is not None and ours.order and final is not None and holds(ours.result, final[1]):
            offset = ours.lo - part_lo
            self._build((c, r.row), lambda: {**receipt_of(ours, plan, offset).encode(),
                                              "rm": [ours.row_members.get(i, []) for i in ours.order]})  # fmt: skip
        row = r.row_reduction
        if row is not None and row.order and side.sent:
            zero = torch.zeros(plan.buckets, dtype=torch.float64)
            sent = [side.sent.get(s, (zero, 0.0)) for s in range(r.grid.rows)]
            as_sent = {"ps": torch.stack([t for t, _ in sent]).float().numpy().tobytes(), "pn": [n for _, n in sent]}
            self._build((c, ROW_RECEIPT), lambda: {**receipt_of(row, plan).encode(), **as_sent})

    def _partial_sketches(self, c: int, plan: SketchPlan) -> dict[int, tuple[torch.Tensor, float]]:
        """Our row partial as each owner of column c got it (worker thread): the sketch and squared
        norm of each sub-part, of the encoded bytes we sent it (our own sub-part exact: our own
        column reduction used it so)."""
        r = self.round
        assert r.row_reduction is not None
        part_lo = r.grid.parts[c][0]
        out: dict[int, tuple[torch.Tensor, float]] = {}
        payload, offset = r.row_reduction.result.result()[1], 0
        for s, (lo, hi) in enumerate(r.grid.subs[c]):
            layout = payload_layout(lo, hi, r.config.chunk_elements, r.codec.encoded_nbytes)
            size = layout[-1][2].stop if layout else 0
            if s == r.row:
                sketch = torch.zeros(plan.buckets, dtype=torch.float64)
                own = r.row_reduction.average[lo - part_lo : hi - part_lo]
                out[s] = sketch, sketch_accumulate(sketch, own, lo - part_lo, plan)
            elif hi > lo:
                out[s] = _sketch(plan, r.codec, payload[offset : offset + size], layout, part_lo)
            offset += size
        return out

    def _build(self, key: tuple[int, int], make: Any) -> None:
        task = self.receipts[key] = asyncio.ensure_future(asyncio.to_thread(lambda: msgpack.packb(make())))
        task.add_done_callback(retrieved)

    def _sketch_side(self, c: int, side: ColumnSide) -> None:
        """Our sketches of column c (worker thread): each final sub-part, and (not an owner of c)
        our slice of it as we sent it; an owner's row partial is sketched in _prepare."""
        r, plan = self.round, side.plan
        part_lo, part_hi = r.grid.parts[c]
        chunk, nbytes = r.config.chunk_elements, r.codec.encoded_nbytes
        for s in self._live(c):
            lo, hi = r.grid.subs[c][s]
            layout = payload_layout(lo, hi, chunk, nbytes)
            side.observed[s] = _sketch(plan, r.codec, r.final[(c, s)][1], layout, part_lo)
        if c != r.col and self.forwarder.get(c) == r.row:  # our slice of part c, encoded again as write_encoded did
            layout = payload_layout(0, part_hi - part_lo, chunk, nbytes)
            mine = r.vector[part_lo:part_hi]
            encoded = torch.cat([torch.as_tensor(r.codec.encode(mine[a:b])).view(-1) for a, b, _ in layout])
            side.sent[ROW_RECEIPT] = _sketch(plan, r.codec, as_memoryview(encoded), layout, 0)

    # --- checking the others -----------------------------------------------------------------

    async def run(self) -> list[PeerID]:
        """Audit every column; AuditError on a column receipt that does not hold or a seed
        mismatch. Returns the owners excluded for what only we could see."""
        r = self.round
        for c in range(r.grid.cols):
            self.part_in(c)
        verdicts = await asyncio.gather(*(self._audit_column(c) for c in sorted(self.sides)))
        built = await asyncio.gather(*self.receipts.values(), return_exceptions=True)
        for key, outcome in zip(self.receipts, built, strict=True):
            if isinstance(outcome, BaseException):
                logger.warning("round %s: audit: our receipt %s failed: %r", r._tag(), key, outcome)
        return self._judge([v for column in verdicts for v in column])

    async def _audit_column(self, c: int) -> list[Verdict]:
        r = self.round
        side = await self.sides[c]
        if side is None:
            return []
        asks = {s: r.grid.owners[s][c] for s in self._live(c) if not (c == r.col and s == r.row)}
        if c != r.col and self.forwarder.get(c) == r.row:
            asks[ROW_RECEIPT] = r.grid.owners[r.row][c]
        answers = await asyncio.gather(*(self._fetch(c, k, owner, side.seed) for k, owner in asks.items()))
        verdicts = [v for v in answers if isinstance(v, Verdict)]
        for k, answer in zip(asks, answers, strict=True):
            if isinstance(answer, bytes):
                side.receipts[k] = answer
        checked = await asyncio.to_thread(self._check_column, c, side, asks)
        return verdicts + checked

    async def _fetch(self, c: int, k: int, owner: int, seed: bytes) -> bytes | Verdict:
        r = self.round
        member, timeout = r.group.members[owner], r.config.request_timeout
        limit = receipt_limit(len(r.group.members)) + 64 * len(r.group.members)
        try:
            args = {"g": r.group.group_id, "c": c, "k": k, "s": seed}
            async with await r.host.open_stream(member.address(), RECEIPT, args, timeout=timeout) as stream:
                await stream.end()
                raw = await asyncio.wait_for(stream.read_all(max_bytes=limit, timeout=timeout), timeout)
        except RemoteError as e:
            if e.code == BadRequest.code and WRONG_SEED in e.message:
                return Verdict(c, owner, "seed", e.message)
            if e.code == NotFound.code and NOT_FINAL not in e.message and (k != ROW_RECEIPT or self._row_used(c)):
                # an owner of column c that holds our bytes reduced its own sub-part (and its
                # row partial, when the finals include its row) itself: it has the receipt
                kind = "inconsistent" if k != ROW_RECEIPT else "row"
                return Verdict(c, owner, kind, f"no receipt ({e.message})")
            return Verdict(c, owner, "silent", str(e))
        except (P2PError, TimeoutError, OSError) as e:
            if "more than" in str(e):
                return Verdict(c, owner, "inconsistent", f"a receipt beyond {limit} bytes")
            return Verdict(c, owner, "silent", f"{type(e).__name__}: {e}")
        r.report.bytes_received += len(raw)
        return bytes(raw)

    def _row_used(self, c: int) -> bool:
        r = self.round
        return any(r.me in r.final[(c, s)][0] for s in self._live(c))

    def _check_column(self, c: int, side: ColumnSide, asks: dict[int, int]) -> list[Verdict]:
        """Column c's checks (worker thread), on the receipts that came."""
        r, verdicts = self.round, []
        rows_seen: dict[int, RowEntry] = {}  # sub-part -> our row's entry
        for s in self._live(c):
            if s not in side.receipts:
                continue
            try:
                problems, entry = check_column_receipt(r, c, s, side)
            except AuditFailure as e:
                problems, entry = [str(e)], None
            if entry is not None:
                rows_seen[s] = entry
            verdicts.append(verdict_of(r, c, asks[s], problems, unit="column"))
        if ROW_RECEIPT in side.receipts:
            try:
                problems = check_row_receipt(r, c, side, rows_seen)
            except AuditFailure as e:
                problems = [str(e)]
            verdicts.append(verdict_of(r, c, asks[ROW_RECEIPT], problems, "row", "column"))
        return verdicts

    def _judge(self, verdicts: list[Verdict]) -> list[PeerID]:
        return judge(self.round, verdicts, "column")

    # --- serving ours --------------------------------------------------------------------------

    async def serve(self, ctx: CallContext, args: dict[str, Any], stream: Stream) -> None:
        r = self.round
        c, k, seed = args.get("c"), args.get("k"), args.get("s")
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (c, k)) or c != r.col:
            raise BadRequest("avg.receipt: we own no part of that column")
        if not (k == ROW_RECEIPT or 0 <= k < r.grid.rows):
            raise BadRequest("avg.receipt: no such sub-part")
        if not isinstance(seed, bytes) or len(seed) != 32:
            raise BadRequest("avg.receipt: the seed is 32 bytes")
        try:  # our part first: the caller may be a moment ahead of us
            ours = await asyncio.wait_for(asyncio.shield(self._seed(c)), r.config.part_timeout)
        except asyncio.TimeoutError:
            raise NotFound(f"avg.receipt: {NOT_FINAL}") from None
        if seed != ours:
            logger.info("round %s: %s asked for a receipt of column %d with another seed", r._tag(), ctx.peer_id, c)
            raise BadRequest(f"avg.receipt: {WRONG_SEED}: we hold other results")
        receipt = self.receipts.get((c, k))
        if receipt is None:
            raise NotFound(f"avg.receipt: no receipt {k} of column {c} here")
        data = await asyncio.shield(receipt)
        await stream.write(data)
        r.report.bytes_sent += len(data)


def _digest(payloads: list[memoryview]) -> bytes:
    hasher = blake3.blake3()
    for payload in payloads:
        hasher.update(payload)
    return hasher.digest()


def _sketch(
    plan: SketchPlan, codec: Any, payload: memoryview, layout: list[tuple[int, int, slice]], part_lo: int
) -> tuple[torch.Tensor, float]:
    """The sketch (float64) and squared norm of an encoded piece whose chunks `layout` places in
    the vector (minus `part_lo`: the plan's index space is the part's)."""
    out = torch.zeros(plan.buckets, dtype=torch.float64)
    total = 0.0
    for a, b, where in layout:
        total += sketch_payload_accumulate(out, codec, payload[where], b - a, a - part_lo, plan)
    return out, total
