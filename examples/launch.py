"""Run an example as several local processes of one swarm and check that they agree.

    python examples/custom_model.py --processes 3        # uses run_local_swarm below

The first process starts the run and prints where it listens; the others join it through that
address. Every process waits, once it listens, until the launcher has seen all of them listen, so
that they start training together (a process that starts slowly, as on a loaded machine, would
otherwise find a short run already over). Each process prints one JSON line per outer step
({"outer_step", "state", "loss"}); this launcher checks that every process ends with the same
state and that the loss fell, prints a table, and exits 1 if not. Every process it starts is
stopped when it returns.
"""

from __future__ import annotations

import argparse
import json
import logging
import select
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

LISTENING = "listening "  # the line a worker prints once it may train: "listening <maddr>"
START = "start"  # the line the launcher sends each worker once every worker listens


def example_main(doc: str | None, script: str, worker: Callable[[argparse.Namespace], None], *,
                 outer_steps: int, inner_steps: int = 20) -> None:  # fmt: skip
    """An example's command line: `--worker` runs one process of the swarm; otherwise it starts
    `--processes` of them and reports (run_local_swarm)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--outer-steps", type=int, default=outer_steps)
    parser.add_argument("--inner-steps", type=int, default=inner_steps)
    parser.add_argument("--worker", action="store_true", help="run one process of the swarm")
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--start-together", action="store_true", help="wait for the launcher's start line")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the swarm does (INFO)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(process)d %(asctime)s %(name)s: %(message)s")  # fmt: skip
    if args.worker:
        worker(args)
        return
    flags = ["--outer-steps", str(args.outer_steps), "--inner-steps", str(args.inner_steps)]
    flags += ["--verbose"] if args.verbose else []
    raise SystemExit(run_local_swarm(script, args.processes, flags))


def run_local_swarm(script: str, processes: int, worker_args: list[str], timeout: float = 600.0) -> int:
    """Start `processes` workers of `script` (its --worker mode), start their training together
    once all listen, wait for them, report."""
    command = [sys.executable, script, "--worker", "--start-together", *worker_args]
    deadline = time.monotonic() + timeout
    children: list[subprocess.Popen[str]] = []

    def start(*extra: str) -> subprocess.Popen[str]:
        child = subprocess.Popen([*command, *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        children.append(child)
        return child

    try:
        maddr, first_lines = _read_until_listening(start(), 0, deadline)
        joiners = [start("--initial-peers", maddr) for _ in range(processes - 1)]
        early = [first_lines] + [_read_until_listening(child, i + 1, deadline)[1] for i, child in enumerate(joiners)]
        for child in children:
            assert child.stdin is not None
            child.stdin.write(START + "\n")
            child.stdin.flush()
        reports = [_collect(child, lines, deadline) for child, lines in zip(children, early, strict=True)]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()
    return _report(reports, [child.returncode for child in children])


def _read_until_listening(child: subprocess.Popen[str], index: int, deadline: float) -> tuple[str, list[str]]:
    """The address a worker listens on, and the lines it printed before."""
    assert child.stdout is not None
    lines: list[str] = []
    while time.monotonic() < deadline:
        line = child.stdout.readline()
        if not line:
            raise SystemExit(f"process {index} exited (code {child.wait()}) before listening")
        if line.startswith(LISTENING):
            return line[len(LISTENING) :].strip(), lines
        lines.append(line)
    raise SystemExit(f"process {index} did not start in time")


def _collect(child: subprocess.Popen[str], early: list[str], deadline: float) -> list[dict[str, Any]]:
    out, _ = child.communicate(timeout=max(1.0, deadline - time.monotonic()))
    lines = [*early, *out.splitlines()]
    return [json.loads(line) for line in lines if line.startswith("{")]  # steps, then {"end"}


def listening(session: Any, args: argparse.Namespace, timeout: float = 600.0) -> None:
    """A worker's line once it may train: where it listens (the launcher passes it to the others);
    with --start-together, it then waits for the launcher's start line."""
    print(LISTENING + (session.maddrs[0] if session.maddrs else ""), flush=True)
    if not args.start_together:
        return
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    if not ready or sys.stdin.readline().strip() != START:
        raise SystemExit(f"no start line from the launcher within {timeout:.0f} s")


def _report(reports: list[list[dict[str, Any]]], codes: list[int | None]) -> int:
    print(f"{'process':>7} {'outer steps':>11} {'first loss':>10} {'last loss':>9}  state")
    finals, ends = [], []
    for i, (lines, code) in enumerate(zip(reports, codes, strict=True)):
        steps = [line for line in lines if "outer_step" in line]
        ends.append(next((line["end"] for line in lines if "end" in line), None))
        losses = [s["loss"] for s in steps if s.get("loss") is not None]
        held = [line["state"] for line in lines if "state" in line]  # after a step or a fetch
        final = held[-1][:16] if held else "-"
        finals.append(final)
        first, last = (f"{losses[0]:.4f}", f"{losses[-1]:.4f}") if losses else ("-", "-")
        print(f"{i:>7} {len(steps):>11} {first:>10} {last:>9}  {final}  ({ends[-1]}, exit {code})")
    agree = len(set(finals)) == 1 and "-" not in finals and all(code == 0 for code in codes)
    # judged on the process that recorded the most steps (one that caught up by a fetch has fewer)
    losses = max(([s["loss"] for s in lines if s.get("loss") is not None] for lines in reports), key=len)
    fell = len(losses) >= 2 and losses[-1] < losses[0]
    print(f"one state on every process: {'yes' if agree else 'NO'}; the loss fell: {'yes' if fell else 'NO'}")
    return 0 if agree and fell else 1


def print_end(session: Any) -> None:
    """A worker's last line: why its session ended ("finished", "stopped")."""
    print(json.dumps({"end": session.reason}), flush=True)


def print_step(event: dict[str, Any]) -> None:
    """A worker's `on_event` for swarm.join: one line per completed outer step, with the eval
    loss of the state (the same on every process that holds it)."""
    if event["event"] == "outer_step":
        line = {"outer_step": event["outer_step"], "state": event["state_sha256"], "loss": event.get("eval_loss")}
        print(json.dumps(line), flush=True)
    elif event["event"] == "fetch":  # caught up with the swarm: the state it holds now
        print(json.dumps({"fetched": event["outer_step"], "state": event["state_sha256"]}), flush=True)
