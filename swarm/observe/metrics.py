"""NodeMetrics: a training node's Prometheus metrics, fed by its events (swarm/node/events.py's list).

    metrics = NodeMetrics()                       # its own CollectorRegistry, never the global one
    node = SwarmNode(config, on_event=metrics)    # one subscriber: every event folds in
    generate_latest(metrics.registry)             # the text a scrape gets (observe/http.py serves it)

Names follow Prometheus' conventions: a `swarm_` prefix, base units (`_seconds`, `_bytes`),
counters end in `_total`. METRICS lists every family (name as scraped, type, meaning); the docs'
"Watching a run" guide has the same list, and a test checks both against a live scrape.

Bytes per kind: `allreduce` from the outer_step events (what our rounds sent and received),
`state` from the fetch events (received) and the network events (served); `other` is what the
wire carried beyond those two (DHT lookups and records, matchmaking, handshakes, frame headers),
from the host's wire totals, which the node reports every few seconds. A round's (or a fetch's)
bytes are on the wire before its event reports them, so a wire total taken meanwhile would count
them as `other`. Only consistent totals count: those the node takes right after an outer_step or
fetch event (`settled`), and those taken while it trained, which a later progress event of the
same outer step proves (no round was under way then); the others are dropped.

The data gauges follow the `data` event: the swarm's way through its prepared data, as the
node's chunk claimer reads it from the run's claim records (data/progress.py).

Errors by kind count the WARNING and ERROR lines the node logs, by the layer that logged them
(`count_logs`; one node per process: swarm-node).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.metrics_core import Metric

TIME_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
BYTE_KINDS = ("allreduce", "state", "other")
ERROR_KINDS = ("p2p", "dht", "averaging", "model", "state", "node", "other")  # the logging layer
ERROR_LEVELS = ("warning", "error")
# the `data` event's fields (data/progress.py's EpochProgress) -> their gauges
DATA_GAUGES = {"epoch": "swarm_data_epoch", "share": "swarm_data_epoch_done_ratio",
               "chunks_done": "swarm_data_epoch_chunks_done", "chunks": "swarm_data_chunks",
               "tokens": "swarm_data_epoch_tokens"}  # fmt: skip

# name as scraped -> (type, meaning). Counters' names end in _total; the Info adds _info.
METRICS: dict[str, tuple[str, str]] = {
    "swarm_node_info": ("info", "labels: peer_id, run_id, model, device, client_mode"),
    "swarm_outer_step": ("gauge", "outer steps done: the swarm's steps this node's state has (it trains the next)"),
    "swarm_inner_step": ("gauge", "inner steps done in the current outer step"),
    "swarm_outer_steps_total": ("counter", "outer steps this node completed"),
    "swarm_inner_steps_total": ("counter", "inner steps this node trained"),
    "swarm_tokens_total": ("counter", "tokens this node trained on"),
    "swarm_train_loss": ("gauge", "mean train loss of the last inner steps"),
    "swarm_eval_loss": ("gauge", "eval loss after the last evaluated outer step"),
    "swarm_tokens_per_second": ("gauge", "tokens trained per second of wall time since the node started"),
    "swarm_utilization_ratio": ("gauge", "seconds in inner steps / wall seconds since the node started"),
    "swarm_group_size": ("gauge", "members of the last outer step's group (1: it stepped alone)"),
    "swarm_round_seconds": ("histogram", "duration of each all-reduce round"),
    "swarm_matchmaking_seconds": ("histogram", "time spent forming each outer step's group"),
    "swarm_sent_bytes_total": ("counter", "bytes sent, by kind: allreduce, state (served), other (DHT, ...)"),
    "swarm_received_bytes_total": ("counter", "bytes received, by kind: allreduce, state (fetched), other"),
    "swarm_peers_known": ("gauge", "peers in the DHT routing table"),
    "swarm_connections": ("gauge", "peers with an open connection"),
    "swarm_dht_records": ("gauge", "DHT records this node stores for the swarm"),
    "swarm_state_fetches_total": ("counter", "states fetched from peers (joining, or catching up)"),
    "swarm_state_fetch_seconds": ("histogram", "duration of each state fetch"),
    "swarm_state_fetch_bytes_per_second": ("gauge", "rate of the last state fetch"),
    "swarm_state_rejected_peers_total": ("counter", "peers whose shards failed verification in our fetches"),
    "swarm_contributions_clipped_total": ("counter", "contributions our robust reductions dropped or clipped"),
    "swarm_errors_total": ("counter", "WARNING and ERROR log lines, by kind (the layer) and level"),
    "swarm_resident_memory_bytes": ("gauge", "resident memory of the node's process"),
    "swarm_data_epoch": ("gauge", "prepared data: the epoch the swarm trains, from the chunk claims (from 0)"),
    "swarm_data_epoch_done_ratio": ("gauge", "prepared data: the share of the epoch's chunks trained, 0..1"),
    "swarm_data_epoch_chunks_done": ("gauge", "prepared data: the epoch's chunks trained"),
    "swarm_data_chunks": ("gauge", "prepared data: the chunks of one epoch (0: the built-in corpus, no chunks)"),
    "swarm_data_epoch_tokens": ("gauge", "prepared data: the tokens the swarm trained in the epoch"),
}


def _help(name: str) -> str:
    return METRICS[name][1]


class NodeMetrics:
    """The metrics of one node in a registry of their own. Call it with each event (on the
    event loop); unknown events and fields are ignored, and a malformed field never raises."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()  # what a scrape reads
        r = CollectorRegistry()  # the metrics themselves, exposed through _WithoutCreated
        self.registry.register(_WithoutCreated(r))
        self.info = Info("swarm_node", _help("swarm_node_info"), registry=r)
        self.outer_step = Gauge("swarm_outer_step", _help("swarm_outer_step"), registry=r)
        self.inner_step = Gauge("swarm_inner_step", _help("swarm_inner_step"), registry=r)
        self.outer_steps = Counter("swarm_outer_steps", _help("swarm_outer_steps_total"), registry=r)
        self.inner_steps = Counter("swarm_inner_steps", _help("swarm_inner_steps_total"), registry=r)
        self.tokens = Counter("swarm_tokens", _help("swarm_tokens_total"), registry=r)
        self.train_loss = Gauge("swarm_train_loss", _help("swarm_train_loss"), registry=r)
        self.eval_loss = Gauge("swarm_eval_loss", _help("swarm_eval_loss"), registry=r)
        self.tokens_per_s = Gauge("swarm_tokens_per_second", _help("swarm_tokens_per_second"), registry=r)
        self.utilization = Gauge("swarm_utilization_ratio", _help("swarm_utilization_ratio"), registry=r)
        self.group_size = Gauge("swarm_group_size", _help("swarm_group_size"), registry=r)
        self.round_s = Histogram("swarm_round_seconds", _help("swarm_round_seconds"), buckets=TIME_BUCKETS,
                                 registry=r)  # fmt: skip
        self.matchmaking_s = Histogram("swarm_matchmaking_seconds", _help("swarm_matchmaking_seconds"),
                                       buckets=TIME_BUCKETS, registry=r)  # fmt: skip
        self.sent = Counter("swarm_sent_bytes", _help("swarm_sent_bytes_total"), ["kind"], registry=r)
        self.received = Counter("swarm_received_bytes", _help("swarm_received_bytes_total"), ["kind"], registry=r)
        self.peers_known = Gauge("swarm_peers_known", _help("swarm_peers_known"), registry=r)
        self.connections = Gauge("swarm_connections", _help("swarm_connections"), registry=r)
        self.dht_records = Gauge("swarm_dht_records", _help("swarm_dht_records"), registry=r)
        self.fetches = Counter("swarm_state_fetches", _help("swarm_state_fetches_total"), registry=r)
        self.fetch_s = Histogram("swarm_state_fetch_seconds", _help("swarm_state_fetch_seconds"),
                                 buckets=TIME_BUCKETS, registry=r)  # fmt: skip
        self.fetch_rate = Gauge("swarm_state_fetch_bytes_per_second", _help("swarm_state_fetch_bytes_per_second"),
                                registry=r)  # fmt: skip
        self.rejected = Counter("swarm_state_rejected_peers", _help("swarm_state_rejected_peers_total"), registry=r)
        self.clipped = Counter("swarm_contributions_clipped", _help("swarm_contributions_clipped_total"), registry=r)
        self.errors = Counter("swarm_errors", _help("swarm_errors_total"), ["kind", "level"], registry=r)
        self.rss = Gauge("swarm_resident_memory_bytes", _help("swarm_resident_memory_bytes"), registry=r)
        self.data = {key: Gauge(name, _help(name), registry=r) for key, name in DATA_GAUGES.items()}
        for kind in BYTE_KINDS:  # every series exists from the start: rate() sees its first increase
            self.sent.labels(kind)
            self.received.labels(kind)
        for kind in ERROR_KINDS:
            for level in ERROR_LEVELS:
                self.errors.labels(kind, level)
        self._totals: dict[str, float] = {}  # the cumulative figures events report, as last seen
        self._step_inner = 0  # inner steps of the current outer step already counted
        self._position: tuple[int, int] | None = None  # (outer step, inner step) of the last progress event
        # wire totals taken during the outer step at `position`: (position, sent, received, state served by then)
        self._unsettled: deque[tuple[tuple[int, int], float, float, float]] = deque(maxlen=64)
        self._handlers = {"start": self._start, "progress": self._progress, "outer_step": self._outer_step,
                          "fetch": self._fetch, "network": self._network, "data": self._data}  # fmt: skip

    def __call__(self, event: dict[str, Any]) -> None:
        handler = self._handlers.get(str(event.get("event")))
        if handler is not None:
            handler(event)

    def count_logs(self, logger: logging.Logger) -> logging.Handler:
        """Count the WARNING and ERROR records `logger` (and its children) emit from now on;
        returns the handler, for `logger.removeHandler` at the end."""
        handler = _ErrorCounter(self.errors)
        logger.addHandler(handler)
        return handler

    # --- events ---------------------------------------------------------------------------------

    def _start(self, e: dict[str, Any]) -> None:
        labels = ("peer_id", "run_id", "model", "device", "client_mode")
        self.info.info({k: str(e.get(k, "")).lower() if k == "client_mode" else str(e.get(k, "")) for k in labels})
        _set(self.outer_step, e.get("outer_step"))

    def _progress(self, e: dict[str, Any]) -> None:
        _set(self.outer_step, e.get("outer_step"))
        _set(self.train_loss, e.get("train_loss"))
        inner, step = _number(e.get("inner_step")), _number(e.get("outer_step"))
        if inner is not None:
            self.inner_step.set(inner)
            self._count_inner(int(inner))
            if step is not None:
                self._position = (int(step), int(inner))
                self._settle(self._position)

    def _outer_step(self, e: dict[str, Any]) -> None:
        step = _number(e.get("outer_step"))
        if step is not None:
            self.outer_step.set(step + 1)
        self.outer_steps.inc()
        self._count_inner(int(_number(e.get("inner_done")) or 0))
        self._step_inner = 0
        self.inner_step.set(0)
        for gauge, key in ((self.train_loss, "train_loss"), (self.eval_loss, "eval_loss"),
                           (self.tokens_per_s, "tokens_per_s"), (self.group_size, "group_size"),
                           (self.rss, "rss_bytes")):  # fmt: skip
            _set(gauge, e.get(key))
        inner_s, wall_s = _number(e.get("inner_s")), _number(e.get("wall_s"))
        if inner_s is not None and wall_s:
            self.utilization.set(min(1.0, inner_s / wall_s))
        self._advance(self.tokens, "tokens", e.get("tokens"))
        _observe(self.matchmaking_s, e.get("matchmaking_s"))
        if e.get("group_id") is not None:
            _observe(self.round_s, e.get("round_s"))
        self._add(self.sent.labels("allreduce"), "sent_allreduce", e.get("bytes_sent"))
        self._add(self.received.labels("allreduce"), "received_allreduce", e.get("bytes_received"))
        _inc(self.clipped, e.get("clipped"))
        self._position = None
        self._unsettled.clear()  # taken before or during the round: the settled total that follows counts

    def _fetch(self, e: dict[str, Any]) -> None:
        _set(self.outer_step, e.get("outer_step"))
        self._step_inner = 0  # a new state: its inner steps start from 0 (the old ones were counted)
        self.fetches.inc()
        self._add(self.received.labels("state"), "received_state", e.get("bytes"))
        seconds, nbytes = _number(e.get("seconds")), _number(e.get("bytes"))
        _observe(self.fetch_s, seconds)
        if seconds and nbytes is not None:
            self.fetch_rate.set(nbytes / seconds)
        corrupt = e.get("corrupt_peers")
        if isinstance(corrupt, list):
            self.rejected.inc(len(corrupt))
        self._position = None
        self._unsettled.clear()

    def _network(self, e: dict[str, Any]) -> None:
        for gauge, key in ((self.peers_known, "peers_known"), (self.connections, "connections"),
                           (self.dht_records, "dht_records"), (self.rss, "rss_bytes")):  # fmt: skip
            _set(gauge, e.get(key))
        self._advance(self.sent.labels("state"), "sent_state", e.get("state_bytes_served"))
        sent, received = _number(e.get("wire_bytes_sent")), _number(e.get("wire_bytes_received"))
        if sent is None or received is None:
            return
        served = self._totals.get("sent_state", 0.0)
        if e.get("settled") is True:
            self._count_other(sent, received, served)
        elif self._position is not None:  # counted once a later progress event shows it trained meanwhile
            self._unsettled.append((self._position, sent, received, served))

    def _data(self, e: dict[str, Any]) -> None:
        for key, gauge in self.data.items():
            _set(gauge, e.get(key))

    def _settle(self, now: tuple[int, int]) -> None:
        """Count the wire totals taken earlier in the outer step `now` is in, at fewer inner steps."""
        while self._unsettled and self._unsettled[0][0][0] != now[0]:
            self._unsettled.popleft()  # another outer step's: a round may have been under way
        while self._unsettled and self._unsettled[0][0][1] < now[1]:
            _, sent, received, served = self._unsettled.popleft()
            self._count_other(sent, received, served)

    def _count_other(self, sent: float, received: float, served: float) -> None:
        """`other`: what consistent wire totals carried beyond the kinds the events reported."""
        t = self._totals
        self._advance(self.sent.labels("other"), "sent_other", sent - served - t.get("sent_allreduce", 0.0))
        self._advance(self.received.labels("other"), "received_other",
                      received - t.get("received_allreduce", 0.0) - t.get("received_state", 0.0))  # fmt: skip

    # --- helpers --------------------------------------------------------------------------------

    def _count_inner(self, inner: int) -> None:
        if inner > self._step_inner:
            self.inner_steps.inc(inner - self._step_inner)
            self._step_inner = inner

    def _advance(self, counter: Any, key: str, total: Any) -> None:
        """Move a counter up to a cumulative figure an event reports (never down)."""
        value = _number(total)
        if value is None:
            return
        last = self._totals.get(key, 0.0)
        if value > last:
            counter.inc(value - last)
            self._totals[key] = value

    def _add(self, counter: Any, key: str, amount: Any) -> None:
        """Add an event's amount to a counter and to its running total (_totals)."""
        value = _number(amount)
        if value is not None and value > 0:
            counter.inc(value)
            self._totals[key] = self._totals.get(key, 0.0) + value


class _WithoutCreated:
    """The families of a registry without their `_created` samples: in the text format they
    read as one more gauge per counter and histogram, which nobody here needs."""

    def __init__(self, inner: CollectorRegistry) -> None:
        self.inner = inner

    def collect(self) -> Iterator[Metric]:
        for family in self.inner.collect():  # fresh objects on every collect: ours to trim
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class _ErrorCounter(logging.Handler):
    def __init__(self, errors: Counter) -> None:
        super().__init__(logging.WARNING)
        self.errors = errors

    def emit(self, record: logging.LogRecord) -> None:
        parts = record.name.split(".")
        kind = parts[1] if len(parts) >= 2 and parts[1] in ERROR_KINDS else "node" if parts[0] == "swarm" else "other"
        self.errors.labels(kind, "error" if record.levelno >= logging.ERROR else "warning").inc()


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _set(gauge: Gauge, value: Any) -> None:
    number = _number(value)
    if number is not None:
        gauge.set(number)


def _inc(counter: Counter, value: Any) -> None:
    number = _number(value)
    if number is not None and number > 0:
        counter.inc(number)


def _observe(histogram: Histogram, value: Any) -> None:
    number = _number(value)
    if number is not None and number >= 0:
        histogram.observe(number)
