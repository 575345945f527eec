"""The soak's processes: a bootstrap DHT node and N `swarm-node` processes on 127.0.0.1, churned
by the schedule (soak_schedule.py) while every node's events, the harness's actions and each
process's RSS and open fds are recorded for the report and the checks (soak_checks.py).

A slot is one identity: its checkpoint folder (which holds its key), its metrics file and its
log, kept across its restarts (both appended to). A restart runs the same command line: the node
resumes from its checkpoint with the same PeerID. Every child runs in its own session and is
stopped at the end (SIGTERM, then SIGKILL), also when the harness fails or is interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import secrets
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from swarm.cli.common import CliError
from swarm.cli.sim_report import EventTail
from swarm.cli.sim_swarm import (
    BOOTSTRAP_TIMEOUT_S,
    GRACE_S,
    LOOPBACK,
    StopRequest,
    console_script,
    last_line,
    send,
    stop_processes,
)
from swarm.cli.soak_schedule import (
    GAP_S,
    JOIN,
    KILL_FETCH,
    KILL_ROUND,
    KINDS,
    LEAVE,
    LOAD,
    PAUSE,
    RESTARTED,
    TERM,
    Churn,
    schedule_lag,
)
from swarm.utils import process_control

POLL_S = 0.05  # the harness must see a round's start within a round of the tiny model (about 0.1-1 s)
SAMPLE_S = 5.0  # RSS and fds of every node process
AIM_S = 90.0  # the longest an aimed kill waits for its moment; then it kills a random node
MAX_OUTER_STEPS = 100_000  # the soak ends the nodes, not their run's length


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SoakConfig:
    nodes: int = 12
    minutes: float = 5.0
    seed: int = 0
    inner_steps: int = 20
    batch_size: int = 8
    seq_len: int = 64
    run_dir: Path = Path()
    verbose: int = 1  # the nodes' -v: their INFO lines say why each step went as it did
    churn: tuple[str, ...] = KINDS  # the kinds of churn the schedule deals (soak_schedule.py)
    gap_s: float = GAP_S  # the mean seconds between churn events

    def __post_init__(self) -> None:
        if self.nodes < 3 or not self.minutes > 0 or min(self.inner_steps, self.batch_size, self.seq_len) < 1:
            raise ValueError("the soak needs at least 3 nodes, a positive length and positive sizes")


@dataclasses.dataclass(slots=True)
class Slot:
    name: str
    tail: EventTail
    proc: subprocess.Popen[bytes] | None = None
    started: bool = False  # its current process has sent its "start" event
    last: str = ""  # the kind of its current process's last event (progress and network aside)
    fetching: bool = False  # a fetch_progress came and its fetch event has not
    spawned_at: float = 0.0


class Soak:
    """One soak run: call `run()` once; it returns what it recorded."""

    def __init__(self, config: SoakConfig, schedule: tuple[Churn, ...]) -> None:
        self.config, self.schedule = config, schedule
        self.run_id = f"soak-{secrets.token_hex(4)}"
        self.rng = random.Random(config.seed + 1)  # victims; the schedule has its own
        self.slots: list[Slot] = []
        self.events: list[dict[str, Any]] = []
        self.churn: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.bootstrap: subprocess.Popen[bytes] | None = None
        self.busy: list[subprocess.Popen[bytes]] = []
        self.peers: list[str] = []
        self.began = 0.0
        self.timers: list[tuple[float, str, Slot]] = []  # (monotonic time, "restart" | "cont", slot)

    # --- processes ----------------------------------------------------------------------------

    def _spawn(self, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:  # appended: a slot's log holds every incarnation's lines
            return process_control.start(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)

    def start_bootstrap(self) -> None:
        log, out = self.config.run_dir / "bootstrap.log", self.config.run_dir / "bootstrap.out"
        argv = [
            *console_script("swarm-dht", "swarm.cli.dht"),
            "serve",
            "--json",
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
        ]
        with open(log, "wb") as err, open(out, "wb") as first:
            self.bootstrap = process_control.start(argv, stdin=subprocess.DEVNULL, stdout=first, stderr=err)
        deadline = time.monotonic() + BOOTSTRAP_TIMEOUT_S
        while time.monotonic() < deadline and self.bootstrap.poll() is None:
            line, newline, _ = out.read_bytes().partition(b"\n")
            if newline:
                self.peers = list(json.loads(line)["maddrs"])
                return
            time.sleep(0.1)
        raise CliError(f"the bootstrap DHT node did not start: {last_line(log)}")

    def argv(self, slot: Slot, first: bool) -> list[str]:
        c, folder = self.config, self.config.run_dir / slot.name
        argv = [*console_script("swarm-node", "swarm.cli.node")]
        for maddr in self.peers:
            argv += ["--initial-peers", maddr]
        argv += ["--host-maddrs", LOOPBACK, "--run-id", self.run_id, "--model", "tiny",
                 "--inner-steps", str(c.inner_steps), "--batch-size", str(c.batch_size), "--seq-len", str(c.seq_len),
                 "--max-outer-steps", str(MAX_OUTER_STEPS), "--seed", str(c.seed), "--threads", "1",
                 "--metrics-file", str(folder / "events.jsonl"), "--checkpoint-dir", str(folder / "checkpoint"),
                 "--checkpoint-every", "1", "--eval-every", "1000"]  # fmt: skip
        if first:  # the first nodes begin the run together; later ones join it
            argv += ["--start-with", str(c.nodes)]
        return argv + ["-v"] * c.verbose

    def launch(self, slot: Slot, *, first: bool = False) -> None:
        folder = self.config.run_dir / slot.name
        folder.mkdir(parents=True, exist_ok=True)
        slot.proc = self._spawn(self.argv(slot, first), folder / "node.log")
        slot.started, slot.last, slot.fetching, slot.spawned_at = False, "", False, time.monotonic()

    def new_slot(self, *, first: bool = False) -> Slot:
        name = f"node{len(self.slots)}"
        slot = Slot(name, EventTail(self.config.run_dir / name / "events.jsonl"))
        self.slots.append(slot)
        self.launch(slot, first=first)
        return slot

    def running(self) -> list[Slot]:
        return [s for s in self.slots if s.proc is not None and s.proc.poll() is None]

    def up(self) -> list[Slot]:
        """Running, started and not paused: the nodes churn may pick."""
        paused = {slot.name for _, kind, slot in self.timers if kind == "cont"}
        return [s for s in self.running() if s.started and s.name not in paused]

    # --- the run --------------------------------------------------------------------------------

    def note(self, kind: str, slot: Slot | None, **fields: Any) -> None:
        self.churn.append({"time": round(time.time(), 3), "kind": kind, "slot": slot.name if slot else None, **fields})

    def poll(self) -> None:
        for slot in self.slots:
            for event in slot.tail.read():
                event["slot"] = slot.name
                self.events.append(event)
                kind = event.get("event")
                if kind == "start":
                    slot.started = True
                if kind == "fetch_progress":
                    slot.fetching = event.get("done_bytes") != event.get("total_bytes")
                elif kind not in ("progress", "network"):
                    slot.last, slot.fetching = str(kind), False

    def sample(self) -> None:
        now = round(time.time(), 3)
        for slot in self.running():
            assert slot.proc is not None
            with contextlib.suppress(OSError, ValueError):  # it may exit between the check and the read
                status = Path(f"/proc/{slot.proc.pid}/status").read_text()
                rss = next(
                    (int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), None
                )
                if rss is None:  # a process that has exited and is not reaped yet has no memory
                    continue
                fds = len(os.listdir(f"/proc/{slot.proc.pid}/fd"))
                self.samples.append(
                    {"time": now, "slot": slot.name, "pid": slot.proc.pid, "rss_bytes": rss, "fds": fds}
                )

    def act(self, churn: Churn, waited: float) -> bool:
        """Do one churn event; False while an aimed kill still waits for its moment."""
        up = self.up()
        keep = max(3, self.config.nodes // 2)
        if churn.kind == LOAD:
            self.busy = process_control.start_busy(os.cpu_count() or 1)
            self.timers.append((time.monotonic() + churn.seconds, "unload", self.slots[0]))
            self.note(LOAD, None, seconds=churn.seconds, processes=len(self.busy))
            return True
        if churn.kind == JOIN:
            if len(self.running()) >= self.config.nodes and len(up) > keep:
                leaver = self.rng.choice(up)
                assert leaver.proc is not None
                send(leaver.proc, signal.SIGTERM)
                self.note(LEAVE, leaver, phase=leaver.last)
            self.note(JOIN, self.new_slot())
            return True
        if len(up) <= keep:
            return waited > AIM_S  # too few up to take one away: wait, then skip it
        victim, aimed = None, None
        if churn.kind == KILL_ROUND:
            inside = [s for s in up if s.last == "round"]
            victim, aimed = (self.rng.choice(inside), "in_round") if inside else (None, None)
        elif churn.kind == KILL_FETCH:
            fetching = [s for s in self.running() if s.fetching]
            joining = [s for s in self.running() if not s.started and time.monotonic() - s.spawned_at > 3]
            if fetching:
                victim, aimed = self.rng.choice(fetching), "fetcher"
            elif joining:
                victim, aimed = self.rng.choice(up), "beside_fetch"
        if victim is None and churn.kind in (KILL_ROUND, KILL_FETCH) and waited < AIM_S:
            return False
        victim = victim or self.rng.choice(up)
        assert victim.proc is not None
        if churn.kind == PAUSE:
            send(victim.proc, signal.SIGSTOP)
            self.timers.append((time.monotonic() + churn.seconds, "cont", victim))
        else:
            send(victim.proc, signal.SIGTERM if churn.kind == TERM else signal.SIGKILL)
            if churn.kind in RESTARTED:
                self.timers.append((time.monotonic() + churn.seconds, "restart", victim))
        self.note(churn.kind, victim, aimed=aimed, seconds=churn.seconds, phase=victim.last)
        return True

    def fire_timers(self) -> None:
        now = time.monotonic()
        for timer in [t for t in self.timers if t[0] <= now]:
            self.timers.remove(timer)
            _, kind, slot = timer
            if kind == "unload":
                stop_processes(self.busy, grace=1.0)
                self.note("unload", None)
                self.busy = []
            elif kind == "cont" and slot.proc is not None:
                send(slot.proc, signal.SIGCONT)
                self.note("cont", slot)
            elif kind == "restart" and slot.proc is not None:
                if slot.proc.poll() is None and now - timer[0] < GRACE_S:  # a SIGTERMed node checkpoints first
                    self.timers.append((timer[0], kind, slot))  # the harness never blocks on it: next poll
                    continue
                if slot.proc.poll() is None:  # still running after the grace: stuck in its exit
                    send(slot.proc, signal.SIGKILL)
                    slot.proc.wait(5)
                self.launch(slot)
                self.note("restart", slot)

    def run(self, stop: StopRequest) -> None:
        """Until the run's minutes have passed, or SIGINT / SIGTERM (`stop`)."""
        self.start_bootstrap()
        for _ in range(self.config.nodes):
            self.new_slot(first=True)
        # the schedule counts from the swarm's start: when the first node has started
        while not any(s.started for s in self.slots) and not stop.requested:
            self.poll()
            if any(s.proc is not None and s.proc.poll() is not None for s in self.slots):
                bad = next(s for s in self.slots if s.proc is not None and s.proc.poll() is not None)
                raise CliError(f"{bad.name} exited at start: {last_line(self.config.run_dir / bad.name / 'node.log')}")
            time.sleep(0.2)
        self.began = time.monotonic()
        pending = list(self.schedule)
        waiting_since: float | None = None
        lag = 0.0  # how late the schedule runs after aimed kills that waited (soak_schedule.schedule_lag)
        next_sample = 0.0
        run_s = self.config.minutes * 60
        while (now := time.monotonic()) - self.began < run_s and not stop.requested:
            self.poll()
            self.fire_timers()
            if pending and now - self.began >= pending[0].at_s + lag:
                waiting_since = waiting_since or now
                if self.act(pending[0], now - waiting_since):
                    lag = schedule_lag(lag, pending.pop(0).at_s, now - self.began)
                    waiting_since = None
            if now >= next_sample:
                self.sample()
                next_sample = now + SAMPLE_S
            time.sleep(POLL_S)

    def close(self) -> None:
        """Stop everything this run started (paused nodes get SIGCONT first: a stopped process
        would not act on SIGTERM), then read the nodes' last events."""
        for _, kind, slot in self.timers:
            if kind == "cont" and slot.proc is not None and slot.proc.poll() is None:
                send(slot.proc, signal.SIGCONT)
        procs = [s.proc for s in self.slots if s.proc is not None]
        stop_processes([*procs, *self.busy, *([self.bootstrap] if self.bootstrap else [])])
        self.poll()

    def logs(self) -> dict[str, list[str]]:
        return {
            s.name: (self.config.run_dir / s.name / "node.log").read_text(errors="replace").splitlines()
            for s in self.slots
        }
