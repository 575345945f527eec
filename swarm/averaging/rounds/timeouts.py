"""The all-reduce's part timeout, derived from the round times this member has measured.

A round's waits (a member's slice, an owner's answer, an audit's seed) are each bounded by the
part timeout. A fixed 60 s made a member that vanished inside a round (a machine that lost power
sends no FIN: its peers see only silence) cost every survivor a minute or more, whatever the
round's normal length. The rule here:

    part timeout = min(ceiling, max(FLOOR_S, FACTOR x min(p90, SPREAD x median) of the last
                                    WINDOW completed rounds))

- the ceiling is the configured `part_timeout` (swarm-node --part-timeout): the flag stays an
  upper bound, and it is the timeout until MIN_ROUNDS rounds besides the slowest have been
  measured (a node that just started, or restarted, knows nothing of the swarm's pace yet);
- a single wait never needs longer than a whole round, so FACTOR times the recent slow rounds
  leaves a slow but live member room; the p90 (nearest rank) ignores the few rounds that waited
  for a member that had vanished or was paused, so one such round does not lengthen the next
  ones' timeouts. The slowest round of the window never counts (`pace`): in a window of fewer
  than ten rounds the nearest-rank p90 is the slowest round itself, and under churn most members
  have such a window (a restart empties it). One member paused 14 s inside a round of a 60-minute
  soak made that round its slowest of 7; it announced 3x it, the ceiling, the group took the
  largest announced, and the group's timeout went from 12.9 s to the 60 s flag at the next step
  (with its slowest round left out that member announced 12.6 s, and the group 13.2 s);
- a member that is slow for good makes rounds slow for good: once about a tenth of the window
  waited for it, the timeout grows FACTOR-fold and it fits again;
- a round that waited out a timeout (a paused member's, a silent one's) lasts one to three part
  timeouts, and it measures the timeout, not how long rounds take: it is not measured (below,
  `measures_round`). Measured, it ran the timeouts up in the fortieth minute of a 60-minute soak,
  with a kill or a pause landing in about every third round: once more than a tenth of a window
  had waited, the p90 was such a round, the next timeout three times it, and the next waits
  longer still (8 s, 18 s, 32 s, 60 s, the flag, within five steps); kills then cost rounds
  30-95 s, groups broke up and the swarm forked;
- and rounds slowed without a wait running out (a probed kill, a backup's reduction, an audit's
  request to a dead owner) count as at most SPREAD times the window's median. A member slow for
  good is in every round of its group and moves the median with it; churn moves only the rounds
  it lands in. Either rule alone let the timeouts run up again, through the short windows of
  restarted members, whose largest announced timeout the group takes. Replayed on the recorded
  rounds of two 60-minute soaks (as far as the recorded timeouts allow: a replay judges each
  round by the timeout it ran under, so it stops being one once those ran up), the group's
  timeout reached 49-60 s with the median cap alone and 34 s with the waited rounds left out
  alone, and stayed under 17 s with both;
- FLOOR_S keeps a round of a tiny model (0.1 s) from cutting off a member whose event loop
  stalls for a moment (a garbage collection, a busy CPU).

Every member of a round must wait as long: a member that gives up on a slow part owner takes its
backup's result of that part, while one that waits longer takes the owner's, and the group ends
with two states (a soak saw exactly that at a group of 11 whose members' timeouts were 25 s and
60 s). So each member announces its derived timeout with its matchmaking entry, and the round
uses the largest of its group's, capped by our flag (group_part_timeout): the same value on every
member of a run whose members share the flag. A member that has not measured yet (a restart)
announces none (0) and takes its group's: under churn a group nearly always holds a member that
just restarted, and counting its flag made every round wait 60 s for a member that died in it.

Failed rounds are not measured, so a timeout derived from a quiet spell (the floor, for a tiny
model) would stay there when the machine turns busy: three nodes whose event loops stalled for
seconds under load failed every round of one step on 2.2 s waits ("no credit to write") and
matchmade it again for two minutes. So each failed round in a row doubles the derived timeout
(BACKOFF), up to the flag; a completed round ends the backoff.

A silent member costs a round about two part timeouts: its part's backup starts after the
senders' wait for the owner's answer (2 x the timeout), while the other owners wait one.

Such a round measures that wait, not our link (bandwidth.LinkEstimate.observe skips it), and it
need not have lasted a whole part timeout on our own clock: the wait that ran out may have been
another member's, begun when it learned of the group, before our round started (the public
trainer of the NAT lab's relay-death test saw 59.97 s of a 60 s timeout, took the round as a
measurement and paced its next round at 1 KB/s, which starved the DHT and relay renewals that
its NATed peers had only through it). So a round that lasted more than MEASURED_SHARE of its
part timeout since its group formed measures nothing (`measures_round`), neither the link nor
the rounds' pace: a live group's round lasts a third of it (FACTOR) or less, and an estimate
left unchanged paces as before, or not at all. Such a round leaves the failed rounds' backoff
as it is: the timeout that got it through stays. A part owner that turns slower than the
timeout at once fails its own rounds (its senders gave up on its answers), backs off, and
announces the longer timeout, which its group takes; a sender that does is left out of the parts
it was late for, round after round: the price of not letting churn run the timeout up.

A round that waited for a while without running out a wait does not measure how fast our link is
busy either (`measures_busy`): the busy rate (bandwidth.busy_rate) is the rate 9 in 10 of the
round's quarter-second windows stay under, so once the bytes moved in under a tenth of the round
and the rest was waiting (for a killed member until a probe found it gone, a paused one, an
owner's receipt), it is the rate of the DHT and state traffic beside the round, and the next
rounds are paced at it. In a 60-minute soak (a 1.3M-parameter model on 127.0.0.1, 2.6 MB a
member a round, a few hundred KB/s of other traffic) a member restarted just before a round that
a kill landed in (4.3 s; half its part timeout was 5.75 s) measured its busy rate there, its
first; in the next round the other 14 owners reduced their parts 5 s after it reduced its own:
its slices reached them last, while the others' reached it as fast as ever. That round took
16.6 s, and the rounds that waited so were measured in turn. So the busy rate counts only
from a round that lasted at most MEASURED_SHARE of the part timeout our own recent rounds give
(`derived_part_timeout`, unless nothing is measured yet: then none does). A link that is slow for
good makes our rounds slow for good, and they measure it again.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

FLOOR_S = 2.0  # never shorter than this
FACTOR = 3.0  # times the recent slow rounds
QUANTILE = 0.9
WINDOW = 20  # completed rounds remembered
MIN_ROUNDS = 2  # fewer measured besides the slowest round: the ceiling
MEASURED_SHARE = 0.5  # a round longer than this share of its part timeout measures no link
BACKOFF = 2.0  # the derived timeout grows this many times per failed round in a row
SPREAD = 3.0  # the recent slow rounds count as at most this many times the median one (a quiet
# or busy run's spread is about 2: p90 2.6-3 s against a median of 1.3-1.7 s in the soak's rounds)


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank q-quantile of `values` (not empty): the smallest value with at least
    q of them at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def pace(round_seconds: Sequence[float]) -> float | None:
    """How long the recent slow rounds took: the nearest-rank QUANTILE of the last WINDOW
    completed rounds (seconds, oldest first) without the slowest of them, at most SPREAD times
    their median; None while fewer than MIN_ROUNDS rounds are left besides it. Pure: the module
    docstring's rule."""
    recent = sorted(s for s in round_seconds[-WINDOW:] if math.isfinite(s) and s >= 0)[:-1]
    if len(recent) < MIN_ROUNDS:
        return None
    return min(quantile(recent, QUANTILE), SPREAD * quantile(recent, 0.5))


def derived_part_timeout(round_seconds: Sequence[float], ceiling: float, failed: int = 0) -> float:
    """The part timeout for the next round, from the durations (seconds) of the recent completed
    rounds, oldest first, and the rounds that failed in a row since the last of them; `ceiling`
    is the configured one. Pure: the module docstring's rule."""
    if not ceiling > 0:
        raise ValueError(f"the ceiling must be positive, got {ceiling}")
    slow = pace(round_seconds)
    if slow is None:
        return ceiling
    backoff = BACKOFF ** min(max(0, failed), 32)  # 2^32 x the floor is far above any flag
    return min(ceiling, max(FLOOR_S, FACTOR * slow) * backoff)


def measures_busy(seconds: float, round_seconds: Sequence[float]) -> bool:
    """Does a round that lasted `seconds` since its group formed measure how fast our link is
    while busy (bandwidth.busy_rate), after the completed rounds `round_seconds` (oldest first)?
    False when it lasted more than MEASURED_SHARE of the part timeout they give, or when they
    give none yet (the module docstring). Pure."""
    slow = pace(round_seconds)
    if slow is None or not math.isfinite(seconds) or seconds < 0:
        return False
    return seconds <= MEASURED_SHARE * max(FLOOR_S, FACTOR * slow)


def measures_round(seconds: float, part_timeout: float) -> bool:
    """Does a round that lasted `seconds` since its group formed (on our clock) measure our link
    and the rounds' pace, with `part_timeout` its part timeout? False when a wait in it may have
    run out, here or at another member (the module docstring). Pure."""
    return math.isfinite(seconds) and 0 <= seconds < MEASURED_SHARE * part_timeout


class RoundClock:
    """The durations of this member's last WINDOW completed rounds, the rounds failed since, and
    the timeout they give."""

    def __init__(self) -> None:
        self._seconds: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._failed = 0  # rounds failed in a row since the last completed one

    def observe(self, seconds: float) -> None:
        """A round completed in `seconds` and measures the pace (measures_round; failed rounds
        and rounds that waited are not measured: they say how long the timeouts were, not how
        long a round takes)."""
        if math.isfinite(seconds) and seconds >= 0:
            self._seconds.append(seconds)
            self._failed = 0

    def recent(self) -> tuple[float, ...]:
        """The durations of the remembered completed rounds, oldest first."""
        return tuple(self._seconds)

    def failed(self) -> None:
        """A round failed: the next one waits longer (BACKOFF)."""
        self._failed += 1

    def part_timeout(self, ceiling: float) -> float:
        return derived_part_timeout(tuple(self._seconds), ceiling, self._failed)

    def announced(self, ceiling: float) -> float:
        """What we announce to our group: our derived timeout, or 0 (none) until we have measured
        MIN_ROUNDS rounds besides our slowest."""
        return self.part_timeout(ceiling) if pace(tuple(self._seconds)) is not None else 0.0


def group_part_timeout(announced: Sequence[float], ceiling: float) -> float:
    """The round's part timeout: the largest its members announced (0: none), at most `ceiling`
    (our flag); the ceiling when no member announced one. Pure."""
    if not ceiling > 0:
        raise ValueError(f"the ceiling must be positive, got {ceiling}")
    return min(ceiling, max((t for t in announced if t > 0), default=ceiling))
