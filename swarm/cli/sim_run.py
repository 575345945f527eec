"""One swarm-sim run from start to reports: start the swarm, follow it while churning, stop
every child, write the metrics and the plot, and decide the exit status.

Churn starts when the first node has started, keeps at least one node alive, and stops once any
node reaches the last outer step or exits (killing or adding nodes then measures nothing);
newcomers still starting at that point are cancelled (SIGKILL) and count as neither success nor
failure.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import click

from swarm.cli import sim_report
from swarm.cli.common import CliError
from swarm.cli.sim_config import SimConfig
from swarm.cli.sim_report import CANCELLED, DONE, KILLED, STRANDED
from swarm.cli.sim_swarm import POLL_S, StopRequest, Swarm, last_line, stop_on_signals


@dataclasses.dataclass(slots=True)
class Churn:
    """When to kill a node and when to add one: every kill_every / join_every seconds, counted
    from the first node's start (before that there is no swarm to churn), until the swarm winds
    down (see Swarm.winding_down)."""

    kill_every: float | None
    join_every: float | None
    next_kill: float = float("inf")
    next_join: float = float("inf")
    armed: bool = False

    def tick(self, swarm: Swarm, now: float) -> None:
        if swarm.winding_down():
            swarm.cancel_starting()
            swarm.strand_latecomers()
            return
        if not self.armed:
            if not any(r.started for r in swarm.records):
                return
            self.armed = True
            self.next_kill = now + self.kill_every if self.kill_every else float("inf")
            self.next_join = now + self.join_every if self.join_every else float("inf")
        if now >= self.next_kill:
            swarm.kill_random()
            self.next_kill += self.kill_every or 0
        if now >= self.next_join:
            swarm.join()
            self.next_join += self.join_every or 0


def simulate(swarm: Swarm, stop: StopRequest) -> None:
    """Start the swarm and follow it until every node has exited, churning on the way."""
    config = swarm.config
    swarm.open_links()
    swarm.start_bootstrap(stop)
    if config.dashboard is not None:
        swarm.start_dashboard(stop)
    for _ in range(config.nodes):
        if not stop.requested:
            swarm.start_node()
    start = time.monotonic()
    churn = Churn(kill_every=config.kill_every, join_every=config.join_every)
    while not stop.requested:
        swarm.poll()
        swarm.display.refresh(swarm.records)
        if swarm.finished():
            return
        now = time.monotonic()
        if config.timeout is not None and now - start > config.timeout:
            raise CliError(f"the swarm did not finish within {config.timeout:g}s (see --timeout)")
        churn.tick(swarm, now)
        time.sleep(POLL_S)


def run(config: SimConfig) -> None:
    """The whole simulation: the children are always stopped and the reports always written;
    then the first failure (or the interruption) decides the exit status."""
    began = time.time()
    failure: CliError | None = None
    title = f"swarm-sim · model {config.model} · H={config.inner_steps}"
    click.echo(f"run directory: {config.run_dir} (node logs, metrics)")  # before the live table
    with stop_on_signals() as stop, sim_report.open_display(title) as display:
        swarm = Swarm(config, display)
        try:
            simulate(swarm, stop)
        except CliError as e:
            failure = e
        finally:
            swarm.close()
            display.refresh(swarm.records)
    write_reports(swarm, time.time() - began, interrupted=stop.requested)  # after the live table: no redraws
    if failure is not None:
        raise failure
    if stop.requested:
        raise click.Abort()  # OneLineCommand: "swarm-sim: interrupted", exit 130
    failed = [r for r in swarm.records if r.status not in (DONE, KILLED, CANCELLED, STRANDED)]
    if failed:
        r = failed[0]
        raise CliError(
            f"{len(failed)} node(s) did not reach outer step {config.outer_steps}: {r.label()} {r.status} "
            f"(exit {r.exit_code}) at outer step {r.outer_step}: {last_line(r.log)}"
        )


def write_reports(swarm: Swarm, wall_s: float, *, interrupted: bool) -> None:
    c = swarm.config
    header: dict[str, Any] = {
        "run_id": swarm.run_id,
        "model": c.model,
        "nodes_started": len(swarm.children),
        "outer_steps": c.outer_steps,
        "inner_steps": c.inner_steps,
        "batch_size": c.batch_size,
        "seq_len": c.seq_len,
        "compression": c.compression,
        "wall_s": round(wall_s, 3),
        "interrupted": interrupted,
        "bootstrap_link": None if c.rate(None) is None else str(c.rate(None)),
    }
    title = f"swarm-sim: {len(swarm.children)} nodes, model {c.model}, H={c.inner_steps}"
    try:
        sim_report.write_metrics(c.metrics_out, swarm.records, header)
        sim_report.write_plot(c.plot_out, swarm.records, title)
    except OSError as e:
        raise CliError(f"cannot write the metrics: {e}") from None
    summary = sim_report.loss_summary(swarm.records)
    click.echo(f"swarm-sim: {len(swarm.children)} nodes in {wall_s:.0f}s; {summary}")
    if swarm.lab is not None:
        click.echo("links: " + ", ".join(f"{e.name} {e.rate} ({e.address})" for e in swarm.lab.endpoints))
    click.echo(f"metrics: {c.metrics_out}\nplot: {c.plot_out}\nlogs: {c.run_dir}")
