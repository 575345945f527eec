"""The soak: a swarm of real swarm-node processes on 127.0.0.1 under churn and load for a set
time, its invariants checked at the end (`swarm-sim --soak`, `python -m scripts.soak`).

    python -m scripts.soak --minutes 15 --json        # 12 nodes; a report JSON and a PNG timeline
    swarm-sim --soak --minutes 5                      # the same code

soak_schedule.py says what churn comes when, soak_run.py runs the processes and records them,
soak_checks.py holds the invariants, soak_report.py the figures, JSON and PNG. The nodes run on
127.0.0.1 without shaped links. Exit status: 0 when every invariant held, 1 when one broke (or
the swarm could not start), 2 for a bad command line.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import click

from swarm.cli.common import CliError, OneLineCommand
from swarm.cli.output import echo_json
from swarm.cli.sim_swarm import stop_on_signals
from swarm.cli.soak_checks import check, task_deaths
from swarm.cli.soak_report import figures, summary, write_json, write_plot
from swarm.cli.soak_run import Soak, SoakConfig
from swarm.cli.soak_schedule import GAP_S, KINDS, churn_schedule, kinds_problem

# a tiny node's RSS grows for its first minutes (about 350 to 650 MB in 3 minutes), then is flat
MEMORY_WARMUP_S = 180.0


def soak(config: SoakConfig, *, as_json: bool = False) -> int:
    """Run the soak and write its report (run_dir/soak.json, soak.png); 1 when an invariant broke."""
    schedule = churn_schedule(config.seed, config.minutes * 60, gap_s=config.gap_s, kinds=config.churn)
    runner = Soak(config, schedule)
    began = time.time()
    with stop_on_signals() as stop:  # the children are stopped whatever ends the run
        try:
            runner.run(stop)
        finally:
            runner.close()
    logs = runner.logs()
    invariants = check(runner.events, runner.churn, runner.samples, logs, inner_steps=config.inner_steps,
                       warmup_s=max(MEMORY_WARMUP_S, config.minutes * 60 / 3))  # fmt: skip
    report = {
        "command": " ".join(sys.argv[:1] + sys.argv[1:]),
        "run_id": runner.run_id,
        "nodes": config.nodes,
        "minutes": config.minutes,
        "seed": config.seed,
        "inner_steps": config.inner_steps,
        "wall_s": round(time.time() - began, 1),
        "figures": figures(runner.events, runner.churn),
        "invariants": invariants,
        "seen_task_failures": task_deaths(logs)[1],
        "schedule": [{"at_s": c.at_s, "kind": c.kind, "seconds": c.seconds} for c in schedule],
        "churn": runner.churn,
        "samples": runner.samples,
        "events": [e for e in runner.events if e.get("event") not in ("progress", "network", "fetch_progress")],
    }
    write_json(config.run_dir / "soak.json", report)
    write_plot(config.run_dir / "soak.png", runner.events, runner.churn, runner.samples,
               f"soak: {config.nodes} nodes, {config.minutes:g} min, seed {config.seed}")  # fmt: skip
    if as_json:
        echo_json({k: report[k] for k in ("run_id", "nodes", "minutes", "seed", "wall_s", "figures", "invariants")})
    else:
        for line in summary(report):
            click.echo(line)
        click.echo(f"report: {config.run_dir / 'soak.json'}, timeline: {config.run_dir / 'soak.png'}")
    return 1 if any(invariants.values()) else 0


def _churn_kinds(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in value.split(",") if k.strip())
    if (problem := kinds_problem(kinds)) is not None:
        raise click.BadParameter(problem)
    if not kinds:
        raise click.BadParameter(f"name at least one of {', '.join(KINDS)}")
    return kinds


@click.command(cls=OneLineCommand, name="soak", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--nodes", type=click.IntRange(min=3), default=12, show_default=True, help="Nodes at start.")
@click.option("--minutes", type=click.FloatRange(0, min_open=True), default=5.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the churn schedule and its victims.")
@click.option("--inner-steps", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Node folders (checkpoint, events, log) and the report. Default: a new temporary one.")  # fmt: skip
@click.option("--churn", default=",".join(KINDS), show_default=True, callback=_churn_kinds,
              help="The kinds of churn to deal, comma-separated (--churn pause: only pauses).")  # fmt: skip
@click.option("--gap", "gap_s", type=click.FloatRange(0, min_open=True), default=GAP_S, show_default=True,
              help="Mean seconds between churn events.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the figures and invariants as one JSON line.")
def main(nodes: int, minutes: float, seed: int, inner_steps: int, run_dir: Path | None, churn: tuple[str, ...],
         gap_s: float, as_json: bool) -> None:  # fmt: skip
    """Run a swarm of swarm-node processes under churn and load; check its invariants."""
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="swarm-soak-"))
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CliError(f"cannot create {run_dir}: {e.strerror or e}") from None
    config = SoakConfig(nodes=nodes, minutes=minutes, seed=seed, inner_steps=inner_steps, run_dir=run_dir,
                        churn=churn, gap_s=gap_s)  # fmt: skip
    if not as_json:
        click.echo(f"soak: {nodes} nodes for {minutes:g} min; run directory {run_dir}")
    sys.exit(soak(config, as_json=as_json))
