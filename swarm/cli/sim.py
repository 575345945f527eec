"""swarm-sim: a training swarm of local processes on 127.0.0.1, or on shaped links.

    swarm-sim                                     # the demo: 3 tiny nodes, the loss falls in minutes
    swarm-sim --nodes 4 --outer-steps 20 --kill-every 40 --join-every 60
    sudo swarm-sim --nodes 4 --links 100mbit,100mbit,100mbit,20mbit   # each node on its own link

It starts a bootstrap DHT node (`swarm-dht serve`) and N `swarm-node` processes with the command
lines a user would type, each in its own session (so a Ctrl+C on the terminal reaches only the
simulator, which then stops them in order). It follows each node through its --metrics-file,
shows one table for the whole swarm (a live table on a terminal, log lines otherwise) and, with
churn, SIGKILLs a random running node or starts a newcomer every so many seconds. At the end, on
Ctrl+C or on SIGTERM it stops every child (SIGTERM, then SIGKILL after a grace period) and writes
the metrics JSON and the loss plot (see sim_report.py) from whatever the nodes reported.

With --link or --links (root and iproute2), each child runs inside a network namespace of its
own (`ip netns exec`), listening on its address there, behind a link shaped by tc to its rate in
both directions (swarm.netlab; the namespaces are removed with the children).

Churn starts when the first node has started, keeps at least one node alive, and stops once any
node reaches the last outer step or exits (killing or adding nodes then measures nothing);
newcomers still starting at that point are cancelled (SIGKILL) and count as neither success nor
failure.

Exit status: 0 when every node that was not killed reached --outer-steps; 1 when a node failed,
failed to start or the --timeout passed; 2 for a bad command line; 130 when interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import click

from swarm.cli import sim_report
from swarm.cli.common import CliError, OneLineCommand, compression_option, positive_seconds
from swarm.cli.sim_report import (
    ALIVE,
    CANCELLED,
    DONE,
    FAILED,
    KILLED,
    STARTING,
    STOPPED,
    STRANDED,
    Display,
    EventTail,
    NodeRecord,
)
from swarm.model.schedule import DEFAULT_DECAY_FRACTION, DEFAULT_WARMUP_STEPS, SCHEDULES, schedule_problem
from swarm.netlab import Lab, LabError, Rate, exec_prefix, missing, parse_rate, parse_rates
from swarm.node.config import OVERLAP_MODES
from swarm.utils import process_control

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
POLL_S = 0.25  # how often the simulator reads the metrics files and checks its children
START_TIMEOUT_S = 180.0  # from spawn to a node's "start" event: imports, corpus, the codec's first build
BOOTSTRAP_TIMEOUT_S = 30.0
GRACE_S = 10.0  # between SIGTERM and SIGKILL when stopping the children
# swarm.model.presets.PRESETS and swarm.averaging.config.CODECS, written out: importing either pulls in
# torch, seconds before a bad flag can be answered (tests/cli/test_sim.py checks that they match)
MODELS = ("tiny", "small", "150m", "1b")
CODECS = ("int8", "int4", "int2", "fp16", "none")

# The demo (`swarm-sim` with no options), sized to finish in about a minute on a 2-core laptop CPU.
DEFAULT_NODES = 3
DEFAULT_OUTER_STEPS = 10
DEFAULT_INNER_STEPS = 20
DEFAULT_BATCH_SIZE = 8
DEFAULT_SEQ_LEN = 64


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    """One simulation; the click options map 1:1 onto it."""

    nodes: int  # started at once
    model: str
    outer_steps: int  # every node runs with --max-outer-steps this
    inner_steps: int
    batch_size: int
    seq_len: int
    compression: str
    seed: int  # the model's init seed (the same on every node) and the churn's random choices
    lr: float | None  # None: swarm-node's default
    warmup_steps: int | None  # None: swarm-node's default
    matchmaking_time: float | None  # None: swarm-node's default
    max_group_size: int | None
    part_timeout: float | None  # None: swarm-node's default
    kill_every: float | None  # seconds between SIGKILLs of a random running node; None: never
    join_every: float | None  # seconds between newcomers; None: never
    threads: int  # torch threads per node
    run_dir: Path  # node logs and metrics files
    metrics_out: Path
    plot_out: Path
    timeout: float | None  # the whole run; None: until the nodes finish
    verbose: int
    lr_schedule: str = "constant"  # swarm-node's default; cosine / wsd end at total_steps
    total_steps: int | None = None  # None with a decaying schedule: the whole run, outer_steps x inner_steps
    decay_fraction: float | None = None  # None: swarm-node's default
    link: Rate | None = None  # every node (newcomers too) and the bootstrap on a link of this rate
    links: tuple[Rate, ...] | None = None  # one rate per starting node; the bootstrap gets the fastest
    dashboard: int | None = None  # --dashboard [PORT]: serve the run's dashboard on 127.0.0.1 (0: any port)
    overlap: str = "none"  # swarm-node's --overlap: none (blocking), eager, delayed

    def __post_init__(self) -> None:
        if min(self.nodes, self.outer_steps, self.inner_steps, self.batch_size, self.seq_len, self.threads) < 1:
            raise ValueError("nodes, steps, batch size, sequence length and threads must be >= 1")
        if self.link is not None and self.links is not None:
            raise ValueError("give --link (one rate for all) or --links (one per node), not both")
        if self.links is not None and len(self.links) != self.nodes:
            raise ValueError(
                f"--links has {len(self.links)} rate(s) for {self.nodes} nodes: give one per node (--nodes), "
                "or one rate for all with --link"
            )
        if self.dashboard is not None and (self.link is not None or self.links is not None):
            raise ValueError("--dashboard reads the swarm from 127.0.0.1: it cannot reach nodes behind --link/--links")
        if self.links is not None and self.join_every is not None:
            raise ValueError(
                "--links gives the starting nodes their rates, not newcomers: use --link with --join-every"
            )
        total = (
            self.total_steps
            if self.lr_schedule == "constant"
            else self.total_steps or self.outer_steps * self.inner_steps
        )
        warmup = DEFAULT_WARMUP_STEPS if self.warmup_steps is None else self.warmup_steps
        fraction = DEFAULT_DECAY_FRACTION if self.decay_fraction is None else self.decay_fraction
        problem = schedule_problem(self.lr_schedule, warmup, total, fraction)
        if problem is not None:  # before any node starts (each would refuse it alone)
            if self.total_steps is None and total is not None:
                problem += f" (--total-steps defaults to the whole run: --outer-steps x --inner-steps = {total})"
            raise ValueError(problem)

    def rate(self, index: int | None) -> Rate | None:
        """The link of the index-th node (None: the bootstrap); None on 127.0.0.1."""
        if self.links is not None:
            return max(self.links) if index is None else self.links[index]
        return self.link


# --- processes ------------------------------------------------------------------------------


def console_script(name: str, module: str) -> list[str]:
    """The argv prefix that runs an installed command: the console script next to this
    interpreter (a venv, activated or not), else the same entry point through `python -c`."""
    beside_python = Path(sys.executable).parent / name
    if beside_python.exists():
        return [str(beside_python)]
    code = f"import sys; from {module} import main; sys.exit(main(prog_name={name!r}))"
    return [sys.executable, "-c", code]


def spawn(argv: Sequence[str], log: Path, stdout: Path | None = None) -> subprocess.Popen[bytes]:
    """Start a child in its own session (its own process group: signals from the terminal do
    not reach it, and stopping it by its group also stops anything it started)."""
    with contextlib.ExitStack() as files:  # the child holds its own copies of the descriptors
        err = files.enter_context(open(log, "wb"))
        out = files.enter_context(open(stdout, "wb")) if stdout is not None else err
        return process_control.start(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err)


def send(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Signal a child's process group, only while the child is unreaped (its PID, and so its
    group id, cannot have been reused yet)."""
    process_control.send_signal(proc, sig, group=True)


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], grace: float = GRACE_S) -> None:
    """SIGTERM all, wait up to `grace` seconds in total, then SIGKILL whatever still runs."""
    process_control.stop_all(procs, grace, group=True, reap_s=GRACE_S)


def last_line(path: Path) -> str:
    """The last non-empty line of a log: where a command prints its one-line error."""
    with contextlib.suppress(OSError):
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
        if lines:
            return lines[-1][:500]
    return "(no output)"


@dataclasses.dataclass(slots=True)
class Child:
    record: NodeRecord
    proc: subprocess.Popen[bytes]
    tail: EventTail
    spawned_at: float  # time.monotonic()


class Swarm:
    """The bootstrap DHT node and the training nodes of one simulation, and what they reported."""

    def __init__(self, config: SimConfig, display: Display) -> None:
        self.config = config
        self.display = display
        self.run_id = f"sim-{secrets.token_hex(4)}"  # a fresh run: nothing left over in any DHT matches it
        self.children: list[Child] = []
        self.bootstrap: subprocess.Popen[bytes] | None = None
        self.initial_peers: list[str] = []
        self.rng = random.Random(config.seed)
        self.lab: Lab | None = None  # with --link: every child's network namespace
        self.dashboard: subprocess.Popen[bytes] | None = None  # --dashboard: `swarm-dht inspect --serve`

    @property
    def records(self) -> list[NodeRecord]:
        return [c.record for c in self.children]

    def open_links(self) -> None:
        """With --link: the bridge the children's links meet at (each child's link is added
        when it starts); killed runs' leftovers are removed first."""
        if self.config.rate(None) is not None:
            try:
                self.lab = Lab.create(self.run_id)
            except LabError as e:
                raise CliError(f"cannot build the links: {e}") from None

    def place(self, name: str, rate: Rate | None, record: NodeRecord | None = None) -> tuple[list[str], str]:
        """Where a child runs: (argv prefix, listen multiaddr). With --link, in a namespace of
        its own behind a link of `rate` each way; otherwise on 127.0.0.1."""
        if self.lab is None or rate is None:
            return [], LOOPBACK
        try:
            endpoint = self.lab.add(name, rate)
        except LabError as e:
            raise CliError(f"cannot put {name} on its link: {e}") from None
        if record is not None:
            record.link, record.address = str(rate), endpoint.address
        self.display.event(f"{name} on its own link: {endpoint.address}, {rate} each way")
        return exec_prefix(endpoint), f"/ip4/{endpoint.address}/tcp/0"

    def start_bootstrap(self, stop: StopRequest) -> None:
        """Start `swarm-dht serve --json` and read its first line: {"peer_id", "maddrs"}."""
        log, out = self.config.run_dir / "bootstrap.log", self.config.run_dir / "bootstrap.out"
        prefix, listen = self.place("bootstrap", self.config.rate(None))
        argv = [*prefix, *console_script("swarm-dht", "swarm.cli.dht"), "serve", "--json", "--host-maddrs", listen]
        argv += ["-v"] * self.config.verbose
        self.bootstrap = spawn(argv, log, stdout=out)
        deadline = time.monotonic() + BOOTSTRAP_TIMEOUT_S
        while not stop.requested:
            first, newline, _ = out.read_bytes().partition(b"\n")
            if newline:
                self.initial_peers = list(json.loads(first)["maddrs"])
                return
            if self.bootstrap.poll() is not None or time.monotonic() > deadline:
                raise CliError(f"the bootstrap DHT node did not start: {last_line(log)} (see {log})")
            time.sleep(POLL_S / 5)

    def start_dashboard(self, stop: StopRequest) -> None:
        """--dashboard: `swarm-dht inspect --run-id R --serve PORT --json` reading the bootstrap
        node; its first line is {"url", "run_id"}."""
        log, out = self.config.run_dir / "dashboard.log", self.config.run_dir / "dashboard.out"
        peers = [f"--initial-peers={m}" for m in self.initial_peers]
        serve = ["inspect", "--run-id", self.run_id, "--json", "--serve", str(self.config.dashboard), *peers]
        argv = [*console_script("swarm-dht", "swarm.cli.dht"), *serve]
        self.dashboard = spawn(argv, log, stdout=out)
        deadline = time.monotonic() + BOOTSTRAP_TIMEOUT_S
        while not stop.requested:
            first, newline, _ = out.read_bytes().partition(b"\n")
            if newline:
                self.display.event(f"dashboard: {json.loads(first)['url']}")
                return
            if self.dashboard.poll() is not None or time.monotonic() > deadline:
                raise CliError(f"the dashboard did not start: {last_line(log)} (see {log})")
            time.sleep(POLL_S / 5)

    def start_node(self) -> Child:
        index = len(self.children)
        name = f"node{index}"
        record = NodeRecord(name=name, log=self.config.run_dir / f"{name}.log")
        metrics = self.config.run_dir / f"{name}.jsonl"
        metrics.unlink(missing_ok=True)  # a file left by an earlier run in the same --run-dir
        prefix, listen = self.place(name, self.config.rate(index), record)
        proc = spawn([*prefix, *self.node_argv(metrics, listen)], record.log)
        child = Child(record, proc, EventTail(metrics), time.monotonic())
        self.children.append(child)
        return child

    def node_argv(self, metrics: Path, listen: str = LOOPBACK) -> list[str]:
        c = self.config
        argv = [*console_script("swarm-node", "swarm.cli.node")]
        for maddr in self.initial_peers:
            argv += ["--initial-peers", maddr]
        argv += ["--host-maddrs", listen, "--run-id", self.run_id, "--model", c.model]
        argv += ["--inner-steps", str(c.inner_steps), "--batch-size", str(c.batch_size), "--seq-len", str(c.seq_len)]
        argv += ["--compression", c.compression, "--max-outer-steps", str(c.outer_steps), "--seed", str(c.seed)]
        argv += ["--threads", str(c.threads), "--metrics-file", str(metrics), "--eval-every", "1"]
        # the first nodes begin the run together, so that none of them starts as a straggler that
        # misses the first steps' groups; a newcomer joins a run that has begun and does not wait
        argv += ["--start-with", str(c.nodes)]
        if c.overlap != "none":
            argv += ["--overlap", c.overlap]
        if c.lr is not None:
            argv += ["--lr", f"{c.lr:g}"]
        if c.warmup_steps is not None:
            argv += ["--warmup-steps", str(c.warmup_steps)]
        argv += ["--lr-schedule", c.lr_schedule]
        if c.lr_schedule != "constant":
            argv += ["--total-steps", str(c.total_steps or c.outer_steps * c.inner_steps)]
        if c.decay_fraction is not None:
            argv += ["--decay-fraction", f"{c.decay_fraction:g}"]
        if c.matchmaking_time is not None:
            argv += ["--matchmaking-time", f"{c.matchmaking_time:g}"]
        if c.max_group_size is not None:
            argv += ["--max-group-size", str(c.max_group_size)]
        if c.part_timeout is not None:
            argv += ["--part-timeout", f"{c.part_timeout:g}"]
        return argv + ["-v"] * c.verbose

    def poll(self) -> None:
        """Read what every node reported since the last poll and note the nodes that exited."""
        for child in self.children:
            code = child.proc.poll()  # before reading: an exited node's last events are on disk
            for event in child.tail.read():
                line = child.record.apply(event)
                if line:
                    self.display.event(line, routine=event.get("event") == "outer_step")
            if code is not None and child.record.exit_code is None:
                self._exited(child, code)
            elif child.record.status == STARTING and time.monotonic() - child.spawned_at > START_TIMEOUT_S:
                raise CliError(
                    f"{child.record.name} did not start within {START_TIMEOUT_S:g}s (see {child.record.log})"
                )

    def _exited(self, child: Child, code: int) -> None:
        record = child.record
        record.exit_code = code
        if record.status in (KILLED, CANCELLED, STRANDED):  # we did it
            return
        if not record.started:
            raise CliError(f"{record.name} failed at start (exit {code}): {last_line(record.log)}")
        record.status = DONE if code == 0 and self.reached_end(record) else FAILED
        self.display.event(f"{record.label()} exited with code {code} ({record.status})")

    def reached_end(self, record: NodeRecord) -> bool:
        return record.holds_final_state(self.config.outer_steps)

    def running(self) -> list[Child]:
        gone = (KILLED, CANCELLED, STRANDED)
        return [c for c in self.children if c.record.exit_code is None and c.record.status not in gone]

    def finished(self) -> bool:
        return not self.running()

    def winding_down(self) -> bool:
        """True once any node reached the last outer step or exited on its own: churn stops then."""
        return any(self.reached_end(c.record) or c.record.status in (DONE, FAILED) for c in self.children)

    def kill_random(self) -> None:
        """SIGKILL one random node that has started, unless it is the last one running."""
        candidates = [c for c in self.running() if c.record.status == ALIVE]
        if len(candidates) < 2:
            return
        victim = self.rng.choice(candidates)
        send(victim.proc, signal.SIGKILL)
        victim.record.status = KILLED
        self.display.event(f"killed {victim.record.label()} (SIGKILL) at outer step {victim.record.outer_step}")

    def join(self) -> None:
        """Start a newcomer, unless the last one is still starting: on a small machine, starts
        that pile up (each imports torch and reads the corpus) would starve the training nodes."""
        if any(c.record.status == STARTING for c in self.running()):
            return
        child = self.start_node()
        self.display.event(f"{child.record.name} joining")

    def strand_latecomers(self) -> None:
        """Once every node that reached the last outer step has left, a node still behind can
        never finish: the state it would fetch left with them (a node never goes on with a
        state of its own while the swarm's result exists). Stop it (SIGTERM)."""
        if not self.winding_down() or any(self.reached_end(c.record) for c in self.running()):
            return
        for child in self.running():
            send(child.proc, signal.SIGTERM)
            child.record.status = STRANDED
            self.display.event(f"{child.record.label()} stopped: the swarm finished before it caught up")

    def cancel_starting(self) -> None:
        """SIGKILL the newcomers that have not started yet: the swarm they meant to join is
        finishing. Nothing of theirs is lost: they have not trained."""
        for child in self.running():
            if child.record.status == STARTING:
                send(child.proc, signal.SIGKILL)
                child.record.status = CANCELLED
                self.display.event(f"{child.record.name} cancelled: the swarm is finishing")

    def close(self) -> None:
        """Stop every child and remove the links, then read what the nodes wrote while stopping."""
        procs = [c.proc for c in self.children] + [p for p in (self.bootstrap, self.dashboard) if p is not None]
        stop_processes(procs)
        if self.lab is not None:
            try:
                self.lab.close()
            except LabError as e:  # shown; the next run on this machine removes what is left
                self.display.event(f"could not remove every link: {e}")
        for child in self.children:
            for event in child.tail.read():
                child.record.apply(event)
            record = child.record
            if record.exit_code is None:
                record.exit_code = child.proc.poll()
            if record.status in (STARTING, ALIVE):  # a node that finished just now still counts as done
                record.status = DONE if record.exit_code == 0 and self.reached_end(record) else STOPPED


# --- the run ----------------------------------------------------------------------------------


class StopRequest:
    """Set by SIGINT, SIGTERM or SIGHUP (the terminal closed); the simulator's loop checks it
    between polls. A flag, not an exception: the children are stopped and the metrics written in
    order, never half-way, and a second signal while stopping cannot cut that short."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    stop = StopRequest()
    signals = [signal.SIGINT, signal.SIGTERM, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])]
    previous = {sig: signal.signal(sig, stop.handle) for sig in signals}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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


# --- command line ---------------------------------------------------------------------------


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
def main(**options: Any) -> None:
    """Run a training swarm of local swarm-node processes on 127.0.0.1 and show it in one table.

    With no options: the demo, 3 nodes of the tiny model for a few minutes on a laptop CPU;
    the loss falls. At the end (or on Ctrl+C) writes the metrics JSON and a loss plot.
    """
    run(build_config(**options))


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
    try:
        run_dir = Path(tempfile.mkdtemp(prefix="swarm-sim-")) if run_dir is None else run_dir
        metrics_out = metrics_out or run_dir / "metrics.json"
        plot_out = plot_out or metrics_out.with_suffix(".png")
        for folder in (run_dir, metrics_out.parent, plot_out.parent):
            folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CliError(f"cannot create {e.filename or run_dir}: {e.strerror or e}") from None
    return dataclasses.replace(config, run_dir=run_dir, metrics_out=metrics_out, plot_out=plot_out)
