"""swarm-sim: a training swarm of local processes on 127.0.0.1, or on shaped links.

    swarm-sim                                     # the demo: 3 tiny nodes, the loss falls in minutes
    swarm-sim --nodes 4 --outer-steps 20 --kill-every 40 --join-every 60
    sudo swarm-sim --nodes 4 --links 100mbit,100mbit,100mbit,20mbit   # each node on its own link
    sudo swarm-sim --nat cone:2,cone:2,symmetric:2      # 6 volunteers at home, one public relay

It starts a bootstrap DHT node (`swarm-dht serve`) and N `swarm-node` processes with the command
lines a user would type, each in its own session (so a Ctrl+C on the terminal reaches only the
simulator, which then stops them in order). It follows each node through its --metrics-file,
shows one table for the whole swarm (a live table on a terminal, log lines otherwise) and, with
churn, SIGKILLs a random running node or starts a newcomer every so many seconds. At the end, on
Ctrl+C or on SIGTERM it stops every child (SIGTERM, then SIGKILL after a grace period) and writes
the metrics JSON and the loss plot from whatever the nodes reported.

This module is the command line; sim_config.py holds the run's settings, sim_swarm.py its
processes, sim_run.py the run from start to reports (and the churn's rules), sim_report.py the
table, the metrics JSON and the plot.

With --link or --links (root and iproute2), each child runs inside a network namespace of its
own (a node enters it itself, forked from the preloaded server; the bootstrap runs under
`ip netns exec`), listening on its address there, behind a link shaped by tc to its rate in
both directions (swarm.netlab; the namespaces are removed with the children). With --nat (root,
iproute2 and nftables), each node sits in a home network behind a NAT router (cone: hole punching
works; symmetric: it does not), and only the bootstrap, which relays, is on the lab's internet:
the nodes reach each other through it, then by punched connections where the NATs allow.

Exit status: 0 when every node that was not killed reached --outer-steps; 1 when a node failed,
failed to start or the --timeout passed; 2 for a bad command line; 130 when interrupted.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from swarm.cli.common import CliError, OneLineCommand
from swarm.cli.options import compression_option, positive_seconds
from swarm.cli.sim_config import (
    CODECS,
    DEFAULT_BATCH_SIZE,
    DEFAULT_INNER_STEPS,
    DEFAULT_NODES,
    DEFAULT_OUTER_STEPS,
    DEFAULT_SEQ_LEN,
    MODELS,
    SimConfig,
    parse_nat,
)
from swarm.cli.sim_run import run
from swarm.model.schedule import SCHEDULES
from swarm.netlab import missing, missing_nat, parse_rate, parse_rates
from swarm.node.config import OVERLAP_MODES

DEFAULT_SOURCE = click.core.ParameterSource.DEFAULT


def default_threads(nodes: int) -> int:
    """Share this machine's CPUs (the ones this process may use) evenly between the nodes."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cpus = os.cpu_count() or 1
    return max(1, cpus // nodes)


def parsed(ctx: click.Context, param: click.Parameter, text: str | None, parse: Callable[[str], Any]) -> Any:
    """An option's value through `parse`; its ValueError is a bad parameter (one line, exit 2)."""
    try:
        return None if text is None else parse(text)
    except ValueError as e:
        raise click.BadParameter(str(e), ctx, param) from None


@click.command(cls=OneLineCommand, name="swarm-sim", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--nodes", type=click.IntRange(min=1), default=DEFAULT_NODES, show_default=True, help="Nodes at start.")
@click.option("--model", type=click.Choice(MODELS), default="tiny", show_default=True, help="Model preset.")
@click.option("--outer-steps", type=click.IntRange(min=1), default=DEFAULT_OUTER_STEPS, show_default=True)
@click.option("--inner-steps", type=click.IntRange(min=1), default=DEFAULT_INNER_STEPS, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=DEFAULT_BATCH_SIZE, show_default=True)
@click.option("--seq-len", type=click.IntRange(min=1), default=DEFAULT_SEQ_LEN, show_default=True)
@click.option(
    "--compression",
    default="int8",
    show_default=True,
    callback=compression_option(CODECS),
    metavar="CODEC[:D]",
    help=f"{'|'.join(CODECS)}, optionally :DENSITY (the share of blocks each outer step sends)",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Model init seed; also seeds the churn.")
@click.option("--data", default="stdlib", show_default=True, metavar="DIR|URL|stdlib",
              help="Every node's --data: a folder that swarm-data prepare wrote (its URL, hf-prepared:ORG/NAME), "
              "whose chunks the nodes share, or the built-in corpus.")  # fmt: skip
@click.option("--lr", type=click.FloatRange(0, min_open=True), help="Peak inner learning rate. Default: swarm-node's.")
@click.option("--warmup-steps", type=click.IntRange(min=0), help="Inner warmup steps. Default: swarm-node's.")
@click.option("--lr-schedule", type=click.Choice(SCHEDULES), default="constant", show_default=True,
              help="Inner learning rate after warmup (swarm-node's --lr-schedule).")  # fmt: skip
@click.option("--total-steps", type=click.IntRange(min=1),
              help="Where cosine or wsd ends, in inner steps. Default: the whole run (outer x inner).")  # fmt: skip
@click.option("--decay-fraction", type=click.FloatRange(0, 1, min_open=True), help="wsd's decay share.")
@click.option("--matchmaking-time", type=float, callback=positive_seconds, metavar="SECONDS", help="Per node.")
@click.option("--max-group-size", type=click.IntRange(min=1), help="Per node. Default: swarm-node's.")
@click.option("--part-timeout", type=float, callback=positive_seconds, metavar="SECONDS",
              help="Per node: the all-reduce's longest wait for one member. Default: swarm-node's.")  # fmt: skip
@click.option(
    "--overlap",
    type=click.Choice(OVERLAP_MODES),
    default="none",
    show_default=True,
    help="Per node: average each outer step while the next inner steps run (swarm-node's --overlap).",
)
@click.option(
    "--kill-every", type=float, callback=positive_seconds, metavar="SECONDS", help="SIGKILL a random running node."
)
@click.option("--join-every", type=float, callback=positive_seconds, metavar="SECONDS", help="Start a newcomer.")
@click.option("--threads", type=click.IntRange(min=1), help="Torch threads per node. Default: CPUs / --nodes.")
@click.option("--link", callback=functools.partial(parsed, parse=parse_rate), metavar="RATE",
              help="Run each node and the bootstrap in a network namespace of its own, on a link shaped to RATE "
                   "each way (20mbit, 100mbit, 1gbit; no added delay). Needs root and iproute2.")  # fmt: skip
@click.option("--links", callback=functools.partial(parsed, parse=parse_rates),
              metavar="R1,R2,...", help="As --link, one rate per node (as many as --nodes); the bootstrap gets "
                                        "the fastest.")  # fmt: skip
@click.option("--nat", callback=functools.partial(parsed, parse=parse_nat), metavar="KIND:N,...",
              help="Put the nodes in home networks behind NAT routers, e.g. cone:2,cone:2,symmetric:2 (public:N: N "
                   "nodes without NAT; --nodes defaults to their sum); the bootstrap relays. Needs root, iproute2 "
                   "and nftables.")  # fmt: skip
@click.option("--dashboard", type=click.IntRange(0, 65535), is_flag=False, flag_value=0, default=None,
              metavar="[PORT]", help="Serve the swarm's live dashboard on 127.0.0.1:PORT (no PORT: any free "
                                     "one) and print its address.")  # fmt: skip
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where node logs and metrics files go. Default: a new temporary directory (kept).",
)
@click.option("--metrics-out", type=click.Path(dir_okay=False, path_type=Path), help="Default: RUN_DIR/metrics.json.")
@click.option("--plot-out", type=click.Path(dir_okay=False, path_type=Path), help="Default: the metrics path, .png.")
@click.option("--timeout", type=float, callback=positive_seconds, metavar="SECONDS", help="Give up after this long.")
@click.option("-v", "--verbose", count=True, help="Pass -v to every node (its log is in RUN_DIR).")
@click.option(
    "--soak",
    is_flag=True,
    help="Run the soak instead (python -m scripts.soak): 12 nodes (or --nodes) "
    "under churn and load for --minutes; exit 1 when an invariant breaks.",
)
@click.option("--minutes", type=click.FloatRange(0, min_open=True), default=5.0, show_default=True,
              help="--soak: how long.")  # fmt: skip
def main(**options: Any) -> None:
    """Run a training swarm of local swarm-node processes on 127.0.0.1 and show it in one table.

    With no options: the demo, 3 nodes of the tiny model for a few minutes on a laptop CPU;
    the loss falls. At the end (or on Ctrl+C) writes the metrics JSON and a loss plot.
    """
    soak, minutes = options.pop("soak"), options.pop("minutes")
    if soak:
        _soak(options, minutes)
    if options["nat"] is not None and click.get_current_context().get_parameter_source("nodes") == DEFAULT_SOURCE:
        options["nodes"] = sum(count for _, count in options["nat"])
    run(build_config(**options))


def _soak(options: dict[str, Any], minutes: float) -> None:
    """swarm-sim --soak: the soak (swarm/cli/soak.py) with this command line's nodes, seed, H and folder."""
    from swarm.cli.soak import soak
    from swarm.cli.soak_run import SoakConfig

    default_nodes = click.get_current_context().get_parameter_source("nodes") == DEFAULT_SOURCE
    run_dir = options["run_dir"] or Path(tempfile.mkdtemp(prefix="swarm-soak-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        config = SoakConfig(nodes=12 if default_nodes else options["nodes"], minutes=minutes, seed=options["seed"],
                            inner_steps=options["inner_steps"], run_dir=run_dir)  # fmt: skip
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    click.echo(f"soak: {config.nodes} nodes for {minutes:g} min; run directory {run_dir}")
    raise SystemExit(soak(config))


def build_config(
    *, run_dir: Path | None, metrics_out: Path | None, plot_out: Path | None, threads: int | None, **options: Any
) -> SimConfig:
    """The config, checked before anything is made (links need root and iproute2: without them,
    one line), then the folders, made now: a path that cannot be written fails before any node
    has trained, not after."""
    try:
        unplaced = Path()  # the folders come after the checks
        threads = threads or default_threads(options["nodes"])
        config = SimConfig(run_dir=unplaced, metrics_out=unplaced, plot_out=unplaced, threads=threads, **options)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    flag = "--link" if config.link else "--links" if config.links else None
    if flag is not None and (problem := missing()) is not None:
        raise CliError(f"{flag} {problem}")
    if config.nat is not None and (problem := missing_nat()) is not None:
        raise CliError(f"--nat {problem}")
    try:
        run_dir = Path(tempfile.mkdtemp(prefix="swarm-sim-")) if run_dir is None else run_dir
        metrics_out = metrics_out or run_dir / "metrics.json"
        plot_out = plot_out or metrics_out.with_suffix(".png")
        for folder in (run_dir, metrics_out.parent, plot_out.parent):
            folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CliError(f"cannot create {e.filename or run_dir}: {e.strerror or e}") from None
    return dataclasses.replace(config, run_dir=run_dir, metrics_out=metrics_out, plot_out=plot_out)
