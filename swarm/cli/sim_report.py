"""What swarm-sim knows about each node, and how it shows it: the live table (rich, on a
terminal), plain log lines (otherwise), the metrics JSON and the loss plot.

A node reports through its `--metrics-file` (JSON lines, see swarm-node's help): one "start",
"progress" events while it trains, one "outer_step" per completed outer step, one "exit".
`NodeRecord.apply` folds those events into what the table shows and what the JSON keeps; the
simulator adds what only it knows (the node was killed, or exited with a code).

The metrics JSON:

    {"run_id", "model", "nodes_started", "outer_steps", "inner_steps", "batch_size", "seq_len",
     "compression", "wall_s", "interrupted", "bootstrap_link",
     "nodes": [{"name", "peer_id", "joined_at_step", "status", "exit_code", "link", "reach",
                "steps": [{"outer_step", "train_loss", "eval_loss", "state_sha256",
                           "group_size", "bytes_sent", "group_id", "tokens_per_s"}]}]}

joined_at_step is the first outer step the node trained: the step of its "start" event, or
the step whose state it fetched from peers before its first outer step (a newcomer catching up).
train_loss is null for a round whose loss the node did not report; eval_loss for a step it
did not evaluate (see swarm-node --eval-every); group_id is null for a node that averaged alone.
reach is how peers reached the node when it started: direct, punched (behind a NAT that hole
punching gets through) or relayed (only through its relay: it owns no part of the averages).
link is {"rate": "50mbit", "address": "10.77.0.2"} for a node on a shaped link (swarm-sim --link),
null on 127.0.0.1; bootstrap_link is the bootstrap's rate, or null.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import click

from swarm.utils.atomic import write_atomic

if TYPE_CHECKING:  # rich is imported only for a terminal
    from rich.table import Table

logger = logging.getLogger(__name__)

STEP_KEYS = ("outer_step", "train_loss", "eval_loss", "state_sha256", "group_size", "bytes_sent")
EXTRA_STEP_KEYS = ("group_id", "tokens_per_s", "matchmaking_s")  # kept too: who averaged together, how fast

# status of a node, as the table shows it; "cancelled": a newcomer stopped before it started,
# because the swarm had finished meanwhile
STARTING, ALIVE, DONE, KILLED, FAILED, STOPPED = "starting", "alive", "done", "killed", "failed", "stopped"
CANCELLED = "cancelled"
STRANDED = "stranded"  # still behind when every node that finished had left: stopped, nothing to catch up with


@dataclass(slots=True)
class NodeRecord:
    """One node of the simulated swarm: its latest figures and its completed outer steps."""

    name: str  # "node0", "node1", ... in start order
    log: Path  # the node's stdout and stderr
    status: str = STARTING
    peer_id: str | None = None
    joined_at_step: int | None = None
    outer_step: int | None = None  # the last completed outer step
    fetched_step: int | None = None  # the outer step of the last state it fetched
    inner_step: int = 0  # inner steps done in the current round
    inner_steps: int = 0  # H
    train_loss: float | None = None
    eval_loss: float | None = None
    group_size: int | None = None
    tokens_per_s: float | None = None
    state_sha256: str | None = None
    exit_code: int | None = None
    exit_reason: str | None = None
    link: str | None = None  # "50mbit": its shaped link each way (swarm-sim --link); None on 127.0.0.1
    address: str | None = None  # its address on that link
    reach: str | None = None  # at its start: direct, punched or relayed (swarm/p2p/reach.py)
    steps: list[dict[str, Any]] = field(default_factory=list)

    @property
    def started(self) -> bool:
        return self.peer_id is not None

    def apply(self, event: dict[str, Any]) -> str | None:
        """Fold one metrics event in; returns a log line worth printing, or None."""
        kind = event.get("event")
        if kind == "start":
            self.peer_id = str(event.get("peer_id"))
            self.joined_at_step = _int(event.get("outer_step"))
            self.status = ALIVE
            reach = event.get("reach")
            self.reach = reach if isinstance(reach, str) and len(reach) <= 16 else None
            how = f", reached {self.reach}" if self.reach not in (None, "direct") else ""
            return f"{self.label()} started at outer step {self.joined_at_step}{how}"
        if kind == "progress":
            self.inner_step = _int(event.get("inner_step")) or 0
            self.inner_steps = _int(event.get("inner_steps")) or self.inner_steps
            self.train_loss = _float(event.get("train_loss"))
            return None
        if kind == "outer_step":
            return self._outer_step(event)
        if kind == "fetch":  # state exchange: a newcomer, or a node that fell behind, caught up
            self.fetched_step = _int(event.get("outer_step"))
            if not self.steps:  # a newcomer joins the swarm at the step it fetched, not at its own 0
                self.joined_at_step = _int(event.get("outer_step"))
            size = (_int(event.get("bytes")) or 0) / 1e6
            how = "its step's update" if event.get("by_update") else "the state"
            return (
                f"{self.label()} fetched {how} of outer step {event.get('outer_step')} "
                f"({size:.1f} MB from {event.get('peers')} peer(s), {event.get('reason')})"
            )
        if kind == "exit":
            self.exit_reason = str(event.get("reason"))
            return f"{self.label()} exiting with {event.get('outer_step')} outer steps done: {self.exit_reason}"
        return None  # an event kind this simulator does not know: newer nodes may add some

    def _outer_step(self, event: dict[str, Any]) -> str:
        step = {key: event.get(key) for key in (*STEP_KEYS, *EXTRA_STEP_KEYS)}
        self.steps.append(step)
        self.outer_step = _int(step["outer_step"])
        self.train_loss = _float(step["train_loss"])
        self.eval_loss = _float(step["eval_loss"])
        self.state_sha256 = str(step["state_sha256"])
        self.group_size = _int(step["group_size"])
        self.tokens_per_s = _float(event.get("tokens_per_s"))
        self.inner_step = 0
        return (
            f"{self.label()} outer step {self.outer_step} done ({self.steps_done} done): train {_num(self.train_loss)} "
            f"eval {_num(self.eval_loss)} group {self.group_size} tok/s {_num(self.tokens_per_s, 0)} "
            f"state {_short_hash(self.state_sha256)}"
        )

    def holds_final_state(self, outer_steps: int) -> bool:
        """It completed the last outer step, or fetched the state after it: a newcomer that
        arrives as the run ends holds the final state without stepping."""
        stepped = self.outer_step is not None and self.outer_step >= outer_steps - 1
        return stepped or (self.fetched_step is not None and self.fetched_step >= outer_steps)

    @property
    def steps_done(self) -> int | None:
        """Outer steps done: after its last completed step (0-based), or at the state it fetched or
        started from, whichever is further; None before it started."""
        known = [s for s in (None if self.outer_step is None else self.outer_step + 1, self.fetched_step,
                             self.joined_at_step) if s is not None]  # fmt: skip
        return max(known) if known else None

    def label(self) -> str:
        return f"{self.name} ({short_peer(self.peer_id)})" if self.peer_id else self.name

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "peer_id": self.peer_id,
            "joined_at_step": self.joined_at_step,
            "status": self.status,
            "exit_code": self.exit_code,
            "link": None if self.link is None else {"rate": self.link, "address": self.address},
            "reach": self.reach,
            "steps": self.steps,
        }


class EventTail:
    """Reads the complete lines a node has appended to its metrics file since the last read.

    A line still being written (no newline yet) waits for the next read; a line that is not a
    JSON object is logged and skipped, so a torn write cannot stop the simulator.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:  # the node has not opened it yet
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        return [event for line in lines if (event := _parse(line, self.path)) is not None]


def _parse(line: bytes, path: Path) -> dict[str, Any] | None:
    if not line.strip():
        return None
    try:
        event = json.loads(line)
    except ValueError:
        logger.warning("skipping a malformed line in %s: %r", path, line[:200])
        return None
    return event if isinstance(event, dict) else None


# --- display --------------------------------------------------------------------------------

# "steps done": outer steps completed, the number swarm-node's log, panel and exit line, inspect,
# the dashboard and the swarm_outer_step metric show for a node (a node at "7 done" trains step 7)
COLUMNS = ("node", "peer", "steps done", "inner", "train loss", "eval loss", "group", "tok/s", "state", "status")


class Display(Protocol):
    def event(self, line: str, *, routine: bool = False) -> None:
        """A line worth showing; routine ones (an outer step) only where no table shows them."""

    def refresh(self, records: Sequence[NodeRecord]) -> None:
        """The latest figures of every node."""


class PlainDisplay:
    """Log lines on stdout (piped output, CI logs): every start, outer step, kill, join, exit."""

    def __init__(self) -> None:
        self.began = time.monotonic()

    def event(self, line: str, *, routine: bool = False) -> None:
        click.echo(f"[{time.monotonic() - self.began:7.1f}s] {line}")
        sys.stdout.flush()

    def refresh(self, records: Sequence[NodeRecord]) -> None:
        pass  # the outer-step lines carry the figures


class LiveDisplay:
    """One rich table redrawn in place; the rare events (start, kill, join, exit) print above it."""

    def __init__(self, title: str) -> None:
        from rich.live import Live

        self.title = title
        self.live = Live(rich_table([], title), refresh_per_second=4, transient=False)

    def __enter__(self) -> LiveDisplay:
        self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.stop()

    def event(self, line: str, *, routine: bool = False) -> None:
        if not routine:
            from rich.text import Text

            self.live.console.print(Text(line))

    def refresh(self, records: Sequence[NodeRecord]) -> None:
        self.live.update(rich_table(records, self.title))


@contextlib.contextmanager
def open_display(title: str) -> Iterator[Display]:
    """The live table on a terminal, log lines otherwise."""
    if sys.stdout.isatty():
        with LiveDisplay(title) as live:
            yield live
    else:
        yield PlainDisplay()


def table_rows(records: Sequence[NodeRecord]) -> list[tuple[str, ...]]:
    """One row of text per node, in COLUMNS order."""
    return [
        (
            r.name if r.link is None else f"{r.name} {r.link}",
            short_peer(r.peer_id),
            "-" if r.steps_done is None else str(r.steps_done),
            f"{r.inner_step}/{r.inner_steps}" if r.inner_steps else "-",
            _num(r.train_loss),
            _num(r.eval_loss),
            "-" if r.group_size is None else str(r.group_size),
            _num(r.tokens_per_s, 0),
            _short_hash(r.state_sha256),
            r.status,
        )
        for r in records
    ]


def rich_table(records: Sequence[NodeRecord], title: str) -> Table:
    from rich.table import Table
    from rich.text import Text

    table = Table(*COLUMNS, title=title)
    for row in table_rows(records):
        table.add_row(*(Text(cell) for cell in row))  # Text, never markup
    return table


def short_peer(peer_id: str | None) -> str:
    """The tail of a PeerID: every Ed25519 PeerID starts with the same '12D3KooW'."""
    return "-" if not peer_id else "…" + peer_id[-6:]


def _short_hash(digest: str | None) -> str:
    return "-" if not digest else digest[:8]


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


# --- files ----------------------------------------------------------------------------------


def write_metrics(path: Path, records: Sequence[NodeRecord], header: dict[str, Any]) -> None:
    """The metrics JSON, written whole or not at all (temp file, then rename). Nodes that were
    stopped before they reported their start have no PeerID and are left out."""
    doc = {**header, "nodes": [r.to_json() for r in records if r.started]}
    write_atomic(path, (json.dumps(doc, indent=1) + "\n").encode())


def write_plot(path: Path, records: Sequence[NodeRecord], title: str) -> None:
    """Train (solid) and eval (dashed) loss of every node against the outer step (loss_figure),
    as a PNG."""
    from matplotlib import pyplot as plt

    fig = loss_figure(records, title)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)


def loss_figure(records: Sequence[NodeRecord], title: str) -> Any:
    """The loss of every node against the outer step, one colour per node, ticks on whole steps
    (matplotlib's own chose fractions of a step). matplotlib is imported here, on the Agg
    backend: no display needed, and the command starts without it."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, record in enumerate(r for r in records if r.steps):
        color = colors[i % len(colors)]
        _plot_series(ax, record, "train_loss", color, "-", f"{record.label()} train")
        _plot_series(ax, record, "eval_loss", color, "--", f"{record.label()} eval")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("outer step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small")
    return fig


def _plot_series(ax: Any, record: NodeRecord, key: str, color: str, style: str, label: str) -> None:
    points = [(s["outer_step"], s[key]) for s in record.steps if isinstance(s.get(key), int | float)]
    if points:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, linestyle=style, marker="o", markersize=3, color=color, label=label)


def loss_summary(records: Sequence[NodeRecord]) -> str:
    """The swarm's eval loss (mean over the nodes that reported it) at its first and last outer
    step, for the closing line."""
    by_step: dict[int, list[float]] = {}
    for record in records:
        for step in record.steps:
            loss, number = _float(step.get("eval_loss")), _int(step.get("outer_step"))
            if loss is not None and number is not None and math.isfinite(loss):
                by_step.setdefault(number, []).append(loss)
    if not by_step:
        return "no eval loss reported"
    first, last = min(by_step), max(by_step)
    mean = {n: sum(v) / len(v) for n, v in by_step.items()}
    return f"eval loss {mean[first]:.3f} at outer step {first} -> {mean[last]:.3f} at outer step {last}"
