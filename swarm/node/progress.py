"""Training progress in the DHT: what each node of a run publishes under `<run>/nodes`, and
when the peers of an outer step will finish their inner steps.

    {"maddrs": [...], "client": bool, "step": outer step, "inner": inner steps done, "H": inner
     steps per outer step, "sec_per_step": float, "time": unix time of the figures,
     "settings": the run settings it trains with (node/settings.py), "proof": the nonce of its
     costly DHT id, "left": true once the node has left the run, ...}

plus display fields (`train_loss`, `eval_loss`, `tokens_per_s`, `group_size`, `bytes_sent` and
`bytes_received`: the node's wire totals, `reach`: direct, punched or relayed) that
`swarm-dht inspect --run-id` and its dashboard show,
and `evals`: the node's last EVAL_HISTORY (outer step, eval loss) pairs, the run's loss curve.
Nodes use the timing fields to enter matchmaking together: each node aims to announce
`matchmaking_time` before the slowest peer of its step finishes (hivemind's progress tracker
does the same job with sample counts).

Peer records are untrusted: each field is type- and range-checked, a bad record is ignored;
`implausible` then drops records whose numbers the run cannot produce (a liar's pace or step), and
plan.straggler_horizon keeps any one record from holding a step for long.
ProgressBook is the one owner of these records: it encodes and publishes ours, reads and
decodes the peers'.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from swarm.dht.errors import DHTError
from swarm.dht.node import DHTNode
from swarm.dht.records import owner_subkey
from swarm.dht.run_keys import RUNS_KEY, nodes_key, proven_map
from swarm.dht.store_retry import store_or_warn
from swarm.node.settings import RunSettings
from swarm.p2p.errors import P2PError
from swarm.p2p.peer_id import PeerID
from swarm.p2p.reach import reach_of
from swarm.utils.log_once import OncePerPeer

logger = logging.getLogger(__name__)
_unproven = OncePerPeer(logger, logging.INFO)

MAX_STEP = 1 << 40
RUN_LISTING_INTERVAL = 60.0  # seconds between a node's listings of its run (RUNS_KEY)
MAX_SEC_PER_STEP = 3600.0
MIN_SEC_PER_STEP = 1e-4  # a timed inner step faster than this is a lie (0: not timed yet)
MAX_CLOCK_SKEW = 10.0  # seconds a record's time may lie ahead of ours
EVAL_HISTORY = 64  # (outer step, eval loss) pairs a record carries: about 1 KB of msgpack
MAX_LOSS = 1e6  # an eval loss beyond this (or below 0) is not a loss
RENEWAL_WINDOW = 60.0  # seconds over which our own records' renewals say how late records come here
MAX_STRETCH = 2.0  # our late renewals stretch the records' freshness to at most this many times the quiet one


def freshness(publish_interval: float, renewal_gap: float) -> float:
    """How old a peer's record may be before we take its peer for dead or stuck: three missed
    renewals and 2 s. A renewal takes the publish interval on a quiet machine; on a busy one
    the periodic store waits for the DHT's round trips and a starved event loop, and a live
    peer's record was seen 4.0 s old against a freshness of 3.5 s (0.5 s interval). So a
    renewal takes `renewal_gap` when that is longer: the oldest our own record grew, lately,
    before the next was stored (a peer on the same machine, or one as loaded, is as late). At
    most MAX_STRETCH times the quiet window: a node whose peers died still goes on."""
    quiet = 3 * publish_interval + 2.0
    return min(MAX_STRETCH * quiet, 3 * max(publish_interval, renewal_gap) + 2.0)


def publish_delay(began: float, now: float, publish_interval: float) -> float:
    """Seconds until the next publication of our record, the last having begun at `began`: a
    publish interval from its start, not from its end. Each publication stores our record and
    reads the peers'; counted from its end, a busy machine's slow stores and reads stretched the
    cadence (records 1.5 s apart at a 0.5 s interval) and a live peer's record looked stale to
    its peers. A publication that took longer than the interval is followed by the next after a
    quarter of it, not at once: a starved machine is not stormed with stores."""
    return max(publish_interval / 4, began + publish_interval - now)


@dataclass(frozen=True, slots=True)
class PeerProgress:
    peer_id: PeerID
    step: int  # outer step it is working on
    inner: int  # inner steps done in it
    inner_steps: int  # H
    sec_per_step: float
    time: float  # unix time of these figures
    client: bool
    settings: RunSettings | None = None  # the run settings it trains with, digest computed once; None: not said
    evals: tuple[tuple[int, float], ...] = ()  # (outer step, eval loss), oldest first (decode_evals)
    reach: str | None = None  # direct, punched or relayed (p2p/reach.py); None: not said
    # its last record: it has left the run (ProgressBook.leave). Not live, never waited for; its
    # step still says how far the run went (a late node learns that the run ended from it)
    left: bool = False

    def is_live(self, now: float, fresh_for: float) -> bool:
        """Still training: its record is fresh (younger than `fresh_for`) and not its last."""
        return not self.left and now - self.time <= fresh_for

    def finish_time(self) -> float:
        """Unix time at which it should reach H inner steps (in the past when already there)."""
        return self.time + max(0, self.inner_steps - self.inner) * self.sec_per_step


def decode_progress(subkey: Any, value: Any, id_bits: int | None = None) -> PeerProgress | None:
    """A peer's progress record, or None when it is malformed or, with `id_bits`, when its
    owner's proof of a costly id does not check out (never raises). Plans read only proven
    records: a record ahead of our step holds a node back (view.py), so each identity that can
    say so must cost something. A display of the run checks nothing (`id_bits` None)."""
    owned = proven_map(subkey, value, id_bits, unproven=lambda peer, e: _unproven.log(
        peer, "unproven", "a progress record without a proof of a costly id (%s): skipped", e))  # fmt: skip
    if owned is None:
        return None
    peer, value = owned
    step, inner, h = value.get("step"), value.get("inner"), value.get("H")
    sec, when = value.get("sec_per_step"), value.get("time")
    if not all(_int_in(x, 0, MAX_STEP) for x in (step, inner)) or not _int_in(h, 1, MAX_STEP):
        return None
    if not all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in (sec, when)):
        return None
    if not 0 <= sec <= MAX_SEC_PER_STEP:
        return None
    settings = RunSettings.decode(value.get("settings"))
    return PeerProgress(peer, step, inner, h, float(sec), float(when), value.get("client") is True, settings,
                        decode_evals(value.get("evals")), reach_of(value.get("reach")),
                        value.get("left") is True)  # fmt: skip


def decode_evals(value: Any) -> tuple[tuple[int, float], ...]:
    """A record's loss history: at most EVAL_HISTORY [step, loss] pairs, steps increasing,
    losses finite in [0, MAX_LOSS]; () when absent or malformed (a bad history is dropped, the
    record's other fields still count)."""
    if not isinstance(value, list | tuple) or len(value) > EVAL_HISTORY:
        return ()
    pairs: list[tuple[int, float]] = []
    for item in value:
        if not isinstance(item, list | tuple) or len(item) != 2:
            return ()
        step, loss = item
        if not _int_in(step, 0, MAX_STEP) or (pairs and step <= pairs[-1][0]):
            return ()
        if not isinstance(loss, int | float) or isinstance(loss, bool) or not 0.0 <= loss <= MAX_LOSS:
            return ()  # NaN fails the comparison
        pairs.append((step, float(loss)))
    return tuple(pairs)


def implausible(p: PeerProgress, *, now: float, inner_steps: int, max_step: int | None) -> str | None:
    """Why a well-formed record is still not believed (None: it is), given the run's H and the
    highest outer step the run can have reached (trust.step_horizon; None: no bound). Such
    records would hold or redirect honest nodes: a peer that claims to finish just before the
    wait ends, to be many steps ahead, or to have timed its steps in the future."""
    if p.time > now + MAX_CLOCK_SKEW:
        return f"its record is dated {p.time - now:.0f}s in the future"
    if 0 < p.sec_per_step < MIN_SEC_PER_STEP:
        return f"{p.sec_per_step:.2g}s per inner step is not plausible"
    if p.inner_steps > inner_steps:
        return f"H={p.inner_steps} exceeds the run's {inner_steps}"
    if max_step is not None and p.step > max_step:
        return f"outer step {p.step} is beyond reach (at most {max_step} by now)"
    return None


def _int_in(x: Any, low: int, high: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and low <= x <= high


@dataclass(frozen=True, slots=True)
class OwnProgress:
    """The record a node publishes about itself."""

    maddrs: list[str]
    client: bool
    step: int
    inner: int
    H: int
    sec_per_step: float
    train_loss: float | None
    eval_loss: float | None
    tokens_per_s: float | None
    group_size: int
    settings: dict[str, Any] | None = None
    evals: tuple[tuple[int, float], ...] = ()  # (outer step, eval loss): the last EVAL_HISTORY are sent
    bytes_sent: int = 0  # on the wire since the node started, all kinds together
    bytes_received: int = 0
    reach: str = "direct"  # how peers reach the node (p2p/reach.py): shown by inspect and the dashboard
    left: bool = False  # the node's last record: it has left the run (ProgressBook.leave)

    def encode(self, now: float) -> dict[str, Any]:
        value = asdict(self)
        value["evals"] = [[step, round(loss, 4)] for step, loss in self.evals[-EVAL_HISTORY:]]
        value["H"] = max(1, self.H)  # 0 while it joins a forming group; records need H >= 1
        value["sec_per_step"] = round(self.sec_per_step, 6)
        for name in ("train_loss", "eval_loss"):
            value[name] = round(value[name], 4) if value[name] is not None else None
        value["time"] = round(now, 3)
        return value


class ProgressBook:
    """`<run>/nodes`: publishes this node's progress and holds its peers' (`peers`, refreshed by
    `refresh`). A failed read keeps what was known: freshness ages the records out."""

    def __init__(self, dht: DHTNode, run_id: str, publish_interval: float) -> None:
        self.dht, self.key, self.publish_interval = dht, nodes_key(run_id), publish_interval
        self.peers: tuple[PeerProgress, ...] = ()
        self.first_read = time.time()  # set again at the first read: how long we have watched
        self._read_once = False
        self.read_ok = False  # the last read found records (ours at least, once published)
        self.run_id = run_id
        self._listed_at = -math.inf  # when we last listed our run under RUNS_KEY
        self.stored_at = -math.inf  # the time in our last record that a DHT peer accepted
        # (when, how old our record was then): each time a record of ours was stored, the age
        # the one before it had reached, over the last RENEWAL_WINDOW (renewal_gap)
        self._renewals: deque[tuple[float, float]] = deque()

    @property
    def fresh_for(self) -> float:
        """A record older than this is of a dead or stuck peer (it missed three renewals, at
        the pace ours are renewed: freshness)."""
        return freshness(self.publish_interval, self.renewal_gap)

    @property
    def renewal_gap(self) -> float:
        """The oldest our own record grew before the next one was stored, over the last
        RENEWAL_WINDOW (0.0: no two stored yet)."""
        return max((age for _, age in self._renewals), default=0.0)

    def _stored(self, stamped: float) -> None:
        """A record of ours, with time `stamped`, was accepted just now."""
        if stamped <= self.stored_at:  # a slow store of an older record (publications overlap)
            return
        done = time.time()
        if math.isfinite(self.stored_at):
            self._renewals.append((done, done - self.stored_at))
        while self._renewals and self._renewals[0][0] < done - RENEWAL_WINDOW:
            self._renewals.popleft()
        self.stored_at = stamped

    async def publish(self, own: OwnProgress) -> bool:
        """Store our record (tried again within one publish interval); False when it is stored
        nowhere, which store_or_warn has logged: the next publication tries again."""
        now = time.time()
        expiration = now + 4 * self.publish_interval + 10
        subkey = owner_subkey(self.dht.peer_id)
        value = {**own.encode(now), "proof": self.dht.id_nonce}  # what makes it count (decode_progress)
        accepted = await store_or_warn(self.dht, self.key, value, expiration, subkey, kind="progress",
                                       within=self.publish_interval)  # fmt: skip
        if accepted > 0:
            self._stored(now)
        if now - self._listed_at >= RUN_LISTING_INTERVAL:  # after the progress: peers wait on that one
            self._listed_at = now
            await self._list_run(own, now)
        return accepted > 0

    async def leave(self, own: OwnProgress) -> bool:
        """Our last record: we have left the run. Peers stop waiting for our step at their next
        read (PeerProgress.left), where they would otherwise wait until our record aged out (its
        freshness and then a grace: 20 s of a node waiting for a peer of two ranks whose rank had
        died). Only we can store it (the record is under our own subkey); one that is lost leaves
        our last live record to age out, as a killed node's does."""
        return await self.publish(dataclasses.replace(own, left=True))

    async def _list_run(self, own: OwnProgress, now: float) -> None:
        """Our run in the DHT's list of runs (RUNS_KEY): a node given a mistyped --run-id is
        told which runs exist (run_lookup.unknown_run_warning). A failure is logged by
        store_or_warn; the listing is tried again RUN_LISTING_INTERVAL later."""
        model = (own.settings or {}).get("model")
        value = {"run": self.run_id, "model": model if isinstance(model, str) else None, "step": own.step}
        expiration = now + 3 * RUN_LISTING_INTERVAL
        await store_or_warn(self.dht, RUNS_KEY, value, expiration, owner_subkey(self.dht.peer_id), kind="runs",
                            within=self.publish_interval)  # fmt: skip

    async def refresh(self) -> None:
        if not self._read_once:
            self._read_once, self.first_read = True, time.time()
        try:
            found = await self.dht.get(self.key, latest=True)
        except (P2PError, DHTError, TimeoutError) as e:
            logger.info("could not read peers' progress: %s", e)
            self.read_ok = False
            return
        # not even our own record: the DHT did not answer, which is not knowing that nobody is there
        self.read_ok = found is not None and isinstance(found.value, dict)
        if not self.read_ok:  # nothing found this time: keep what we knew (freshness ages it out)
            return
        peers = []
        for subkey, entry in found.value.items():
            progress = decode_progress(subkey, getattr(entry, "value", None), self.dht.config.id_bits)
            if progress is not None and progress.peer_id != self.dht.peer_id:
                peers.append(progress)
        self.peers = tuple(peers)
