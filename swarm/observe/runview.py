"""RunView: what the dashboard shows of a run, folded from the run's DHT records (pure, no I/O).

    view = RunView("demo")
    view.update(nodes=[(subkey, value), ...], holders=[(subkey, value), ...], now=time.time(),
                data=read_progress(chunk_entries, ...))   # data/progress.py; None: no prepared data
    view.snapshot()   # the JSON the page draws: settings, nodes, loss curve, throughput, holders,
                      # bytes, and the swarm's way through its data

The records are peers' input: the core fields go through progress.decode_progress and
holders.decode_holder (a malformed record is skipped), the chunk claims through
data/progress.read_progress before they get here (the dashboard decodes them in a thread),
display fields are shown only when they are numbers in range, and every list the view keeps is
bounded. What
the records cannot say, the view remembers across updates: the loss curve past each record's
last EVAL_HISTORY points, the swarm's throughput over time, and the bytes moved by nodes that
have since left.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Any

from swarm.data.progress import EpochProgress
from swarm.node.progress import PeerProgress, decode_progress
from swarm.node.settings import run_settings
from swarm.p2p.reach import reach_of
from swarm.state.holders import decode_holder

MAX_NODES_SHOWN = 500  # rows of the node table (the most advanced first)
MAX_CURVE_POINTS = 2048  # outer steps of the loss curve kept (the latest)
MAX_THROUGHPUT_POINTS = 1800  # one per update: an hour at the default 2 s
MAX_PEERS_REMEMBERED = 4096  # whose bytes moved are remembered after they left
MAX_BYTES = 1 << 62
MAX_TOKENS_PER_S = 1e12


class RunView:
    """The dashboard's state of one run: `update` with each read of the DHT, `snapshot` to draw."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.nodes: list[dict[str, Any]] = []
        self.settings: dict[str, Any] | None = None
        self.holders: list[dict[str, Any]] = []
        self.curve: dict[int, float] = {}  # outer step -> the run's eval loss (median over its nodes)
        self.throughput: deque[tuple[float, float]] = deque(maxlen=MAX_THROUGHPUT_POINTS)
        self.moved: OrderedDict[str, tuple[int, int]] = OrderedDict()  # peer -> (sent, received), last seen
        self.updated: float | None = None  # unix time of the last successful read
        self.error: str | None = None  # why the last read failed (None: it did not)
        self.data: EpochProgress | None = None  # the swarm's way through its prepared data

    def update(self, nodes: Iterable[tuple[Any, Any]], holders: Iterable[tuple[Any, Any]], now: float,
               data: EpochProgress | None = None) -> None:  # fmt: skip
        """Fold in one read of `<run>/nodes` and `<run>/state` (subkey, value) entries, and the
        progress read from `<run>/chunks`."""
        rows: list[dict[str, Any]] = []
        peers: list[PeerProgress] = []
        for subkey, value in nodes:
            progress = decode_progress(subkey, value)
            if progress is None:
                continue
            peers.append(progress)
            rows.append(_node_row(progress, value, now))
            sent, received = rows[-1]["bytes_sent"], rows[-1]["bytes_received"]
            self._remember_bytes(rows[-1]["peer_id"], sent, received)
        rows.sort(key=lambda r: (-r["step"], -r["inner"], r["peer_id"]))
        self.nodes = rows[:MAX_NODES_SHOWN]
        settings = run_settings([(p.peer_id, p.settings) for p in peers], frozenset())
        self.settings = settings.wire() if settings is not None else None
        self._fold_curve(peers)
        self.throughput.append((round(now, 3), round(sum(r["tokens_per_s"] or 0.0 for r in rows), 1)))
        decoded = (decode_holder(subkey, value) for subkey, value in holders)
        self.holders = sorted(
            ({"peer_id": str(h.peer_id), "step": h.step, "manifest": h.manifest[:12], "bytes": max(0, h.nbytes)}
             for h in decoded if h is not None), key=lambda h: (-h["step"], h["peer_id"]),
        )[:MAX_NODES_SHOWN]  # fmt: skip
        self.data = data
        self.updated, self.error = now, None

    def failed(self, reason: str) -> None:
        """A read that failed: the view keeps what it knew and says why it is not newer."""
        self.error = reason[:300]

    def snapshot(self) -> dict[str, Any]:
        sent = sum(s for s, _ in self.moved.values())
        received = sum(r for _, r in self.moved.values())
        return {
            "run_id": self.run_id,
            "updated": self.updated,
            "error": self.error,
            "step": max((r["step"] for r in self.nodes), default=None),
            "settings": self.settings or {},
            "nodes": self.nodes,
            "curve": [[step, loss] for step, loss in sorted(self.curve.items())],
            "throughput": [list(point) for point in self.throughput],
            "holders": self.holders,
            "bytes": {"sent": sent, "received": received, "nodes": len(self.moved)},
            "data": self.data.wire() if self.data is not None else None,
        }

    def _fold_curve(self, peers: list[PeerProgress]) -> None:
        by_step: dict[int, list[float]] = {}
        for p in peers:
            for step, loss in p.evals:
                by_step.setdefault(step, []).append(loss)
        for step, losses in by_step.items():
            self.curve[step] = round(statistics.median(losses), 4)
        if len(self.curve) > MAX_CURVE_POINTS:
            for step in sorted(self.curve)[: len(self.curve) - MAX_CURVE_POINTS]:
                del self.curve[step]

    def _remember_bytes(self, peer: str, sent: int, received: int) -> None:
        self.moved[peer] = (sent, received)
        self.moved.move_to_end(peer)
        while len(self.moved) > MAX_PEERS_REMEMBERED:
            self.moved.popitem(last=False)


def _node_row(p: PeerProgress, value: dict[str, Any], now: float) -> dict[str, Any]:
    maddrs = value.get("maddrs")
    first = maddrs[0] if isinstance(maddrs, list) and maddrs and isinstance(maddrs[0], str) else ""
    return {
        "peer_id": str(p.peer_id),
        "step": p.step,
        "inner": min(p.inner, p.inner_steps),
        "H": p.inner_steps,
        "progress": round(min(1.0, p.inner / p.inner_steps), 3),
        "train_loss": _loss(value.get("train_loss")),
        "eval_loss": _loss(value.get("eval_loss")),
        "tokens_per_s": _number(value.get("tokens_per_s"), MAX_TOKENS_PER_S),
        "group_size": _count(value.get("group_size"), 1 << 20),
        "client": p.client,
        "reach": reach_of(value.get("reach")),
        "last_seen_s": round(max(0.0, now - p.time), 1),
        "left": p.left,  # its last record: it left the run
        "maddr": first[:200],
        "bytes_sent": _count(value.get("bytes_sent"), MAX_BYTES),
        "bytes_received": _count(value.get("bytes_received"), MAX_BYTES),
    }


def _number(value: Any, high: float) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value) if 0 <= value <= high else None


def _loss(value: Any) -> float | None:
    number = _number(value, 1e6)
    return round(number, 4) if number is not None else None


def _count(value: Any, high: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= high else 0
