"""Training under attack: 4 honest swarm-node processes and one attacker (scripts/tools/attacks.py), the
tiny model for a few outer steps on 127.0.0.1, against the same 4 honest nodes without it.

For each attack (and once without any, the clean run) it runs a swarm-sim swarm (the same
processes, flags and metrics as `swarm-sim`) where the last node started is
`python -m scripts.tools.attacker ATTACK ...`. Reported per attack:

  honest_final_eval_loss  median over the honest nodes of their last eval loss
  clean_final_eval_loss   the same of the clean run
  ratio                   honest / clean (target <= 1.05)
  honest_exits            honest nodes that did not finish (failed, exited early, never started)
  forks                   outer steps at which the honest nodes report more than one state
  detected                the honest nodes' logs name the attack's effect (DETECTION below)

    python -m scripts.bench.robust [--attacks scale,owner] [--outer-steps 8] [--json]

The overhead row (robust reduction and audit vs the plain mean, n=4, 64M int8) comes from
`python -m scripts.bench.allreduce --aggregator ...` (the docs' robustness benchmark page).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.tools.worker_process import module_command

HONEST = 4
# what an honest node logs when a defense acted (any of them counts as detected)
DETECTION = ("clipped", "dropped", "refus", "ignor", "implausible", "audit", "excluded", "capped", "not adopting")


def attacker_argv(attack: str) -> list[str]:
    """`python -m scripts.tools.attacker ATTACK`: swarm-sim starts it in our working directory, the
    repository root, where `python -m scripts.bench.robust` runs (see scripts/__init__.py)."""
    return module_command("scripts.tools.attacker", attack)


def run_swarm(attack: str | None, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """One swarm of HONEST nodes (+ the attacker); what the honest nodes ended with."""
    from swarm.cli.common import CliError
    from swarm.cli.sim_config import SimConfig
    from swarm.cli.sim_report import DONE, FAILED
    from swarm.cli.sim_run import simulate
    from swarm.cli.sim_swarm import Swarm, console_script, stop_on_signals

    class AttackedSwarm(Swarm):
        def node_argv(self, metrics: Path) -> list[str]:
            argv = super().node_argv(metrics)
            if attack is not None and len(self.children) == HONEST:  # the last one started
                prefix = len(console_script("swarm-node", "swarm.cli.node"))
                argv = attacker_argv(attack) + argv[prefix:]
            return argv

        def winding_down(self) -> bool:  # the attacker's claims (a far step, an exit) end nothing
            honest = [c.record for c in self.children[:HONEST]]
            return any(self.reached_end(r) or r.status in (DONE, FAILED) for r in honest)

    config = SimConfig(
        nodes=HONEST + (attack is not None), model="tiny", outer_steps=args.outer_steps,
        inner_steps=args.inner_steps, batch_size=args.batch_size, seq_len=args.seq_len, compression="int8",
        seed=args.seed, lr=None, warmup_steps=None, matchmaking_time=None, max_group_size=None, part_timeout=None,
        kill_every=None, join_every=None, threads=1, run_dir=run_dir, metrics_out=run_dir / "metrics.json",
        plot_out=run_dir / "metrics.png", timeout=args.timeout, verbose=0,
    )  # fmt: skip

    swarm = AttackedSwarm(config, _EventsToStderr(attack or "clean"))
    began = time.monotonic()
    error = None
    with stop_on_signals() as stop:
        try:
            simulate(swarm, _HonestStop(swarm, stop))
        except CliError as e:
            error = str(e)
        finally:
            swarm.close()
        if stop.requested:  # SIGINT/SIGTERM ends the benchmark, not just this attack's swarm
            print("bench_robust: interrupted", file=sys.stderr)
            raise SystemExit(130)
    honest = [c.record for c in swarm.children[:HONEST]]
    finals = [r.steps[-1].get("eval_loss") for r in honest if r.steps]
    finals = [f for f in finals if isinstance(f, int | float)]
    by_step: dict[int, set[str]] = {}
    for record in honest:
        for step in record.steps:
            by_step.setdefault(step["outer_step"], set()).add(step.get("state_sha256"))
    logs = "\n".join(r.log.read_text(errors="replace") for r in honest if r.log.exists()).lower()
    return {
        "final_eval_loss": statistics.median(finals) if finals else None,
        "honest_exits": sum(r.status != DONE for r in honest),
        "forks": sorted(s for s, shas in by_step.items() if len(shas) > 1),
        "detected": any(marker in logs for marker in DETECTION),
        "wall_s": round(time.monotonic() - began, 1),
        "error": error,
    }


class _EventsToStderr:
    """swarm-sim's Display: the rare events (start, exit) on stderr, so --json stays clean."""

    def __init__(self, tag: str) -> None:
        self.tag, self.began = tag, time.monotonic()

    def event(self, line: str, *, routine: bool = False) -> None:
        if not routine:
            print(f"[{self.tag} {time.monotonic() - self.began:6.1f}s] {line}", file=sys.stderr, flush=True)

    def refresh(self, records: Any) -> None:
        pass


class _HonestStop:
    """simulate()'s stop request, also set once every honest node has exited: the attacker
    (which may never finish) does not hold the run."""

    def __init__(self, swarm: Any, stop: Any) -> None:
        self.swarm, self.stop = swarm, stop

    @property
    def requested(self) -> bool:
        honest = self.swarm.children[:HONEST]
        done = len(honest) == HONEST and all(c.record.exit_code is not None for c in honest)
        return self.stop.requested or done


def bench(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    with contextlib.ExitStack() as stack:
        base = Path(args.run_dir) if args.run_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        clean = run_swarm(None, args, _fresh(base / "clean"))
        for attack in args.attacks.split(","):
            result = run_swarm(attack, args, _fresh(base / attack))
            loss, clean_loss = result["final_eval_loss"], clean["final_eval_loss"]
            rows.append({
                "attack": attack, "honest_final_eval_loss": loss, "clean_final_eval_loss": clean_loss,
                "ratio": round(loss / clean_loss, 4) if loss is not None and clean_loss else None,
                "honest_exits": result["honest_exits"], "forks": result["forks"], "detected": result["detected"],
                "wall_s": result["wall_s"], "error": result["error"],
            })  # fmt: skip
    return {"rows": rows, "clean": clean}


def _fresh(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Training under attack: 4 honest nodes + 1 attacker (tiny model)")
    for name in ("attack", "honest eval loss", "clean eval loss", "ratio", "honest exits", "forks", "detected", "s"):
        table.add_column(name)
    for r in result["rows"]:
        loss = f"{r['honest_final_eval_loss']:.4f}" if r["honest_final_eval_loss"] is not None else "-"
        clean = f"{r['clean_final_eval_loss']:.4f}" if r["clean_final_eval_loss"] is not None else "-"
        table.add_row(r["attack"], loss, clean, str(r["ratio"]), str(r["honest_exits"]), str(len(r["forks"])),
                      "yes" if r["detected"] else "no", str(r["wall_s"]))  # fmt: skip
    Console().print(table)


def main() -> None:
    from scripts.tools.attacks import ATTACKS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", default=",".join(ATTACKS), help=f"any of {','.join(ATTACKS)}")
    parser.add_argument("--outer-steps", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per swarm")
    parser.add_argument("--run-dir", help="keep the node logs here (default: a temporary folder)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    unknown = set(args.attacks.split(",")) - set(ATTACKS)
    if unknown:
        parser.error(f"unknown attacks: {','.join(sorted(unknown))}")
    result = bench(args)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
