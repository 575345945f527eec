"""Claims held to the pace of the swarm: what a peer's chunk record may claim, judged from the
numbers the records publish, as a pure function of a snapshot (tested with a table of cases).

    limits = Limits.of(records, own_rate=900.0, own_started=t0, now=now)
    judged = held_to_pace(record, limits, plan, first_claimed, claim_ttl, now)   # what counts of it

A record says how fast its node trains (`rate`, tokens/s) and when it began its epoch
(`started`). Both are its own word, so both are held to the swarm's: a record's rate counts at
most PACE_SLACK times the median rate of the records read (ours included; median_low, so that a
few fast liars cannot raise it), and its epoch counts as begun no earlier than the median of the
records' start times in that epoch (median_low: at or after the earliest honest one) unless we
saw the record in that epoch before then ourselves (`first_seen`). Then:

- a live claim lapses once its node has had PACE_SLACK times the time its rate (no slower than
  a PACE_SLACK**2 part of the median) needs to train the chunks it may hold (MAX_LIVE of them)
  plus one claim's lifetime, counted from the first
  time we saw that claim (`first_claimed`: a claimant that re-dates its claim at each renewal
  gains nothing), so a peer that claims chunks and never trains them gives them back;
- a record's done marks count only up to PACE_SLACK times the tokens its rate allows since its
  epoch began, plus MAX_LIVE chunks: the lowest chunks first; the rest are not done as far as we
  know, and are trained again. A peer that marks hundreds of chunks done at once, ahead of any
  pace, has them trained by others.

What a liar gains is bounded, per costly id, by PACE_SLACK squared times a median node's pace: it
can skip that much data at most. This holds while honest records are most of those read, as
everything built on a median does. An honest node much faster than the median has its done marks
counted late, and some of its chunks are trained twice: waste, never a skipped chunk.
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


@dataclass(frozen=True, slots=True)
class Limits:
    median: float  # tokens/s: the median rate of the records read, ours included
    rate: float  # the most tokens/s a record's rate counts for (its done marks)
    started: dict[int, float]  # epoch -> the earliest a record's epoch counts as begun (a median)

    @classmethod
    def of(cls, records: Sequence[ClaimRecord], *, own_rate: float, own_epoch: int, own_started: float) -> Limits:
        median = statistics.median_low([own_rate, *(r.rate for r in records)])
        starts: dict[int, list[float]] = {own_epoch: [own_started]}
        for record in records:
            if record.started > 0:
                starts.setdefault(record.epoch, []).append(record.started)
        return cls(
            median,
            PACE_SLACK * max(MIN_RATE, median),
            {epoch: statistics.median_low(times) for epoch, times in starts.items()},
        )

    def began(self, epoch: int, said: float, first_seen: float) -> float:
        """When a record's `epoch` counts as begun: its word, but no earlier than the median of the
        records' (an epoch no record is in: the oldest we know) or when we first saw it there."""
        median = self.started.get(epoch, min(self.started.values()))
        return max(said, min(median, first_seen))


def credible_rate(record: ClaimRecord, limits: Limits) -> float:
    """The pace a record's done marks are held to: its word, at most PACE_SLACK times the median."""
    return max(MIN_RATE, min(record.rate, limits.rate))


def hold_rate(record: ClaimRecord, limits: Limits) -> float:
    """The pace a record's live claims are held for: its word, but no slower than a PACE_SLACK**2
    part of the median (a node slower than that loses its claims to faster ones: waste, not loss)."""
    return max(record.rate, limits.median / PACE_SLACK**2, HOLD_FLOOR)


def hold_seconds(plan: ChunkPlan, chunk: int, rate: float, claim_ttl: float) -> float:
    """How long a claim on `chunk` counts for a node training at `rate` tokens/s."""
    start, end = plan.range(chunk)
    return PACE_SLACK * MAX_LIVE * (end - start) / rate + claim_ttl


@dataclass(frozen=True, slots=True)
class Seen:
    """What this reader remembers of one peer: when it first saw the peer in each epoch, and the
    first date it saw on each of its live claims."""

    first_seen: Mapping[int, float]  # epoch -> unix time
    first_claimed: Mapping[int, float]  # chunk (of the record's epoch) -> the earliest claim time seen


def held_to_pace(record: ClaimRecord, limits: Limits, plan: ChunkPlan, seen: Seen, claim_ttl: float,
                 now: float) -> ClaimRecord:  # fmt: skip
    """The record as far as its pace allows (module docstring): its live claims that have not
    outlasted their hold, its done marks up to what it can have trained."""
    slow, rate = hold_rate(record, limits), credible_rate(record, limits)
    live = tuple(
        (chunk, at)
        for chunk, at in record.live_at(now)
        if min(at, seen.first_claimed.get(chunk, at)) + hold_seconds(plan, chunk, slow, claim_ttl) > now
    )
    done = {}
    for epoch, bits in record.done.items():
        said = record.started if epoch == record.epoch else 0.0  # a record dates only its current epoch
        began = limits.began(epoch, said, seen.first_seen.get(epoch, now))
        done[epoch] = _up_to_pace(bits, plan, PACE_SLACK * rate * max(0.0, now - began))
    return dataclasses.replace(record, live=live, done=done)


def _up_to_pace(bits: np.ndarray, plan: ChunkPlan, tokens: float) -> np.ndarray:
    sizes = np.diff(np.array((0, *plan.ends)))
    marked = np.cumsum(np.where(bits, sizes, 0))
    return bits & (marked <= tokens + MAX_LIVE * int(sizes.max()))
