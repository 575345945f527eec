"""What swarm-node shows while it trains: a live panel on a terminal, plain log lines otherwise.
Both read the node's events (swarm/node/node.py), the same ones --metrics-file records."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import click

from swarm.node.config import NodeConfig
from swarm.node.settings import join_flags

if TYPE_CHECKING:
    from swarm.node import Event


def _fmt(value: Any, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.2f} MB"


def _peers(n: Any) -> str:
    return f"{n} peer" if n == 1 else f"{n} peers"


class PlainLines:
    """One line per outer step on stderr (output is not a terminal: logs, CI, swarm-sim)."""

    def __call__(self, event: Event) -> None:
        kind = event["event"]
        if kind == "outer_step":
            line = (
                f"outer step {event['outer_step']} done ({event['outer_step'] + 1} outer steps done): "
                f"train loss {_fmt(event['train_loss'])}, "
                f"eval loss {_fmt(event['eval_loss'])}, group of {event['group_size']}, "
                f"sent {_mb(event['bytes_sent'])}, received {_mb(event['bytes_received'])}, "
                f"{event['tokens_per_s']:.0f} tokens/s, state {event['state_sha256'][:12]}"
            )
        elif kind == "exit":
            line = summary_line(event, {})
        elif kind in ("resume", "fetch", "fetch_progress"):
            line = state_line(event)
        else:
            return
        click.echo(f"{time.strftime('%H:%M:%S')} swarm-node: {line}", err=True)

    def banner(self, lines: list[str]) -> None:
        """The node's identity and join line, on stdout."""
        for line in lines:
            click.echo(line, color=False)

    def close(self) -> None:
        pass


def state_line(event: Event) -> str:
    """A resume, fetch or fetch-progress event in words."""
    kind = event["event"]
    if kind == "resume":
        return f"resumed from the checkpoint of outer step {event['outer_step']} in {event['checkpoint_dir']}"
    if kind == "fetch":
        what = "the update to the swarm's state" if event.get("by_update") else "the swarm's state"
        return (
            f"fetched {what} of outer step {event['outer_step']} ({event['reason']}): "
            f"{_mb(event['bytes'])} from {_peers(event['peers'])} in {event['seconds']:.2f}s ({event['MBps']} MB/s)"
        )
    return (
        f"fetching the state of outer step {event['outer_step']}: {_mb(event['done_bytes'])} of "
        f"{_mb(event['total_bytes'])} at {event['MBps']} MB/s from {_peers(event['peers'])}"
    )


class LivePanel:
    """A rich Live panel: outer step, the inner-step bar, the node's running time, losses,
    throughput, group, traffic; at exit, one summary line that stays. `console` and `clock`
    (seconds, monotonic) are the terminal's and time.monotonic unless a test gives its own."""

    def __init__(self, console: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        from rich.console import Console
        from rich.live import Live
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.progress = Progress(
            TextColumn("{task.fields[step]} outer steps done, inner steps of the next"),
            BarColumn(),
            MofNCompleteColumn(),
            _running_time(clock),
            get_time=clock,
        )
        self.task = self.progress.add_task("inner", total=1, step=0)
        self.last: Event = {}
        self.fetch_task: Any = None
        console = console if console is not None else Console(stderr=True)
        self.live = Live(self._render(), console=console, refresh_per_second=4, transient=False)
        self.live.start()

    def __call__(self, event: Event) -> None:
        kind = event["event"]
        if kind == "progress":
            self.progress.update(
                self.task, completed=event["inner_step"], total=event["inner_steps"], step=event["outer_step"]
            )
        elif kind == "outer_step":
            self.last = event
            self.progress.update(self.task, completed=0, step=event["outer_step"] + 1)
        elif kind == "fetch_progress":
            if self.fetch_task is None:
                self.fetch_task = self.progress.add_task("fetch", total=event["total_bytes"], step="(fetching)")
            self.progress.update(self.fetch_task, completed=event["done_bytes"], total=event["total_bytes"])
        elif kind in ("resume", "fetch"):
            if self.fetch_task is not None:
                self.progress.remove_task(self.fetch_task)
                self.fetch_task = None
            self.live.console.print(state_line(event))
        elif kind == "exit":  # above the panel, so that it stays in the terminal after the panel stops
            self.live.console.print(summary_line(event, self.last), markup=False, highlight=False)
        self.live.update(self._render())

    def banner(self, lines: list[str]) -> None:
        """On stdout as always; when stdout is the panel's terminal too, through the panel's
        console, which prints above the live region (a plain print there was erased by the
        next redraw, join line included)."""
        if not sys.stdout.isatty():
            PlainLines().banner(lines)
            return
        for line in lines:
            self.live.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _render(self) -> Any:
        from rich.console import Group
        from rich.table import Table

        e = self.last
        table = Table.grid(padding=(0, 2))
        table.add_row("train loss", _fmt(e.get("train_loss")), "eval loss", _fmt(e.get("eval_loss")))
        table.add_row(
            "tokens/s", _fmt(e.get("tokens_per_s"), ".0f"), "group", str(e.get("group_size", "-")) + " members"
        )
        table.add_row("sent", _mb(e.get("bytes_sent")), "received", _mb(e.get("bytes_received")))
        table.add_row("state", str(e.get("state_sha256", "-"))[:16], "", "")
        return Group(self.progress, table)

    def close(self) -> None:
        self.live.stop()


def _running_time(clock: Callable[[], float]) -> Any:
    """A progress column of the time since the panel started, redrawn with the panel (4 times a
    second): rich's elapsed column is the bar's, and stops for good the first time the bar is full."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    started = clock()

    class RunningTime(ProgressColumn):
        def render(self, task: Any) -> Text:
            s = int(clock() - started)
            return Text(f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}", style="progress.elapsed")

    return RunningTime()


def summary_line(exit_event: Event, last: Event) -> str:
    """The node's last word: why it stopped, the steps done, and its last losses and state."""
    line = f"exit ({exit_event['reason']}) with {exit_event['outer_step']} outer steps done"
    if last:
        line += (f"; last step: train loss {_fmt(last.get('train_loss'))}, eval loss {_fmt(last.get('eval_loss'))}, "
                 f"state {str(last.get('state_sha256', '-'))[:12]}")  # fmt: skip
    return line


class MetricsFile:
    """--metrics-file: every event as one JSON line, flushed (others tail it while we run)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def __call__(self, event: Event) -> None:
        self.file.write(json.dumps(event, separators=(",", ":")) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def display_for_terminal() -> PlainLines | LivePanel:
    return LivePanel() if sys.stderr.isatty() else PlainLines()


def join_lines(event: Event, config: NodeConfig) -> list[str]:
    """The start banner: who this node is, where it listens, and the command line that joins it."""
    maddrs = event["maddrs"]
    end = f" of {config.run_end}" if config.run_end is not None else ""
    where = f"run {config.run_id!r}, model {config.model}, {event['outer_step']}{end} outer steps done"
    lines = [f"swarm-node {event['peer_id']} ({where})"]
    if not maddrs:
        return [*lines, "client mode: this node dials out only; peers cannot join through it"]
    lines += [f"listening on {maddr}" for maddr in maddrs]
    # --start-with is a node's own flag, not a run setting: a joiner without it trains at once, and the
    # first node, seeing a peer train, starts with it alone. The line carries it while the run is new.
    together = f"--start-with {config.start_with} " if config.start_with > 1 and event["outer_step"] == 0 else ""
    flags = join_flags(config, NodeConfig()) + together
    join = f"swarm-node --run-id {config.run_id} {flags}--initial-peers {maddrs[0]}"
    return [*lines, f"join with: {join}"]
