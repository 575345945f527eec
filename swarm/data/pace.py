"""Claims held to the pace of the swarm: what a peer's chunk record may claim, judged from the
numbers the records publish, as pure functions of a snapshot and the time (tested with a table).

    limits = Limits.of(records, own_rate=900.0, own_epoch=0, own_started=t0)
    judged = held_to_pace(record, limits, plan, seen, claim_ttl, now)   # what counts of it
    due = overdue(held, hold_rate(own, limits), plan, claim_ttl, now)   # our own claims to give up

A record says how fast its node trains (`rate`: the tokens it trained in its epoch over the
seconds from its first row to its last, so that neither a restart nor a wait for the epoch's last
chunks changes it; in an epoch's first second, the epoch before's) and when it began its epoch
(`started`). Both are its own word, so both are held to the swarm's:

- Its rate counts at most PACE_SLACK times the fastest of the median of the known rates (ours
  included; median_low, so that a few fast liars cannot raise it), our own rate and MIN_RATE:
  a reader's own pace is honest, so an honest peer as fast as the reader is never held back.
- Its epoch counts as begun no earlier than the last time we read it in an earlier epoch (an
  honest node began the epoch after that, whenever we next read it), or, for a node we never
  read before it was in that epoch, than the median of the records' start times in that epoch
  (at or after the earliest honest one), unless we saw the record in that epoch before.
- Its done marks count only up to PACE_SLACK times the tokens that rate allows since the epoch
  began, plus MAX_LIVE chunks: the lowest chunks first; the rest are not done as far as we know
  and are trained again. A peer that marks hundreds of chunks done at once has them trained by
  others. An honest record's marks are at most about the tokens it says it trained, which is
  its rate times its epoch's time, so they all count with PACE_SLACK to spare.
- Its live claims lapse once its node has had the time its rate (no slower than a PACE_SLACK**2
  part of the median) needs to train PACE_SLACK times the chunks it may hold, plus HOLD_TTLS
  claim lifetimes, counted from the first date we saw on the claim (a claimant that re-dates it
  at each renewal gains nothing). The slack is the measured pace's, so a slow chunk is held
  long; the claim lifetimes let an honest node whose training stalls for a while under load
  keep its chunk. A node that stalls longer gives the chunk up itself (`overdue`, with a claim
  lifetime to spare), before its readers stop counting the claim: it never trains a chunk that
  a reader may have claimed after it.

What a liar gains is bounded, per costly id, by PACE_SLACK squared times a median node's pace:
it can skip that much data at most and hold MAX_LIVE chunks for one hold. This holds while honest
records are most of those read, as everything built on a median does. Failure modes, waste and
never a skipped chunk: an honest node more than PACE_SLACK**2 times faster than both the median
and the reader has its late done marks counted late, and a reader that joins an epoch after most
of the swarm counts the marks of the few who began it long before only from the median start;
both train those chunks again. A node more than 8 times slower than the median gives up the
second of its MAX_LIVE chunks unfinished (16 times: every chunk it begins).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from swarm.data.chunks import ChunkPlan
from swarm.data.claims import MAX_LIVE, ClaimRecord

PACE_SLACK = 2.0
MIN_RATE = 1_000.0  # tokens/s: the pace whose done marks count for a node that has not trained yet
HOLD_FLOOR = 10.0  # tokens/s: the slowest pace a claim is held for, while no rate is known at all
HOLD_TTLS = 3.0  # claim lifetimes a claim holds beyond its chunks' training time (an honest stall)


@dataclass(frozen=True, slots=True)
class Limits:
    median: float  # tokens/s: the median of the known (nonzero) rates read, ours included; 0: none
    rate: float  # the most tokens/s a record's rate counts for (its done marks)
    started: dict[int, float]  # epoch -> the earliest a record's epoch counts as begun (a median)

    @classmethod
    def of(cls, records: Sequence[ClaimRecord], *, own_rate: float, own_epoch: int, own_started: float) -> Limits:
        # a rate of 0 is a node that has not trained yet: counted, it would pull the median down
        known = [rate for rate in (own_rate, *(r.rate for r in records)) if rate > 0]
        median = statistics.median_low(known) if known else 0.0
        starts: dict[int, list[float]] = {own_epoch: [own_started]}
        for record in records:
            if record.started > 0:
                starts.setdefault(record.epoch, []).append(record.started)
        return cls(
            median,
            PACE_SLACK * max(MIN_RATE, median, own_rate),
            {epoch: statistics.median_low(times) for epoch, times in starts.items()},
        )

    def began(self, epoch: int, said: float, first_seen: float, left_before: float | None = None) -> float:
        """When a record's `epoch` counts as begun: its word, but no earlier than the last time we
        read its node in an earlier epoch (`left_before`: it began this one after that), or, when
        we never did, than the median of the records' (an epoch no record is in: the oldest we
        know) or when we first saw it there."""
        if left_before is not None:
            return max(said, left_before)
        median = self.started.get(epoch, min(self.started.values()))
        return max(said, min(median, first_seen))


def credible_rate(record: ClaimRecord, limits: Limits) -> float:
    """The pace a record's done marks are held to: its word, at most the limit (Limits.rate)."""
    return max(MIN_RATE, min(record.rate, limits.rate))


def hold_rate(rate: float, limits: Limits) -> float:
    """The pace a claimant saying `rate` has its live claims held for: no slower than a
    PACE_SLACK**2 part of the median (a node slower than that loses its claims to faster ones:
    waste, not loss)."""
    return max(rate, limits.median / PACE_SLACK**2, HOLD_FLOOR)


def hold_seconds(plan: ChunkPlan, chunk: int, rate: float, claim_ttl: float) -> float:
    """How long a claim on `chunk` counts for a node held to `rate` tokens/s."""
    start, end = plan.range(chunk)
    return tokens_hold_seconds(end - start, rate, claim_ttl)


def tokens_hold_seconds(tokens: int, rate: float, claim_ttl: float) -> float:
    """How long a claim on a chunk of `tokens` counts for a node held to `rate` tokens/s."""
    return PACE_SLACK * MAX_LIVE * tokens / rate + HOLD_TTLS * claim_ttl


@dataclass(frozen=True, slots=True)
class Seen:
    """What this reader remembers of one peer: when it first saw the peer in each epoch, the
    first date it saw on each of its live claims, and when it last read the peer in an epoch
    before each one it saw it move to."""

    first_seen: Mapping[int, float]  # epoch -> unix time
    first_claimed: Mapping[int, float]  # chunk (of the record's epoch) -> the earliest claim time seen
    left_before: Mapping[int, float] = dataclasses.field(default_factory=dict)  # epoch -> unix time


def held_to_pace(record: ClaimRecord, limits: Limits, plan: ChunkPlan, seen: Seen, claim_ttl: float,
                 now: float) -> ClaimRecord:  # fmt: skip
    """The record as far as its pace allows (module docstring): its live claims that have not
    outlasted their hold, its done marks up to what it can have trained."""
    slow, rate = hold_rate(record.rate, limits), credible_rate(record, limits)
    live = tuple(
        (chunk, at)
        for chunk, at in record.live_at(now)
        if min(at, seen.first_claimed.get(chunk, at)) + hold_seconds(plan, chunk, slow, claim_ttl) > now
    )
    done = {}
    for epoch, bits in record.done.items():
        said = record.started if epoch == record.epoch else 0.0  # a record dates only its current epoch
        began = limits.began(epoch, said, seen.first_seen.get(epoch, now), seen.left_before.get(epoch))
        done[epoch] = _up_to_pace(bits, plan, PACE_SLACK * rate * max(0.0, now - began))
    return dataclasses.replace(record, live=live, done=done)


def overdue(held: Sequence[tuple[int, float]], rate: float, plan: ChunkPlan, claim_ttl: float,
            now: float) -> frozenset[int]:  # fmt: skip
    """Of our own live claims (chunk, claimed at), held at `rate` (hold_rate of ours), those whose
    hold ends within a claim lifetime: our readers' medians differ a little from ours and they
    read up to a renewal late, so we give such a chunk up before any of them counts it free."""
    return frozenset(chunk for chunk, at in held if at + hold_seconds(plan, chunk, rate, claim_ttl) - claim_ttl <= now)


def _up_to_pace(bits: np.ndarray, plan: ChunkPlan, tokens: float) -> np.ndarray:
    sizes = np.diff(np.array((0, *plan.ends)))
    marked = np.cumsum(np.where(bits, sizes, 0))
    return bits & (marked <= tokens + MAX_LIVE * int(sizes.max()))
