"""What every kind of round is made of: RoundMember (a member's view of its group and vector),
the RoundReport it fills in, and await_parts, which waits for a round's parts.

The flat round (rounds/flat.py) and the grid round (rounds/grid.py) are RoundMembers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from swarm.averaging.config import AveragingConfig
from swarm.averaging.errors import AllReduceError
from swarm.averaging.messages import GroupInfo
from swarm.averaging.robust import Fate
from swarm.averaging.rounds.bandwidth import Sample, upload_span
from swarm.averaging.rounds.overdue import MIN_MARGIN_S, Probe, Watch, probe_member
from swarm.averaging.rounds.partition import capped_bandwidths
from swarm.averaging.rounds.reduction import Incoming
from swarm.p2p.host import P2PHost
from swarm.utils.eventloop import exception_seen
from swarm_kernels import get_codec

if TYPE_CHECKING:
    from swarm.averaging.rounds.registry import RoundRegistry

logger = logging.getLogger(__name__)


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
        task.add_done_callback(exception_seen)
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
    streamed: list[int] = field(default_factory=list)  # parts whose average came chunk by chunk, kept
    # (bytes, start, end) of the streams we sent (timed by their receivers) and received: rounds/bandwidth.py
    up: list[Sample] = field(default_factory=list)
    down: list[Sample] = field(default_factory=list)
    busy: float | None = None  # bytes/s the group acknowledged of our sending (bandwidth.busy_rate); flat rounds


class RoundMember:
    """What every kind of round knows of itself: the group, our index in it, our vector, the
    codec, the members' weights and bandwidths (0 for clients: they own nothing). `probe_after`:
    how long a reduction waits for a sender's stream before it probes the sender
    (rounds/overdue.py: overdue.probe_margin of our recent rounds)."""

    def __init__(
        self,
        host: P2PHost,
        registry: RoundRegistry,
        group: GroupInfo,
        vector: torch.Tensor,
        config: AveragingConfig,
        *,
        probe_after: float = MIN_MARGIN_S,
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
        # answers to other members being written: the round waits for them (bounded) before it
        # returns, so that its report counts what it sent them. A member that never reads its
        # answers holds the round up to part_timeout that way: no more than one that never sends
        # its slice already does
        self._answering: set[asyncio.Task[Any]] = set()
        self._started = 0.0
        self.finished = False
        self.probe_after = probe_after

    def watch(self, member_of: Callable[[int], int] | None = None) -> Watch:
        """How a reduction of this round probes its overdue senders (rounds/overdue.py);
        `member_of` maps its sender indices to member indices (a column stage's are rows)."""
        timeout = self.config.request_timeout

        async def probe(sender: int) -> Probe:
            index = sender if member_of is None else member_of(sender)
            return await probe_member(self.host, self.group.members[index], timeout)

        return Watch(probe, self.probe_after, timeout)

    def note_upload(self, sent: int, started: float, local_s: float, header: dict[str, Any]) -> None:
        """Our upload of `sent` bytes from `started` (monotonic), as the receiver's answer header
        timed it (rounds/bandwidth.py)."""
        span = upload_span(sent, started, local_s, header.get("r"))
        if span is not None:
            self.report.up.append(span)

    def note_download(self, incoming: Incoming) -> None:
        if (span := incoming.span()) is not None:
            self.report.down.append(span)

    def _tag(self) -> str:
        """The group, in log lines."""
        return self.group.group_id.hex()[:8]

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
