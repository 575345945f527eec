"""EventSink: what a training node tells its watcher (the CLI's panel, metrics file and
Prometheus metrics), as dicts with "event", "time" and "peer_id". It also keeps what the node's
progress record repeats of its events: the last eval losses and the wire totals of the last
`network` event.

The events (SwarmNode's `on_event`, called on the event loop; the CLI writes them as JSON lines):
    {"event": "listening", "maddrs", "run_id"} (the host listens, the DHT is joined and the run's
     settings are checked: peers may join through these addresses; the state comes next)
    {"event": "start", "peer_id", "maddrs", "run_id", "outer_step", "parameters", "client_mode", ...}
    {"event": "progress", "outer_step", "inner_step", "inner_steps", "train_loss"}
    {"event": "outer_step", "outer_step" (completed, from 0), "train_loss", "eval_loss",
     "state_sha256" (θ_outer, momentum, step), "group_size", "matchmaking_s", "round_s", "bytes_sent",
     "part_timeout_s" (the round's bound on each wait, from our measured round times; 0 alone),
     "clipped" (contributions our robust reductions dropped or clipped, logged with the peer),
     "inner_ahead" (--overlap: the next step's inner steps done when this one's average landed),
     "inner_s", "wall_s", "eval_s" (seconds in inner steps, since training began, in evals), ...}
    {"event": "round", "outer_step", "group_size", "group_id"} (our all-reduce of that step begins; its
     outer_step event ends it, or a warning that it failed and the step is matchmade again)
    {"event": "fetch", "outer_step", "reason", "bytes", "seconds", "peers", "state_sha256", ...}
    {"event": "network", "peers_known", "connections", "dht_records", "wire_bytes_sent", ...}
    {"event": "data", "epoch", "chunks_done", "chunks", "share", "tokens", ...} (prepared data)
    {"event": "exit", "outer_step", "reason"}
Every event also has "time" (unix) and "peer_id".

`network` events come with each progress publication (the node calls `network(keeper)`), and
once more right after each outer_step and fetch event, marked `settled`: no round or fetch is
under way then, so the wire totals include exactly the bytes the events reported so far."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from swarm.node.inner_steps import InnerProgress
from swarm.node.progress import EVAL_HISTORY
from swarm.state.fetcher import FetchProgress, FetchReport
from swarm.utils.process_memory import resident_bytes

if TYPE_CHECKING:
    from swarm.state.keeper import StateKeeper

logger = logging.getLogger(__name__)

Event = dict[str, Any]


class EventSink:
    def __init__(self, peer_id: str, on_event: Callable[[Event], None] | None) -> None:
        self.peer_id = peer_id
        self.on_event = on_event or (lambda event: None)
        self._last_fetch_event = 0.0
        self._fetch_completed: tuple[int, int] | None = None  # (step, bytes) of the last 100% fetch_progress
        self._evals: collections.deque[tuple[int, float]] = collections.deque(maxlen=EVAL_HISTORY)
        self.wire_sent = 0  # host.traffic at the last `network` event
        self.wire_received = 0
        self._keeper: StateKeeper | None = None  # the node's, from its first `network` call
        self._data: dict[str, Any] | None = None  # the last `data` event's fields

    @property
    def evals(self) -> tuple[tuple[int, float], ...]:
        """(outer step completed, eval loss) of the last EVAL_HISTORY evaluations, oldest first."""
        return tuple(self._evals)

    def emit(self, kind: str, **fields: Any) -> None:
        event = {"event": kind, "time": round(time.time(), 3), "peer_id": self.peer_id, **fields}
        if kind == "outer_step" and isinstance(fields.get("eval_loss"), float):
            self._evals.append((int(fields["outer_step"]), fields["eval_loss"]))
        try:
            self.on_event(event)
        except Exception:  # a display bug must not stop training
            logger.exception("event handler failed on %s", kind)
        if kind in ("outer_step", "fetch") and self._keeper is not None:
            self.network(self._keeper, settled=True)

    def progress(self, step: int, p: InnerProgress, inner_steps: int) -> None:
        losses = p.losses[-10:]
        self.emit("progress", outer_step=step, inner_step=p.inner_done, inner_steps=inner_steps,
                  train_loss=sum(losses) / len(losses) if losses else None)  # fmt: skip

    def fetched(self, step: int, why: str, report: FetchReport, state_sha256: str) -> None:
        self.emit(
            "fetch",
            outer_step=step,
            reason=why,
            bytes=report.fetched_bytes,
            seconds=round(report.elapsed_s, 3),
            peers=len(report.bytes_by_peer),
            corrupt_peers=report.corrupt_peers,
            by_update=report.by_update,  # the previous state and the step's update, not the whole state
            state_sha256=state_sha256,
            MBps=round(report.fetched_bytes / 1e6 / report.elapsed_s, 1) if report.elapsed_s > 0 else None,
        )

    def network(self, keeper: StateKeeper, *, settled: bool = False) -> None:
        """The node's network figures now: its DHT, its connections, its bytes on the wire (all
        kinds, frame headers included) and served as state, and its memory."""
        self._keeper = keeper
        host, dht = keeper.host, keeper.dht
        self.wire_sent, self.wire_received = host.traffic.sent, host.traffic.received
        self.emit("network", settled=settled, peers_known=len(dht.table), connections=len(host.connected_peers()),
                  dht_records=len(dht.storage), wire_bytes_sent=self.wire_sent, wire_bytes_received=self.wire_received,
                  state_bytes_served=keeper.server.bytes_sent if keeper.server is not None else 0,
                  rss_bytes=resident_bytes())  # fmt: skip

    def data(self, progress: dict[str, Any]) -> None:
        """The swarm's way through its prepared data (data/progress.py's EpochProgress.wire: epoch,
        chunks_done, chunks, share, tokens, nodes, claiming), as a `data` event when it changed."""
        if progress != self._data:
            self._data = progress
            self.emit("data", **progress)

    def fetch_progress(self, progress: FetchProgress) -> None:
        """At most one event a second, and the 100% one once per fetch: the fetcher reports 100%
        when the last bytes arrive and again when the last shard is verified (a log printed both)."""
        now = time.monotonic()
        complete = progress.done_bytes >= progress.total_bytes
        if complete and self._fetch_completed == (progress.step, progress.total_bytes):
            return
        if now - self._last_fetch_event < 1.0 and not complete:
            return
        self._last_fetch_event = now
        self._fetch_completed = (progress.step, progress.total_bytes) if complete else None
        self.emit("fetch_progress", outer_step=progress.step, done_bytes=progress.done_bytes,
                  total_bytes=progress.total_bytes, MBps=round(progress.rate_MBps, 1),
                  peers=progress.peers)  # fmt: skip
