"""The owner audit of a flat round (audit/arithmetic.py's arithmetic, on the wire): every member checks
every other part's owner once the round's results are in.

    avg.receipt  {"g": group_id, "p": part, "s": audit seed (32 bytes)}
                 -> the owner's receipt, msgpack (audit.Receipt.encode), then end
                 errors: BadRequest "wrong seed" (the caller holds other bytes of the part than
                 the owner), BadRequest "superseded" (the caller holds the owner's own result of
                 its part, which the group did not take: rounds/confirm.py), NotFound (no
                 receipt of that part here), BadRequest (bad arguments)

1. Seed. As soon as a member holds part j's result it computes the part's seed from the group id,
   j and the BLAKE3 digest of the result bytes (audit.part_seed): the same on every member holding the
   same bytes, unknown to the owner before it committed to them.
2. Receipts and sketches, while the other parts are still on the wire. For each part it reduced
   itself (robust aggregator), a member re-decodes the contributions the rule ran on, chunk by
   chunk (its own slice exact), sketches them with the part's seed and keeps the receipt (a few
   KB to a few hundred KB) for as long as the round lingers; it answers `avg.receipt` only once
   its own result of the part is final, and only for that part's seed. For each other part it
   sketches the result and its own slice as it sent it, encoded (prepare_part).
3. Checks. Every member (client members too) fetches the receipt of every part it did not reduce
   from the member that sent it that part's result, as soon as it holds that result (the owner
   answers once its own result is final, which it is: it sent it), and checks it in a worker
   thread (audit.check_receipt) with its own sent slice and the decoded result; the round ends
   once every part's verdict is in. Verdicts:
   - consistency (Gram vs sketches, result vs the described reduction, a member list other than
     the result's, a malformed receipt, an original owner without a receipt for its own part):
     every member with the same receipt sees it: the round fails (AuditError, naming the owner)
     and the owner is excluded;
   - our contribution misstated (only this member can see it): logged, the owner excluded
     (`RoundReport.audit_excluded`), the round NOT failed: failing alone would fork this member
     from the others, and the robust rule bounds what a misstated input can do;
   - a seed mismatch: we hold other bytes of the part than the member we took them from. From
     the part's original owner: it equivocated (sent members different bytes): the round fails
     and it is excluded. From a backup (which may hold a copy of a slow owner's bytes): the
     round fails, nobody is excluded;
   - "superseded" from a part's original owner: it answered us before we gave up on it, but
     was late for the others, who took the part from its backup. When more than half of the
     other members (the owner left out) hold another result of the part, we take that one
     (rounds/confirm.py's vote) and the verdict is ok; otherwise the owner's claim is false:
     as inconsistent;
   - no answer in time (request_timeout), or a backup holding only a copy: logged at INFO,
     nothing else (the owner may have crashed; its part was already averaged).

Not audited: grid (hierarchical) rounds, and rounds with the "mean" aggregator. Known gap: an
owner that lies and then never answers `avg.receipt` is indistinguishable from one that crashed
after broadcasting, and is not caught.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgpack
import torch

from swarm.averaging.audit.arithmetic import (
    BUCKETS,
    AuditFailure,
    Prepared,
    Receipt,
    audit_buckets,
    check_receipt,
    part_seed,
    quantization_tol,
    result_digest,
    sketch_plan,
)
from swarm.averaging.audit.verdicts import NOT_FINAL, JudgedRound, Verdict, judge, verdict_of
from swarm.averaging.rounds.partition import payload_layout
from swarm.averaging.rounds.reduction import PartReduction
from swarm.averaging.rounds.registry import RECEIPT
from swarm.p2p.errors import BadRequest, NotFound, P2PError, RemoteError
from swarm.p2p.handlers import CallContext
from swarm.p2p.peer_id import PeerID
from swarm.p2p.stream import Stream
from swarm_kernels import as_memoryview
from swarm_kernels.sketch import SketchPlan, sketch_accumulate, sketch_payload_accumulate

if TYPE_CHECKING:
    from swarm.averaging.config import AveragingConfig
    from swarm.averaging.rounds.member import RoundReport
    from swarm.averaging.rounds.streams import Final
    from swarm.p2p.host import P2PHost
    from swarm_kernels import Codec

logger = logging.getLogger(__name__)

WRONG_SEED = "wrong seed"
SUPERSEDED = "superseded"  # an owner's answer for the result of its own part the group did not take


class AuditedRound(JudgedRound, Protocol):
    """What RoundAudit reads of its round (rounds/flat.py's AllReduceRound): the group and our
    place in it, our vector and the result, the parts and their results, and the way to the
    other members."""

    me: int
    config: AveragingConfig
    host: P2PHost
    codec: Codec
    vector: torch.Tensor
    result: torch.Tensor
    weights: list[float]
    parts: list[tuple[int, int]]
    final: dict[int, Final]
    reductions: dict[int, PartReduction]
    report: RoundReport

    async def take_group_result(self, j: int) -> Final | None: ...


def receipt_limit(members: int, buckets: int = BUCKETS) -> int:
    """The largest encoded receipt of a group of `members`: ids, Gram matrix, sketches, slack."""
    return members * 9 + members * members * 9 + members * buckets * 4 + 256


def build_receipt(reduction: PartReduction, seed: bytes) -> bytes:
    """The encoded receipt of a part this member reduced (worker thread): the contributions the
    rule ran on, sketched wire chunk by wire chunk straight from their payloads (our own slice
    exact)."""
    numel = reduction.hi - reduction.lo
    plan = sketch_plan(seed, reduction.part, numel, audit_buckets(numel, len(reduction.weights)))
    return msgpack.packb(receipt_of(reduction, plan).encode())


def receipt_of(reduction: PartReduction, plan: SketchPlan, offset: int = 0) -> Receipt:
    """The receipt of a reduction whose part starts at `offset` of the index space `plan`
    sketches (worker thread)."""
    sketches = torch.zeros(len(reduction.order), plan.buckets, dtype=torch.float64)
    for i, out in zip(reduction.order, sketches, strict=True):
        if i == reduction.own_index:
            sketch_accumulate(out, reduction.own_slice, offset, plan)
            continue
        payload = reduction.senders[i].buffer
        for a, b, where in reduction.layout:
            sketch_payload_accumulate(out, reduction.codec, payload[where], b - a, offset + a, plan)
    return Receipt(reduction.order, reduction.gram, plan.buckets, sketches.float())


def prepare_part(
    codec: Any, payload: memoryview, layout: list[tuple[int, int, slice]], mine: torch.Tensor,
    seed: bytes, part: int, buckets: int,
) -> Prepared:  # fmt: skip
    """Our side of part `part`'s check (worker thread): the sketch and squared norm of its
    result, straight from the result's payload, and of our own slice as we sent it (encoded
    again chunk by chunk, as write_encoded did: the codecs are deterministic), so that what the
    receipt says of our input is checked to SENT_TOL whatever the codec's rounding."""
    plan = sketch_plan(seed, part, mine.numel(), buckets)
    observed = torch.zeros(plan.buckets, dtype=torch.float64)
    own = torch.zeros(plan.buckets, dtype=torch.float64)
    result_sq = own_sq = 0.0
    for a, b, where in layout:
        result_sq += sketch_payload_accumulate(observed, codec, payload[where], b - a, a, plan)
        own_sq += sketch_payload_accumulate(own, codec, as_memoryview(codec.encode(mine[a:b])), b - a, a, plan)
    return Prepared(observed, own, own_sq, result_sq, own_sent=True)


def check(
    raw: bytes, *, members: int, weights: list[float], included: list[int], result: torch.Tensor,
    seed: bytes, part: int, me: int, mine: torch.Tensor, prepared: Prepared, tolerance: float,
) -> list[str]:  # fmt: skip
    """What is wrong with a fetched receipt (worker thread); AuditFailure when it is malformed."""
    receipt = Receipt.decode(unpack_receipt(raw), members)
    return check_receipt(receipt, weights=weights, result=result, seed=seed, part=part, me=me, mine=mine,
                         included=included, members=members, prepared=prepared, tolerance=tolerance)  # fmt: skip


class RoundAudit:
    """The audit of one AllReduceRound: `result_in` as each part's result becomes final (the
    part's seed, our receipt or our sketches of it are computed at once, while the other parts
    are still on the wire), `run` once every part is final; `serve` answers `avg.receipt` for as
    long as the round lingers."""

    def __init__(self, round_: AuditedRound) -> None:
        self.round = round_
        self.seeds: dict[int, asyncio.Future[bytes]] = {}  # part -> its audit seed (part_seed)
        self.receipts: dict[int, asyncio.Future[bytes]] = {}  # part -> our encoded receipt
        self.prepared: dict[int, asyncio.Future[tuple[bytes, Prepared | None] | None]] = {}
        self.verdicts: dict[int, asyncio.Future[Verdict]] = {}  # part -> its check, under way
        # our own part -> the seed of our own result of it, which the group did not take (we were
        # late: rounds/confirm.py); a member we answered before it gave up on us asks with it
        self.superseded: dict[int, asyncio.Future[bytes]] = {}

    def result_in(self, part: int, payload: memoryview, reducer: int) -> None:
        """Part `part`'s result is final (decoded into the round's result) and came from
        `reducer`: hash it, then build our receipt (we reduced it) or our sketches, and check
        `reducer`'s receipt at once (we audit it), while the other parts are still on the wire."""
        if part not in self.prepared:
            self.prepared[part] = asyncio.ensure_future(self._prepare(part, payload, reducer))
            if reducer != self.round.me:
                verdict = self.verdicts[part] = asyncio.ensure_future(self._audit(part, reducer))
                verdict.add_done_callback(checked)  # a failed round awaits no verdict

    def supersede(self, part: int, payload: memoryview) -> None:
        """Our own result of our part (`payload`) is not the group's: a member that took it from
        us is told so, not that we equivocated (`serve`)."""
        group_id = self.round.group.group_id

        async def seed() -> bytes:
            return part_seed(group_id, part, await asyncio.to_thread(result_digest, payload))

        self.superseded[part] = asyncio.ensure_future(seed())

    def cancel(self) -> None:
        """The round failed: stop the checks still under way (nobody awaits their verdicts)."""
        for verdict in self.verdicts.values():
            verdict.cancel()

    def _seed(self, part: int) -> asyncio.Future[bytes]:
        if part not in self.seeds:
            self.seeds[part] = asyncio.get_running_loop().create_future()
        return self.seeds[part]

    async def _prepare(self, j: int, payload: memoryview, reducer: int) -> tuple[bytes, Prepared | None] | None:
        r = self.round
        try:
            seed = part_seed(r.group.group_id, j, await asyncio.to_thread(result_digest, payload))
            reduction = r.reductions.get(j)
            if reducer == r.me:
                if reduction is not None and reduction.order and holds(reduction.result, payload):
                    built = self.receipts[j] = asyncio.ensure_future(asyncio.to_thread(build_receipt, reduction, seed))
                    built.add_done_callback(retrieved)  # a failed round awaits no receipt
                self._seed(j).set_result(seed)
                return seed, None
            self._seed(j).set_result(seed)
            lo, hi = r.parts[j]
            buckets = audit_buckets(hi - lo, len(r.group.members))
            layout = payload_layout(0, hi - lo, r.config.chunk_elements, r.codec.encoded_nbytes)
            mine = r.vector[lo:hi]
            prepared = await asyncio.to_thread(prepare_part, r.codec, payload, layout, mine, seed, j, buckets)
            return seed, prepared
        except Exception as e:  # the round was released under us (it failed): nothing to audit
            logger.info("round %s: audit: part %d not prepared: %r", r._tag(), j, e)
            return None

    async def run(self, reducer_of: dict[int, int]) -> list[PeerID]:
        """Audit every part we did not reduce; AuditError on a consistency failure or a seed
        mismatch. Returns the owners that misstated our own contribution."""
        r = self.round
        for j in r.final:  # a result that did not come through result_in
            self.result_in(j, r.final[j][1], reducer_of[j])
        verdicts = await asyncio.gather(*(self.verdicts[j] for j in sorted(self.verdicts)))
        # our receipts are built before the buffers go; one that failed is served as an error
        await asyncio.gather(*self.prepared.values())
        built = await asyncio.gather(*self.receipts.values(), return_exceptions=True)
        for j, outcome in zip(self.receipts, built, strict=True):
            if isinstance(outcome, BaseException):
                logger.warning("round %s: audit: our receipt of part %d failed: %r", r._tag(), j, outcome)
        return self._judge(verdicts)

    def _judge(self, verdicts: list[Verdict]) -> list[PeerID]:
        return judge(self.round, verdicts, "part")

    async def _audit(self, j: int, k: int) -> Verdict:
        r = self.round
        ready = await self.prepared[j]
        if ready is None or ready[1] is None:
            return Verdict(j, k, "silent", "our side of the check could not be prepared")
        seed, prepared = ready
        member = r.group.members[k]
        timeout = r.config.request_timeout
        limit = receipt_limit(len(r.group.members))
        try:
            async with await r.host.open_stream(member.address(), RECEIPT, {"g": r.group.group_id, "p": j, "s": seed},
                                                timeout=timeout) as stream:  # fmt: skip
                await stream.end()
                raw = await asyncio.wait_for(stream.read_all(max_bytes=limit, timeout=timeout), timeout)
        except RemoteError as e:
            if e.code == BadRequest.code and SUPERSEDED in e.message and k == j:
                return await self._superseded(j, k, e.message)
            if e.code == BadRequest.code and WRONG_SEED in e.message:
                # the original owner sent us other bytes than it holds: it equivocated
                return Verdict(j, k, "inconsistent" if k == j else "seed", e.message)
            if e.code == NotFound.code and k == j and NOT_FINAL not in e.message:
                # an original owner always reduces its own part: it has the receipt
                return Verdict(j, k, "inconsistent", f"no receipt for its own part ({e.message})")
            return Verdict(j, k, "silent", str(e))
        except (P2PError, TimeoutError, OSError) as e:
            if "more than" in str(e):
                return Verdict(j, k, "inconsistent", f"a receipt beyond {limit} bytes")
            return Verdict(j, k, "silent", f"{type(e).__name__}: {e}")
        r.report.bytes_received += len(raw)
        lo, hi = r.parts[j]
        try:
            problems = await asyncio.to_thread(
                check, bytes(raw), members=len(r.group.members), weights=r.weights, included=r.final[j][0],
                result=r.result[lo:hi], seed=seed, part=j, me=r.me, mine=r.vector[lo:hi], prepared=prepared,
                tolerance=quantization_tol(r.config.codec),
            )  # fmt: skip
        except AuditFailure as e:
            return Verdict(j, k, "inconsistent", str(e))
        return verdict_of(r, j, k, problems)

    async def _superseded(self, j: int, k: int, said: str) -> Verdict:
        """Owner k of part j says the group took the part from a backup: true (more than half of
        the other members hold another result, rounds/confirm.py), we take the group's result
        instead; false, the owner lied about what it sent us."""
        r = self.round
        found = await r.take_group_result(j)
        if found is None:
            return Verdict(j, k, "inconsistent", f"{said}, but the group holds what it sent us")
        return Verdict(j, k, "ok", said)

    async def serve(self, ctx: CallContext, args: dict[str, Any], stream: Stream) -> None:
        r = self.round
        part, seed = args.get("p"), args.get("s")
        if isinstance(part, bool) or not isinstance(part, int) or not 0 <= part < len(r.group.members):
            raise BadRequest("avg.receipt: no such part")
        if not isinstance(seed, bytes) or len(seed) != 32:
            raise BadRequest("avg.receipt: the seed is 32 bytes")
        try:  # our result of the part first: the caller may be a moment ahead of us
            ours = await asyncio.wait_for(asyncio.shield(self._seed(part)), r.config.part_timeout)
        except asyncio.TimeoutError:
            raise NotFound(f"avg.receipt: {NOT_FINAL}") from None
        if part in self.superseded and seed == await asyncio.shield(self.superseded[part]):
            raise BadRequest(f"avg.receipt: {SUPERSEDED}: the group took part {part} from a backup")
        if seed != ours:
            logger.info("round %s: %s asked for a receipt of part %d with another seed", r._tag(), ctx.peer_id, part)
            raise BadRequest(f"avg.receipt: {WRONG_SEED}: we hold other results")
        receipt = self.receipts.get(part)
        if receipt is None:
            raise NotFound(f"avg.receipt: no receipt of part {part} here")
        data = await asyncio.shield(receipt)
        await stream.write(data)
        r.report.bytes_sent += len(data)


def unpack_receipt(raw: bytes) -> Any:
    """A receipt's msgpack; AuditFailure on garbage."""
    try:
        return msgpack.unpackb(raw, raw=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise AuditFailure(f"unreadable receipt: {type(e).__name__}") from None


def failure_logged(what: str) -> Callable[[asyncio.Future[Any]], None]:
    """A done-callback for an audit task nobody may await (its round failed): a failure is
    logged as `what`."""

    def callback(task: asyncio.Future[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.info("audit: %s: %r", what, task.exception())

    return callback


retrieved = failure_logged("a receipt could not be built")  # a receipt task's
checked = failure_logged("a part's check failed")  # a part check's (a completed round raises it from `run` too)


def succeeded(result: asyncio.Future[Any]) -> bool:
    return result.done() and not result.cancelled() and result.exception() is None


def holds(result: asyncio.Future[Any], payload: memoryview) -> bool:
    """Is `payload` (a part's final bytes) this reduction result's (not a copy)?"""
    return succeeded(result) and result.result()[1] is payload
