"""A sender whose slice is overdue is probed, and left out at once when its process is gone.

Every reduction of a round (a flat round's part, a backup's takeover, a grid row or column
stage: rounds/reduction.py) waits for each expected sender's bytes up to the part timeout
(rounds/timeouts.py). A sender that died with its stream to us open is dropped as the stream
breaks. One that died before it opened that stream left nothing to break, and nothing else told
the owner: the owner waited out the whole part timeout, and so did everyone waiting for its part
(a 30-minute soak, kill -9 aimed inside rounds: those rounds took 2-135 s, median 73 s).

Silence is what a vanished machine (power, a cut network) or a paused process shows. A process
that crashed or was killed on a live machine, the common case, is not silent: its kernel closes
its sockets at once, so a dial to it is refused and an open connection to it ends at once. So a
reduction probes each sender that has not begun its stream once the wait has lasted `margin`,
and again at 2x, 4x... the margin (a member alive at one probe may die before the next). The
margin is MARGIN_FACTOR x the fastest quarter of our recent rounds (MARGIN_QUANTILE), at least
MIN_MARGIN_S: the rounds a death made slow must not push the next probes back (a soak's newcomer
had measured 4.4, 1.0 and 4.6 s, two of them rounds that waited for killed members: a margin
from their median, 8.9 s, kept its whole group 9.7 s in the next round that a kill landed in).
A probe too early costs little: a live member answers on the connection the round already
opened to it. A probe is our own dial to the
member's announced address (an open connection to it is reused, as by every call), checked
against its PeerID by the handshake as every session is. `plan` is the rule, a pure function:

- the last probe found the member gone (ConnectionLost: the TCP dial refused, reset or
  unreachable; a handshake that breaks off counts as no answer, an overloaded peer may do that):
  fail over now, the part is reduced without it, as after its part timeout;
- a probe is in flight: wait for it;
- the wait has lasted margin x 2^k after k probes: probe;
- else wait (the sender's bytes may come meanwhile).
A member that answers (or whose probe goes unanswered: a paused process, a vanished machine) is
waited for as before, up to the part timeout.

What probes cannot do, by design:
- make a wait longer: a member that answers probes but never sends costs one part timeout, as
  before, and at most log2(part timeout / margin) + 1 probes;
- let another peer get an honest member dropped: only our own dial to that member's own address
  counts, no peer's word about it;
- reach a client member (it accepts no connections): it is waited for as before; so is a member
  restarted with the same identity at the same address (it answers).
A member alive but unreachable at its announced address (a firewall that rejects), whose own
connection to us has not come yet, is left out of that part: its node takes the group's result
(it could not own a part anyway: nobody could reach it).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from swarm.averaging.messages import MemberInfo
from swarm.averaging.rounds.timeouts import quantile
from swarm.p2p.errors import ConnectionLost, P2PError
from swarm.p2p.host import P2PHost

logger = logging.getLogger(__name__)

MIN_MARGIN_S = 0.5  # never probe sooner: a round of a tiny model takes ~0.1 s, a loop can stall longer
MARGIN_FACTOR = 2.0  # x our fast rounds: a sender that late is worth a dial
MARGIN_QUANTILE = 0.25  # the fastest quarter of our recent rounds: those no death slowed down


class Probe(enum.Enum):
    PENDING = "pending"  # a probe is in flight
    ANSWERED = "answered"  # the member's host answered, as its PeerID: alive
    SILENT = "silent"  # no answer in time, or none possible (a client): we cannot tell
    GONE = "gone"  # our dial refused, reset or unreachable: its process is gone


class Action(enum.Enum):
    WAIT = "wait"
    PROBE = "probe"
    FAIL_OVER = "fail over"


def probe_margin(round_seconds: Sequence[float]) -> float:
    """How long a reduction waits for a sender before probing it: MARGIN_FACTOR x the
    MARGIN_QUANTILE of our recent completed rounds (seconds), at least MIN_MARGIN_S. Pure."""
    recent = [s for s in round_seconds if math.isfinite(s) and s >= 0]
    fast = quantile(recent, MARGIN_QUANTILE) if recent else 0.0
    return max(MIN_MARGIN_S, MARGIN_FACTOR * fast)


def plan(waited: float, margin: float, probes: int, last: Probe | None) -> tuple[Action, float]:
    """What to do about one sender whose stream has not begun, `waited` seconds into the wait,
    after `probes` probes of it, the last of which found `last` (None: not probed yet); and, for
    WAIT, the seconds until this should be asked again (inf: when the probe in flight ends).
    Pure: the module docstring's rule."""
    if last is Probe.GONE:
        return Action.FAIL_OVER, 0.0
    if last is Probe.PENDING:
        return Action.WAIT, math.inf
    due = margin * 2.0 ** min(probes, 64)
    if waited >= due:
        return Action.PROBE, 0.0
    return Action.WAIT, due - waited


async def probe_member(host: P2PHost, member: MemberInfo, timeout: float) -> Probe:
    """Is `member`'s process there? Our dial to its announced address (an open connection to it
    counts: its end would have closed it), authenticated as its PeerID."""
    if member.client or not member.maddrs:  # accepts no connections: nothing to dial
        return Probe.SILENT
    try:
        await host.connect(member.address(), timeout=timeout)
    except ConnectionLost:
        return Probe.GONE
    except (P2PError, TimeoutError, ValueError):  # no answer in time, or not as the member: cannot tell
        return Probe.SILENT
    return Probe.ANSWERED


@dataclass(frozen=True)
class Watch:
    """How a reduction finds senders gone: `probe` (sender index -> what a probe found), `margin`
    (seconds before the first probe) and `timeout` (the longest one look waits)."""

    probe: Callable[[int], Awaitable[Probe]]
    margin: float
    timeout: float


async def watch(missing: Callable[[], Iterable[int]], how: Watch, gone: Callable[[int], None]) -> None:
    """Probe the senders `missing()` names (expected, their stream not begun, not found gone) by
    `plan`, and call `gone(i)` for each that a probe found gone (it must leave `missing()` then).
    Ends when nobody is missing; the caller cancels it when its wait ends."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    probes: dict[int, int] = {}
    last: dict[int, Probe] = {}
    pending: dict[asyncio.Future[Probe], int] = {}
    told: set[int] = set()  # found gone and reported
    try:
        while True:
            waited, sleep, anyone = loop.time() - began, math.inf, False
            for i in [i for i in missing() if i not in told]:
                anyone = True
                action, after = plan(waited, how.margin, probes.get(i, 0), last.get(i))
                if action is Action.FAIL_OVER:
                    told.add(i)
                    gone(i)
                elif action is Action.PROBE:
                    probes[i], last[i] = probes.get(i, 0) + 1, Probe.PENDING
                    pending[asyncio.ensure_future(how.probe(i))] = i
                else:
                    sleep = min(sleep, after)
            if not anyone or (not pending and math.isinf(sleep)):  # nobody left to wait for
                return
            timeout = min(sleep, how.timeout)
            if pending:
                done, _ = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    last[i] = task.result()  # probe_member raises only on a bug: it must be seen
            else:
                await asyncio.sleep(timeout)
    finally:
        for task in pending:
            task.cancel()
