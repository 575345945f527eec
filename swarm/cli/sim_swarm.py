"""The processes of one swarm-sim run: the bootstrap DHT node, the training nodes and the
dashboard, each started with the command line a user would type and in its own session, followed
through its metrics file, churned, and stopped in order (SIGTERM, then SIGKILL after a grace
period). With --link, each child runs in a network namespace of its own behind a shaped link;
with --nat, the nodes run in home networks behind NAT routers and the bootstrap (a relay) alone
on the lab's "internet". A node is forked from the preloaded server and enters its namespace
itself; the bootstrap and the dashboard (swarm-dht) are exec'd under `ip netns exec`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType

from swarm.cli.common import CliError
from swarm.cli.sim_config import PUBLIC, SimConfig
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
from swarm.netlab import Home, Lab, LabError, Rate, parse_rate
from swarm.utils import process_control

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
POLL_S = 0.25  # how often the simulator reads the metrics files and checks its children
START_TIMEOUT_S = 180.0  # from spawn to a node's "start" event: imports, corpus, the codec's first build
BOOTSTRAP_TIMEOUT_S = 30.0
GRACE_S = 10.0  # between SIGTERM and SIGKILL when stopping the children
NAT_RATE = parse_rate("1gbit")  # --nat without --link: the homes' uplinks and the bootstrap's link


def console_script(name: str, module: str) -> list[str]:
    """The argv prefix that runs an installed command: the console script next to this
    interpreter (a venv, activated or not), else the same entry point through `python -c`."""
    beside_python = Path(sys.executable).parent / name
    if beside_python.exists():
        return [str(beside_python)]
    code = f"import sys; from {module} import main; sys.exit(main(prog_name={name!r}))"
    return [sys.executable, "-c", code]


def spawn(
    argv: Sequence[str], log: Path, stdout: Path | None = None, netns: str | None = None
) -> subprocess.Popen[bytes]:
    """Start a child in its own session (its own process group: signals from the terminal do
    not reach it, and stopping it by its group also stops anything it started), in the network
    namespace `netns` (None: ours)."""
    with contextlib.ExitStack() as files:  # the child holds its own copies of the descriptors
        err = files.enter_context(open(log, "wb"))
        out = files.enter_context(open(stdout, "wb")) if stdout is not None else err
        return process_control.start(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, netns=netns)


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
        self.lab: Lab | None = None  # with --link or --nat: every child's network namespace
        self.homes: list[Home | None] = []  # with --nat: the home networks in --nat's order (None: public)
        self.dashboard: subprocess.Popen[bytes] | None = None  # --dashboard: `swarm-dht inspect --serve`

    @property
    def records(self) -> list[NodeRecord]:
        return [c.record for c in self.children]

    def open_links(self) -> None:
        """With --link: the bridge the children's links meet at (each child's link is added
        when it starts); killed runs' leftovers are removed first."""
        if self.config.rate(None) is not None or self.config.nat is not None:
            try:
                self.lab = Lab.create(self.run_id)
                for i, (kind, count) in enumerate(self.config.nat or ()):
                    if kind == PUBLIC:
                        self.homes.append(None)
                        continue
                    home = self.lab.add_home(f"h{i}", kind, self.config.rate(None) or NAT_RATE)
                    self.homes.append(home)
                    self.display.event(f"home h{i}: {count} node(s) behind a {kind} NAT at {home.router.address}")
            except LabError as e:
                raise CliError(f"cannot build the links: {e}") from None

    def place(self, name: str, rate: Rate | None, record: NodeRecord | None = None) -> tuple[str | None, str]:
        """Where a child runs: (network namespace, listen multiaddr). With --link, in a namespace
        of its own behind a link of `rate` each way; with --nat, a node in its home network (the
        bootstrap on the internet side); otherwise in ours (None), on 127.0.0.1."""
        home = self.homes[self.config.home_of(len(self.children))] if self.homes and record is not None else None
        rate = rate or (NAT_RATE if self.homes else None)
        if self.lab is None or rate is None:
            return None, LOOPBACK
        try:
            endpoint = self.lab.add(name, rate) if home is None else self.lab.add_behind(home, name)
        except LabError as e:
            raise CliError(f"cannot put {name} on its link: {e}") from None
        if record is not None:
            record.link, record.address = str(rate), endpoint.address
        where = f"its own link: {endpoint.address}, {rate} each way"
        if home is not None:
            where = f"home {home.name} ({home.kind} NAT, {rate} uplink): {endpoint.address}"
        self.display.event(f"{name} on {where}")
        return endpoint.netns, f"/ip4/{endpoint.address}/tcp/0"

    def start_bootstrap(self, stop: StopRequest) -> None:
        """Start `swarm-dht serve --json` and read its first line: {"peer_id", "maddrs"}."""
        log, out = self.config.run_dir / "bootstrap.log", self.config.run_dir / "bootstrap.out"
        netns, listen = self.place("bootstrap", self.config.rate(None))
        argv = [*console_script("swarm-dht", "swarm.cli.dht"), "serve", "--json", "--host-maddrs", listen,
                "--identity", str(self.config.run_dir / "bootstrap.key")]  # fmt: skip
        argv += ["-v"] * self.config.verbose
        self.bootstrap = spawn(argv, log, stdout=out, netns=netns)
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
        netns, listen = self.place(name, self.config.rate(index), record)
        proc = spawn(self.node_argv(metrics, listen), record.log, netns=netns)
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
        # a key of its own in the run's folder: a node started after a kill is a newcomer with an
        # identity of its own, never the dead node's (a key in the user's folder would be reused)
        argv += ["--identity", str(metrics.with_suffix(".key"))]
        # the first nodes begin the run together, so that none of them starts as a straggler that
        # misses the first steps' groups; a newcomer joins a run that has begun and does not wait
        argv += ["--start-with", str(c.nodes)]
        if c.overlap != "none":
            argv += ["--overlap", c.overlap]
        if c.data != "stdlib":
            argv += ["--data", c.data]
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


# --- stopping ---------------------------------------------------------------------------------


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
