"""A part owner that some of its senders gave up on checks its result with the group before using it.

Both rounds use it: the flat round for its own part, the grid round (rounds/grid.py) for the
sub-part an owner reduces at its column stage ("part" below: the sub-part's key, column x rows +
row). A sender waits a few part timeouts for an owner's answer, then takes the part from the
owner's backup, which reduces it without the owner's contribution. An owner stalled between its
group's formation and its round (a paused process, a machine swapping) reads the senders' bytes
from its socket buffers once it runs again, reduces its part with them, and ends the round with a
result that nobody else took: another state than its group's. What it can see of that is on its
own streams: a sender whose bytes never came whole, or who cancelled its stream before our answer
(the caller gave up on us); and its clock, from the group's formation to its result
(LATE_TIMEOUTS). An owner whose senders all waited for its answer and whose result came in time
uses it at once, as before; any other asks the group.

    avg.fetch  {"g": group_id, "p": part, "d": true}
               -> msgpack {"d": BLAKE3 digest of the part's result, "by": index of the member
                  that reduced it (in the grid, a member that took the whole part from an owner
                  of its column names that owner)}, or {"none": true} when no result of the part
                  is here within request_timeout; then end. (A peer that does not know "d"
                  answers as to a plain avg.fetch: that answer counts as no vote.)

The owner asks every other member that accepts connections (clients accept none) at once (in
the grid, the other owners of its column: they take the sub-part from its owner or a backup, the
others what their row's owner forwards, once its whole part is final), and `decide` is the rule,
one vote per member:
- another result that more than half of those members hold is the group's: the owner takes its
  bytes from one of them (checked against the digest) and uses them;
- else, if at least one member holds our bytes, our answer reached the group: ours stands;
- else, if every member asked is gone (a refused or lost connection: its process ended), nobody
  is left who could have taken the part over: ours stands;
- else nobody confirms our result: the round fails for the owner (Unconfirmed), so that its node
  does not apply it and takes the group's result or state instead. It does not ask its backups
  for the part as a sender would: a backup asked for a part whose result it does not hold yet
  takes it over and reduces it again, and the members still waiting for our answer would then
  hold another result than ours and the backup's.
A lying minority cannot reach the majority of the first rule, and a false "ours" only keeps the
owner on its own result, as it was before this check; honest members holding our bytes always
vote for them, so liars cannot make an owner that was not late drop a good result.

A backup taking over a dead owner's part checks the copies of the owner's result it is offered
the same way (`vouched_copy`): it asks every other member that accepts connections for the
copy it holds (a plain avg.fetch, answered at once, or, when the owner's answer to the member
has begun, once it is held) and takes one only when VOUCHES members hold
the same bytes and members list (`vouched`: one, when it can ask only one); else it reduces the
part again. So one lying member cannot put a part of its choosing in the round. The price: a
copy that only one honest member received (the owner died while answering) is not believed,
and that member keeps the owner's result while the group takes the backup's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgpack

from swarm.averaging.audit.arithmetic import result_digest
from swarm.averaging.errors import AllReduceError
from swarm.averaging.rounds.registry import FETCH
from swarm.averaging.rounds.streams import Final, read_header
from swarm.p2p.errors import ConnectionLost, P2PError
from swarm.utils.eventloop import exception_seen

if TYPE_CHECKING:
    from swarm.averaging.config import AveragingConfig
    from swarm.averaging.messages import GroupInfo
    from swarm.averaging.rounds.reduction import PartReduction
    from swarm.p2p.host import P2PHost

logger = logging.getLogger(__name__)

DIGEST_BYTES = 32
VOUCHES = 2  # members that must hold one copy of a dead owner's result for a backup to take it
# A flat round's sender waits two part timeouts for an owner's answer from its own round's start,
# never before the group formed (a grid round's sender waits longer: three, after its own row
# stage); an answer takes under a third of a part timeout to deliver (the timeout is 3x the slow
# rounds'). So an owner whose result is ready within 1.5 part timeouts of the group's formation
# reaches every sender in time; one later may not.
LATE_TIMEOUTS = 1.5


class Confirming(Protocol):
    """What a round offers the checks here (rounds/flat.py's and rounds/grid.py's rounds)."""

    group: GroupInfo
    me: int
    config: AveragingConfig
    host: P2PHost

    def _tag(self) -> str: ...

    async def fetch_result(self, member_index: int, j: int) -> Final: ...


def in_doubt(formed_at: float, part_timeout: float, reduction: PartReduction) -> bool:
    """May senders have taken our own part from a backup? Our result came late, or a sender's
    bytes did not come whole, or it gave up on our answer."""
    late = time.monotonic() - formed_at > LATE_TIMEOUTS * part_timeout
    return late or bool(reduction.unanswered())


class Votes:
    """What this member holds of each part's result, for the digest requests of the other
    members' checks: the round calls `hold` as it takes a part's result (again when it replaces
    it); `answer` is the reply to a digest request."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout  # how long a request waits for a result we do not hold yet
        self._held: dict[int, asyncio.Future[tuple[memoryview, int]]] = {}
        self._digests: dict[int, asyncio.Future[bytes]] = {}  # part -> its result's digest, once asked
        self._coming: dict[int, asyncio.Future[None]] = {}  # parts whose owner is answering us now

    def coming(self, j: int) -> None:
        """Part j's owner has begun its answer to us (its header is in: a streamed answer's chunks
        follow as the senders' bytes come), or a grid owner's answer is being decoded here. Not
        while the answer is only awaited: a paused owner's answer may never begin, and a member
        that waits on it holds no copy. A backup's ask waits at most `timeout` for one that has
        begun (backup_patience counts it): a busy member that gave up on a live owner's streamed
        answer took the part over, and, told "none" by the members still reading that answer,
        reduced it again, so that a soak's round of 12 ended with two results, 7 and 4."""
        self._coming[j] = asyncio.get_running_loop().create_future()

    def not_coming(self, j: int) -> None:
        """The owner's answer for part j ended: held (hold), or failed (the owner died answering)."""
        if (future := self._coming.pop(j, None)) is not None and not future.done():
            future.set_result(None)

    async def held_or_not_coming(self, j: int) -> None:
        """Return once part j's result is held here or no answer of its owner is coming (at most
        `timeout`). A backup that takes over a dead owner's part asks the others for copies of
        the owner's result; a member the owner answered just before it died, whose copy was still
        coming in or being decoded, would say "none" if asked without waiting, and the backup
        would reduce the part again without it: that member and the others would end the round
        with two results (a 60-minute soak split 7 + 20 so)."""
        if (future := self._coming.get(j)) is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(future), self.timeout)

    def _future(self, j: int) -> asyncio.Future[tuple[memoryview, int]]:
        if j not in self._held:
            self._held[j] = asyncio.get_running_loop().create_future()
        return self._held[j]

    def hold(self, j: int, payload: memoryview, by: int) -> None:
        """We hold `payload` as part j's result, reduced by member `by`."""
        future = self._future(j)
        if future.done():  # a result replaced: a vote is on the new bytes
            future = self._held[j] = asyncio.get_running_loop().create_future()
            self._digests.pop(j, None)
        future.set_result((payload, by))
        self.not_coming(j)

    async def answer(self, j: int) -> bytes:
        """Our vote on part j once we hold its result, within `timeout`; else none."""
        try:
            payload, by = await asyncio.wait_for(asyncio.shield(self._future(j)), self.timeout)
        except TimeoutError:
            return digest_answer(None, None)
        if j not in self._digests:
            self._digests[j] = asyncio.ensure_future(asyncio.to_thread(result_digest, payload))
        return digest_answer(await asyncio.shield(self._digests[j]), by)


class Unconfirmed(AllReduceError):
    """Some senders gave up on our answer for our own part, and no member holds our result."""


@dataclass(frozen=True, slots=True)
class Vote:
    digest: bytes  # of the part's result the member holds
    by: int  # the member that reduced it, as the voter says


@dataclass(frozen=True, slots=True)
class Decision:
    kind: str  # "ours" | "adopt" | "none" (nobody confirms ours: fail) | "open" (votes still missing)
    digest: bytes = b""  # "adopt": the group's result
    by: int = -1  # "adopt": its reducer, as most of its voters say


def decide(own: bytes, votes: dict[int, Vote | None], voters: int, gone: int = 0) -> Decision:
    """The rule of the module docstring over the votes in so far (member -> its vote, None: it
    answered without one, or failed); `voters`: how many members were asked; `gone`: how many of
    them could not be reached at all (their process ended: a refused or lost connection). "open"
    while the votes still missing could change the outcome. Pure."""
    counts = Counter(v.digest for v in votes.values() if v is not None)
    majority = voters // 2 + 1
    for digest, count in counts.items():
        if digest != own and count >= majority:
            bys = Counter(v.by for v in votes.values() if v is not None and v.digest == digest)
            return Decision("adopt", digest, bys.most_common(1)[0][0])
    pending = voters - len(votes)
    best_other = max((c for d, c in counts.items() if d != own), default=0)
    if best_other + pending >= majority:
        return Decision("open")  # another result could still gather a majority
    # every voter gone: nobody is left who could have taken the part over from us, or use it
    if counts[own] > 0 or gone == voters:
        return Decision("ours")
    return Decision("open") if pending else Decision("none")  # a voter still to answer may hold ours


def backup_patience(owner_wait: float, request_timeout: float) -> float:
    """How long a sender waits for a backup's answer to its part: as long as for the owner's
    (`owner_wait`), and the backup's ask for copies before that (`vouched_copy`: a dial, then an
    answer that a member holds back until the owner's answer coming to it is held, each up to
    request_timeout). A sender that gave up sooner took the part to the next backup, which asked
    for copies in its turn and could reduce the part again from other contributions: two results
    of one part in one round."""
    return owner_wait + 2 * request_timeout


def vouched(counts: dict[object, int], pending: int, asked: int) -> Decision:
    """A backup's rule over the copies of a dead owner's result in so far (copy -> how many
    members sent it), `pending` members still to answer, of `asked`: "adopt" the first copy that
    min(VOUCHES, asked) members hold ("digest" left empty: the caller knows the copy), "none" once
    no copy can get there, else "open". Pure."""
    need = min(VOUCHES, asked)
    if need == 0:
        return Decision("none")
    if any(count >= need for count in counts.values()):
        return Decision("adopt")
    return Decision("none") if max(counts.values(), default=0) + pending < need else Decision("open")


def parse_vote(header: dict[str, object], members: int) -> Vote | None:
    """A vote from a digest answer's header; None for one without (a peer of an older version,
    or none here). Anything malformed: AllReduceError."""
    if "d" not in header:
        return None
    digest, by = header.get("d"), header.get("by")
    if not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
        raise AllReduceError("malformed digest answer")
    if isinstance(by, bool) or not isinstance(by, int) or not 0 <= by < members:
        raise AllReduceError("malformed digest answer")
    return Vote(digest, by)


async def confirm_own_part(r: Confirming, j: int, own: Final, voters: list[int] | None = None) -> tuple[Final, int]:
    """Our own part j's result checked with the group (the module docstring): (the result to
    use, the member that reduced it); AllReduceError when nobody confirms ours. `voters`: the
    members to ask, when not every other one that accepts connections."""
    if voters is None:
        voters = [i for i, m in enumerate(r.group.members) if i != r.me and not m.client]
    if not voters:  # no member could have taken the part over: ours is the only result
        return own, r.me
    own_digest = await asyncio.to_thread(result_digest, own[1])
    decision, votes = await _poll(r, j, own_digest, voters)
    said = {i: v.digest.hex()[:8] if v else None for i, v in sorted(votes.items())}
    if decision.kind == "ours":
        logger.info("round %s: our part %d: a sender gave up on us or we were late; the group holds our result %s",
                    r._tag(), j, said)  # fmt: skip
        return own, r.me
    if decision.kind == "adopt":
        holders = [i for i, v in votes.items() if v is not None and v.digest == decision.digest]
        final = await _fetch_result(r, j, holders, decision.digest)
        logger.warning("round %s: our part %d: the group took it from member %d while we were late: using its "
                       "result, not ours (%s)", r._tag(), j, decision.by, said)  # fmt: skip
        return final, decision.by
    raise Unconfirmed(f"part {j}: senders may have given up on our answer, and no member holds our result ({said})")


async def group_result(r: Confirming, j: int, held: Final) -> tuple[Final, int] | None:
    """Part j's owner says the group took the part from a backup, not from it (its audit's
    answer, audit/flat.py), while we hold the owner's own result (`held`: it answered us before
    we gave up on it). The group's result and its reducer when more than half of the other
    members that accept connections, the owner left out (its word is what is checked), hold
    another result than ours; None when they do not (the owner's claim is false)."""
    voters = [i for i, m in enumerate(r.group.members) if i not in (r.me, j) and not m.client]
    decision, votes = await _poll(r, j, await asyncio.to_thread(result_digest, held[1]), voters)
    if decision.kind != "adopt":
        return None
    holders = [i for i, v in votes.items() if v is not None and v.digest == decision.digest]
    try:
        final = await _fetch_result(r, j, holders, decision.digest)
    except AllReduceError:
        return None
    logger.warning("round %s: part %d: its owner answered us late; the group took it from member %d: using that",
                   r._tag(), j, decision.by)  # fmt: skip
    return final, decision.by


async def vouched_copy(r: Confirming, j: int, others: list[int]) -> Final | None:
    """A copy of the dead owner's part j's result that enough of `others` hold (the module
    docstring), or None: the backup reduces the part itself."""
    asks = {asyncio.ensure_future(r.fetch_result(i, j)): i for i in others}
    for task in asks:  # those still running when a copy is vouched for are cancelled unread
        task.add_done_callback(exception_seen)
    counts: Counter[tuple[bytes, tuple[int, ...]]] = Counter()
    copies: dict[tuple[bytes, tuple[int, ...]], Final] = {}
    decision = vouched(counts, len(asks), len(asks))
    try:
        pending = set(asks)
        while decision.kind == "open" and pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.cancelled() or task.exception() is not None:
                    continue  # holds none, or gone
                final = task.result()
                key = (await asyncio.to_thread(result_digest, final[1]), tuple(final[0]))
                counts[key] += 1
                copies.setdefault(key, final)
                if vouched(counts, len(pending), len(asks)).kind == "adopt":  # this copy got there
                    return copies[key]
            decision = vouched(counts, len(pending), len(asks))
    finally:
        for task in asks:
            task.cancel()
    if counts:
        said = {k[0].hex()[:8]: n for k, n in counts.items()}
        logger.warning("round %s: part %d: copies of its dead owner's result that too few members hold (%s): "
                       "reducing it again", r._tag(), j, said)  # fmt: skip
    else:
        logger.info("round %s: part %d: none of %d members holds its dead owner's result: reducing it again",
                    r._tag(), j, len(asks))  # fmt: skip
    return None


async def _poll(r: Confirming, j: int, own: bytes, voters: list[int]) -> tuple[Decision, dict[int, Vote | None]]:
    """Ask `voters` at once what they hold of part j, until `decide` settles (or all answered)."""
    votes: dict[int, Vote | None] = {}
    asks = {asyncio.ensure_future(_ask(r, i, j)): i for i in voters}
    for task in asks:  # those still running when the vote settles are cancelled unread
        task.add_done_callback(exception_seen)
    decision, gone = decide(own, votes, len(voters)), 0
    try:
        pending = set(asks)
        while decision.kind == "open" and pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                failed = task.cancelled() or task.exception() is not None
                gone += not task.cancelled() and isinstance(task.exception(), ConnectionLost)
                votes[asks[task]] = None if failed else task.result()
            decision = decide(own, votes, len(voters), gone)
    finally:
        for task in asks:
            task.cancel()
    return decision, votes


async def _ask(r: Confirming, member_index: int, j: int) -> Vote | None:
    timeout = 2 * r.config.request_timeout  # it waits up to request_timeout for its result
    args = {"g": r.group.group_id, "p": j, "d": True}
    try:
        member = r.group.members[member_index]
        async with await r.host.open_stream(member.address(), FETCH, args, timeout=timeout) as stream:
            await stream.end()
            header, _ = await read_header(stream, timeout)
            return parse_vote(header, len(r.group.members))
    except ConnectionLost as e:  # its process is gone: _poll counts it so
        logger.info("round %s: member %d is gone, no vote on part %d: %s", r._tag(), member_index, j, e)
        raise
    except (P2PError, AllReduceError, TimeoutError, ValueError) as e:
        logger.info("round %s: member %d did not vote on part %d: %s", r._tag(), member_index, j, e)
        return None


async def _fetch_result(r: Confirming, j: int, holders: list[int], digest: bytes) -> Final:
    """The group's result of part j from one of its holders, checked against its digest."""
    for i in holders:
        try:
            final = await r.fetch_result(i, j)
        except (P2PError, AllReduceError, TimeoutError, ValueError) as e:
            logger.info("round %s: part %d from member %d failed: %s", r._tag(), j, i, e)
            continue
        if await asyncio.to_thread(result_digest, final[1]) == digest:
            return final
        logger.warning("round %s: member %d sent other bytes of part %d than it voted for", r._tag(), i, j)
    raise AllReduceError(f"part {j}: no holder of the group's result sent it")


def digest_answer(digest: bytes | None, by: int | None) -> bytes:
    """The answer to a digest request: the vote, or none."""
    return msgpack.packb({"d": digest, "by": by} if digest is not None else {"none": True})
