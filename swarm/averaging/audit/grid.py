"""GridAudit: the owner audit of a grid round (rounds/grid.py), audit/flat.py's checks for both stages.

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
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import blake3
import msgpack
import torch

from swarm.averaging.audit.arithmetic import (
    SENT_TOL,
    AuditFailure,
    Prepared,
    Receipt,
    audit_buckets,
    check_receipt,
    part_seed,
    quantization_tol,
    sketch_plan,
)
from swarm.averaging.audit.flat import (
    OURS,
    RECEIPT,
    WRONG_SEED,
    Verdict,
    holds,
    judge,
    receipt_limit,
    receipt_of,
    retrieved,
    succeeded,
    unpack_receipt,
    verdict_of,
)
from swarm.averaging.robust import robust_coefficients
from swarm.averaging.rounds.partition import payload_layout
from swarm.p2p.errors import BadRequest, NotFound, P2PError, RemoteError
from swarm.p2p.handlers import CallContext
from swarm.p2p.peer_id import PeerID
from swarm.p2p.stream import Stream
from swarm_kernels import as_memoryview
from swarm_kernels.sketch import SketchPlan, sketch_accumulate, sketch_payload_accumulate

if TYPE_CHECKING:
    from swarm.averaging.rounds.grid import GridRound

logger = logging.getLogger(__name__)

ROW_RECEIPT = -1  # "k" of a row receipt
RowEntry = tuple[list[int], torch.Tensor, float]  # a row partial in a column receipt: members, sketch, |.|^2
NOT_FINAL = "our results are not final"  # a slow owner, not a liar


@dataclass
class ColumnSide:
    """Our side of column c's checks: its seed and plan, the sketches (and squared norms) of
    each final sub-part, and of what we sent: our row partial's sub-parts (an owner of c) or
    our slice of part c (anyone else)."""

    seed: bytes
    plan: SketchPlan
    observed: dict[int, tuple[torch.Tensor, float]] = field(default_factory=dict)
    sent: dict[int, tuple[torch.Tensor, float]] = field(default_factory=dict)  # sub-part, or ROW_RECEIPT
    receipts: dict[int, Any] = field(default_factory=dict)  # k -> the raw receipt, once fetched


class GridAudit:
    """The audit of one GridRound (module docstring): `part_in` as each part c is final, `run`
    once the round's parts are in, `serve` answers avg.receipt while the round lingers."""

    def __init__(self, round_: GridRound) -> None:
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
        return [s for s, (lo, hi) in enumerate(self.round.grid.subs[c]) if hi > lo]

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
                problems, entry = self._check_sub(c, s, side)
            except AuditFailure as e:
                problems, entry = [str(e)], None
            if entry is not None:
                rows_seen[s] = entry
            verdicts.append(verdict_of(r, c, asks[s], problems, unit="column"))
        if ROW_RECEIPT in side.receipts:
            try:
                problems = self._check_row(c, side, rows_seen)
            except AuditFailure as e:
                problems = [str(e)]
            verdicts.append(verdict_of(r, c, asks[ROW_RECEIPT], problems, "row", "column"))
        return verdicts

    def _check_sub(self, c: int, s: int, side: ColumnSide) -> tuple[list[str], RowEntry | None]:
        """Column receipt (c, s); also returns the entry of the row we sit in, as the receipt
        states it (its members, sketch, squared norm), for our row receipt's check."""
        r, grid = self.round, self.round.grid
        msg = unpack_receipt(side.receipts[s])
        receipt = Receipt.decode(msg, grid.rows)
        listed = msg.get("rm")
        if not isinstance(listed, list) or len(listed) != len(receipt.included):
            raise AuditFailure("receipt: one member list per row")
        for row, members in zip(receipt.included, listed, strict=True):
            if not isinstance(members, list) or not set(members) <= set(grid.row_members[row]) or not all(
                isinstance(i, int) for i in members) or members != sorted(set(members)):  # fmt: skip
                raise AuditFailure(f"receipt: a bad member list for row {row}")
        weights = [0.0] * grid.rows
        for row, members in zip(receipt.included, listed, strict=True):
            weights[row] = sum(r.weights[i] for i in members)
        final_members = set(r.final[(c, s)][0])
        rows = dict(zip(receipt.included, listed, strict=True))
        kept = [row for row, members in rows.items() if members and set(members) <= final_members]
        problems = []
        if {i for row in kept for i in rows[row]} != final_members:
            problems.append("the result's members are not those of the rows the receipt keeps")
        lo, hi = grid.subs[c][s]
        observed, result_sq = side.observed[s]
        # an owner of c whose partial went out (side.sent) checks the receipt's entry of its row
        owner_here = c == r.col and r.row in receipt.included and s in side.sent
        own, own_sq = side.sent.get(s, (torch.zeros_like(observed), 0.0))
        problems += check_receipt(
            receipt, weights=weights, result=r.result[lo:hi], seed=side.seed, part=c,
            me=r.row if owner_here else None, mine=r.result[lo:hi] if owner_here else None, included=kept,
            prepared=Prepared(observed, own, own_sq, result_sq, own_sent=True),
            tolerance=quantization_tol(r.config.codec), buckets=side.plan.buckets,
        )  # fmt: skip
        sent_members = sorted(r.row_reduction.result.result()[0]) if owner_here and r.row_reduction else None
        if sent_members is not None and listed[receipt.included.index(r.row)] != sent_members:
            problems.append(f"{OURS} row's members")
        entry = None
        if r.row in receipt.included:
            k = receipt.included.index(r.row)
            entry = (listed[k], receipt.sketches[k].double(), receipt.gram[k][k])
        return problems, entry

    def _check_row(self, c: int, side: ColumnSide, rows_seen: dict[int, RowEntry]) -> list[str]:
        """The row receipt of our row's owner of column c: what it says of our slice; that the
        partial it says it sent ("ps", "pn") is the reduction it describes; and that the owners
        of column c say they got that partial. One owner that disagrees cannot say who lies (it,
        or our row's owner): logged. Two or more: our row's owner sent other bytes than it says."""
        r, grid = self.round, self.round.grid
        msg = unpack_receipt(side.receipts[ROW_RECEIPT])
        receipt = Receipt.decode(msg, len(r.group.members))
        if not set(receipt.included) <= set(grid.row_members[r.row]):
            raise AuditFailure("receipt: members of another row")
        width = side.plan.buckets
        raw, norms = msg.get("ps"), msg.get("pn")
        if not isinstance(raw, bytes) or len(raw) != grid.rows * width * 4:
            raise AuditFailure("receipt: the partial's sketches must be rows x buckets float32")
        if not isinstance(norms, list) or len(norms) != grid.rows or not all(isinstance(v, float | int) for v in norms):
            raise AuditFailure("receipt: one squared norm per sub-part")
        sent = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(grid.rows, width).double()
        # NaN compares false with every bound: a partial stated as NaN would pass every check below
        if not torch.isfinite(sent).all() or not all(math.isfinite(v) and v >= 0 for v in norms):
            raise AuditFailure("receipt: the partial's sketches and norms must be finite")
        live = self._live(c)
        own, own_sq = side.sent[ROW_RECEIPT]
        lo, hi = grid.parts[c]
        problems = check_receipt(
            receipt, weights=r.weights, result=r.result[lo:hi], seed=side.seed, part=c, me=r.me, mine=r.result[lo:hi],
            prepared=Prepared(sent[live].sum(0), own, own_sq, float(sum(norms[s] for s in live)), own_sent=True),
            tolerance=quantization_tol(r.config.codec), buckets=width,
        )  # fmt: skip
        kept = sorted(i for i, fate in zip(receipt.included, robust_fates(receipt, r.weights), strict=True) if fate)
        disagree = []
        for s, (members, sketch, sq) in sorted(rows_seen.items()):
            scale = max(float(sketch.norm()), float(sent[s].norm()))
            if members != kept or abs(sq - norms[s]) > 2 * SENT_TOL * max(sq, norms[s]) + 1e-30 or float(
                (sketch - sent[s]).norm()) > SENT_TOL * scale + 1e-30:  # fmt: skip
                disagree.append(grid.owners[s][c])
        if len(disagree) >= 2:
            problems.append(f"its partial is not what it says it sent: owners {disagree} of column {c} got another")
        elif disagree:
            owners = (r.group.members[grid.owners[r.row][c]].peer_id, r.group.members[disagree[0]].peer_id)
            logger.warning("round %s: audit: %s and %s disagree on the row partial of column %d: one of them lies",
                           r._tag(), *owners, c)  # fmt: skip
        return problems

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


def robust_fates(receipt: Receipt, weights: list[float]) -> list[bool]:
    """Which of a receipt's contributions its rule keeps."""
    _, fates = robust_coefficients(receipt.gram, [weights[i] for i in receipt.included])
    return [fate.dropped is None for fate in fates]


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
