"""LinkEstimate: the upload and download rates this node achieved in its rounds, announced as its bandwidth.

Parts are split in proportion to the members' announced bandwidths (partition.part_bounds). A
number configured once is wrong for most volunteers, so each round measures (used when
AveragingConfig.measure_bandwidth, `swarm-node --bandwidth auto`):

- download: every payload this member receives as a part owner (a sender's slice), timed from its
  first chunk to its last (reduction.Incoming): the rate our link delivered it at;
- upload: the same timing, taken by the owner that received our slice, comes back in its answer's
  header ("r", bytes/s). An owner may lie: the rate we count is at most what our own clock saw (a
  write completes no later than its bytes arrive), so a liar can only make us look slower, which
  only takes load off us.

A direction's rate in one round: each stream is taken to move at its average rate over its
interval; where streams overlap their rates add (they share the link), and the rate is the
highest such sum held for at least a twentieth of the round or 50 ms (a stream that ran alone gave
the link to itself; one slowed by its peer ran beside others that took the rest; without the
50 ms, a slow member's slice, trickling in for seconds after the fast ones, hid them: fast members
announced a 10 Mbit/s member's rate, and the split put half the vector on the slow one). Rounds
that moved too little to be timed (latency, not bandwidth) are skipped. The estimate is an
exponential average over rounds; the announced bandwidth is the slower direction (an owner
receives and sends as much), clamped to what MemberInfo accepts, and the group still caps it at
BANDWIDTH_CAP times its median (partition.capped_bandwidths).

Pacing (partition.upload_paces, p2p/pacing.py): once it knows its upload rate, a member caps its
stream to each peer at its share of that rate, so that a FIFO uplink serves every peer evenly and
none finishes early while another trickles. `up` alone would cap too low where our link is the
bottleneck: our slices share the uplink with the results we send as an owner, so their rates add
up to half of it or less (6.5-9.2 MB/s on a 11.9 MB/s link). So a round also measures `busy`:
the bytes of ours the group's members acknowledged (TCP's own count, p2p/pacing.bytes_acked: what
left through the link, not what waits in buffers), in windows of BUSY_WINDOW_S, at the rate
BUSY_QUANTILE of the windows stay under (the round's slow tail does not count). `busy` falls short
where our link was not the bottleneck (a slow peer gated our sending: 2.5-2.9 MB/s of a 12.5 MB/s
link), and there `up` is higher: the pace is the larger of the two. A paced round measures our
caps, not the link, so it changes no estimate (nor what we announce): every PROBE_EVERY-th round
runs unpaced and measures the link again (a link that got faster or slower is seen within that
many rounds). Above MAX_PACED (1 Gbit/s) nothing is paced: there the CPU, not one FIFO queue,
sets the pace (127.0.0.1 moves GB/s). `busy` is our own count: no peer's word enters it (a peer
that reads slowly in the measuring round lowers it, as it slows that round itself).

swarm-node measures by default (NodeConfig.bandwidth None; AveragingConfig.measure_bandwidth stays
off for the library's own rounds): measured and paced, the split at 100,100,100,10 Mbit/s came
within 1.22-1.24x of the best split's bound (1.7x for the equal one), the audited int8 round at 4
x 100 Mbit/s within 1.11-1.12x of its link bound (1.21-1.27x unpaced), and a training run's round
was 21% shorter (scripts/bench/bandwidth.py). The estimates are rough (a 10
Mbit/s member announces about 1.4x its link)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

MIN_STREAM_BYTES = 256 << 10  # a smaller stream is mostly latency and window ramp-up
MIN_ROUND_BYTES = 1 << 20  # a direction must move this much in timed streams to count
SMOOTHING = 0.5  # weight of the newest round
MIN_MB_S, MAX_MB_S = 0.01, 1e5  # what we ever announce (1e5 MB/s: 800 Gbit/s)
MIN_HELD = 0.05  # a rate counts only if held for this share of the round's timed span,
MIN_HELD_S = 0.05  # or for this long: one slow stream (a slow peer's) must not hide fast ones
PACE_FACTOR = 1.05  # caps a little above our share: an estimate a few % low must not idle the link
PROBE_EVERY = 8  # every 8th round runs unpaced, to measure the link again
MAX_PACED = 125e6  # bytes/s (1 Gbit/s): faster uploads are not paced
BUSY_WINDOW_S = 0.25
BUSY_QUANTILE = 0.9
MIN_BUSY_WINDOWS = 4  # a shorter round says too little about the link to pace by

Sample = tuple[int, float, float]  # (bytes, start, end) of one stream, monotonic seconds


def round_rate(samples: Sequence[Sample]) -> float | None:
    """Bytes/s of one direction in one round (module docstring); None when its timed streams
    moved too little to say."""
    timed = [(b, t0, t1) for b, t0, t1 in samples if b >= MIN_STREAM_BYTES and math.isfinite(t1 - t0) and t1 > t0]
    if sum(b for b, _, _ in timed) < MIN_ROUND_BYTES:
        return None
    edges = sorted({t for _, t0, t1 in timed for t in (t0, t1)})
    span = edges[-1] - edges[0]
    best = 0.0
    for a, b in itertools.pairwise(edges):
        if b - a >= min(MIN_HELD * span, MIN_HELD_S):
            best = max(best, sum(n / (t1 - t0) for n, t0, t1 in timed if t0 <= a and b <= t1))
    return best or sum(b for b, _, _ in timed) / span


def busy_rate(acked: Sequence[tuple[float, int]], window: float = BUSY_WINDOW_S) -> float | None:
    """Bytes/s our link carried while busy (module docstring): `acked` is (monotonic seconds,
    bytes acknowledged so far) samples over a round, in time order. None for a round too short to
    say. A count that falls (a connection closed) makes its window count as idle."""
    if len(acked) < 2 or acked[-1][0] - acked[0][0] < MIN_BUSY_WINDOWS * window:
        return None
    rates, start = [], 0
    for i, (t, total) in enumerate(acked):
        if t - acked[start][0] >= window:
            rates.append(max(0, total - acked[start][1]) / (t - acked[start][0]))
            start = i
    rates.sort()
    rate = rates[min(len(rates) - 1, int(BUSY_QUANTILE * len(rates)))]
    return rate if rate > 0 else None


def upload_span(sent: int, started: float, local_s: float, reported_rate: object) -> Sample | None:
    """Our upload of `sent` bytes, begun at `started`, as the receiver's rate (its answer's "r")
    times it, never shorter than our own clock says; None when the receiver gave no usable rate."""
    if isinstance(reported_rate, bool) or not isinstance(reported_rate, int | float):
        return None
    if not (math.isfinite(reported_rate) and reported_rate > 0 and sent > 0):
        return None
    return sent, started, started + max(local_s, sent / reported_rate)


@dataclass
class LinkEstimate:
    """The node's achieved upload and download rates (bytes/s, None until measured); `observe`
    after every round, `announced_mb_s` when announcing itself for the next."""

    up: float | None = None
    down: float | None = None
    busy: float | None = None  # bytes/s the group acknowledged of our sending while busy (busy_rate)
    paced_rounds: int = 0  # rounds since the last unpaced one

    def observe(
        self,
        up: Sequence[Sample],
        down: Sequence[Sample],
        busy: float | None = None,
        *,
        paced: bool = False,
        timed_out: bool = False,
    ) -> None:
        """A finished round's streams and busy rate; `paced`: we capped our sending in it (`pace`),
        so it measured our caps, not the link, and changes nothing but the count to the next probe.
        `timed_out`: the round lasted its part timeout or longer, so some wait in it ran out (a
        member, or the relay a member was reached through, died mid-round): its slow streams
        measured that wait, not our link, and it changes nothing. Taking such a round as a
        measurement paced every later round at the floor, which starved the DHT stores and relay
        renewals that share those connections, and the run stalled."""
        if timed_out:
            return
        if paced:
            self.paced_rounds += 1
            return
        self.up = _smooth(self.up, round_rate(up))
        self.down = _smooth(self.down, round_rate(down))
        self.busy, self.paced_rounds = _smooth(self.busy, busy), 0

    def pace(self) -> float | None:
        """The upload rate (bytes/s) the next round paces its sending by, None: unpaced (nothing
        measured yet, a link faster than MAX_PACED, or the round that measures it again). Both
        measures are lower bounds where the other falls short: `busy` when our link was not the
        round's bottleneck (a slow peer gated our sending), `up` when our results shared it."""
        known = [r for r in (self.busy, self.up) if r is not None]
        if not known or max(known) > MAX_PACED or self.paced_rounds >= PROBE_EVERY - 1:
            return None
        return max(known)

    def announced_mb_s(self, default: float) -> float:
        """MB/s to announce: the slower measured direction, else `default` (nothing measured)."""
        known = [r for r in (self.up, self.down) if r is not None]
        if not known:
            return default
        return min(MAX_MB_S, max(MIN_MB_S, min(known) / 1e6))


def _smooth(old: float | None, new: float | None) -> float | None:
    if new is None:
        return old
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
