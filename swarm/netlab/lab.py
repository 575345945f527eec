"""A lab on this machine: the plan of plan.py, built with `ip` and `tc`, and always removed.

    with Lab.create("bench-1", [("a", parse_rate("20mbit")), ("b", parse_rate("1gbit"))]) as lab:
        a = lab.endpoint("a")
        subprocess.run([*exec_prefix(a), "python", "server.py", "--host", a.address])
        lab.add("c", parse_rate("100mbit"))  # a lab can grow while it runs

Needs root and iproute2 (`ip`, `tc`): `missing()` says in one line which is absent, before
anything is made. Building is all or nothing: a command that fails (or an interruption)
removes whatever the lab had made, and the error names the command and what it printed.
`close()` (also on leaving the `with`) stops any process still inside the lab's namespaces
(SIGKILL: the owner should have stopped them first; a live process would keep its namespace,
and so its links, alive) and deletes the namespaces. Signals are the owner's to handle: turn
SIGTERM into a call of close() (swarm-sim does); a SIGKILLed owner's lab is removed by the next
`Lab.create` on this machine (`remove_leftovers`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from types import TracebackType

from swarm.netlab.delay import delay_commands
from swarm.netlab.nat import Home, plan_behind, plan_home
from swarm.netlab.plan import Command, Endpoint, bridge_commands, lab_name, plan_endpoint, stale_namespaces
from swarm.netlab.rates import Rate

logger = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 10.0  # one `ip` or `tc` call; they take milliseconds
SBIN = ("/usr/sbin", "/sbin")  # where iproute2 lives, often outside a user's PATH


class LabError(RuntimeError):
    """The lab cannot be built (or removed); the message is one line that says why."""


def tool(name: str) -> str | None:
    """The path of an iproute2 program, on PATH or in the sbin folders."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", os.defpath), *SBIN]))


def missing_nat() -> str | None:
    """What this machine lacks to build a lab with NAT routers (Lab.add_home), in one line."""
    problem = missing()
    if problem is None and tool("nft") is None:
        problem = f"needs nftables: nft not found on PATH or in {', '.join(SBIN)} (apt-get install nftables)"
    return problem


def missing_delay() -> str | None:
    """What this machine lacks to delay an endpoint's sending (Lab.delay, delay.py), in one line."""
    problem = missing()
    if problem is None and not os.path.exists("/dev/net/tun"):
        problem = "needs /dev/net/tun (the TUN driver) to delay what an endpoint sends"
    return problem


def missing() -> str | None:
    """What this machine lacks to build a lab, in one line; None when nothing is missing."""
    if not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root to make network namespaces and shape links (run it with sudo)"
    absent = [name for name in ("ip", "tc") if tool(name) is None]
    if absent:
        return f"needs iproute2: {' and '.join(absent)} not found on PATH or in {', '.join(SBIN)}"
    return None


def run(command: Command) -> str:
    """Run one `ip`/`tc` command; its stdout, or LabError naming it and its last line of stderr."""
    program = tool(command[0])
    if program is None:
        raise LabError(f"{command[0]} not found")
    try:
        # `ip netns exec` runs sysctl and nft from PATH: the sbin folders must be on it
        path = os.pathsep.join([os.environ.get("PATH", os.defpath), *SBIN])
        done = subprocess.run(
            [program, *command[1:]],
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
            env={**os.environ, "PATH": path},
        )
    except subprocess.TimeoutExpired:
        raise LabError(f"`{' '.join(command)}` did not finish within {COMMAND_TIMEOUT_S:g}s") from None
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        why = lines[-1] if lines else f"exit {done.returncode}"
        raise LabError(f"`{' '.join(command)}` failed: {why}")
    return done.stdout


def namespaces() -> list[str]:
    """The named network namespaces on this machine (`ip netns list`: "name" or "name (id: 3)")."""
    return [line.split()[0] for line in run(("ip", "netns", "list")).splitlines() if line.strip()]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def remove(netns: Sequence[str]) -> None:
    """Stop the processes inside each namespace and delete it; every one is tried, the first
    failure is raised after. A namespace already gone is no failure."""
    present = set(namespaces())
    errors: list[LabError] = []
    for ns in netns:
        if ns not in present:
            continue
        try:
            for pid in run(("ip", "netns", "pids", ns)).split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)  # it exits from its namespace at once, zombie or not
            run(("ip", "netns", "del", ns))
        except LabError as e:
            errors.append(e)
    if errors:
        raise errors[0]


def remove_leftovers(alive: Callable[[int], bool] = pid_alive) -> list[str]:
    """Remove the labs whose owner process is gone (a run that was SIGKILLed); their names."""
    stale = stale_namespaces(namespaces(), alive)
    if stale:
        logger.warning("removing %d namespace(s) left by a killed run: %s", len(stale), " ".join(stale))
        remove(stale)
    return stale


class Lab:
    """A built lab: a bridge in a namespace of its own and the endpoints added so far."""

    def __init__(self, name: str) -> None:  # use Lab.create: it builds the bridge first
        self.name = name
        self.endpoints: list[Endpoint] = []  # on the bridge (public hosts, routers) and behind routers
        self.homes: list[Home] = []
        self._on_bridge = 0  # endpoints on the bridge so far: the next one's address index
        self._behind: dict[str, int] = {}  # hosts behind each home's router so far
        self._delays: list[subprocess.Popen[str]] = []  # one process per delayed endpoint (delay.py)
        self._made: list[str] = [name]  # namespaces to delete, in the order they were made
        self._closed = False

    @classmethod
    def create(cls, run_name: str, endpoints: Sequence[tuple[str, Rate]] = ()) -> Lab:
        """Check the machine, remove killed runs' leftovers, build the bridge and the endpoints."""
        problem = missing()
        if problem is not None:
            raise LabError(problem)
        remove_leftovers()
        lab = cls(lab_name(run_name, os.getpid()))
        try:
            for command in bridge_commands(lab.name):
                run(command)
            for name, rate in endpoints:
                lab.add(name, rate)
        except BaseException:
            _undo(lab.close)
            raise
        return lab

    def add(self, name: str, rate: Rate) -> Endpoint:
        """A new endpoint on the bridge; on failure nothing of it remains (the lab stays)."""
        self._check_new(name)
        endpoint, commands = plan_endpoint(self.name, self._on_bridge, name, rate)
        self._build(endpoint.netns, commands)
        self._on_bridge += 1
        self.endpoints.append(endpoint)
        return endpoint

    def add_home(self, name: str, kind: str, rate: Rate) -> Home:
        """A home network behind a NAT router of `kind` (nat.py), its uplink shaped to `rate`;
        add its hosts with add_behind(). Needs nft (missing_nat())."""
        self._check_new(name)
        home, commands = plan_home(self.name, self._on_bridge, len(self.homes), name, kind, rate)
        self._build(home.netns, commands)
        self._on_bridge += 1
        self.endpoints.append(home.router)
        self.homes.append(home)
        return home

    def add_behind(self, home: Home, name: str) -> Endpoint:
        """A host on `home`'s LAN; it reaches the bridge only through the home's router."""
        self._check_new(name)
        if home not in self.homes:
            raise ValueError(f"lab {self.name} has no home {home.name!r}")
        endpoint, commands = plan_behind(self.name, home, self._behind.get(home.name, 0), name)
        self._build(endpoint.netns, commands)
        self._behind[home.name] = self._behind.get(home.name, 0) + 1
        self.endpoints.append(endpoint)
        return endpoint

    def delay(self, endpoint: Endpoint, ms: int) -> None:
        """Delay what `endpoint` sends by `ms` milliseconds (delay.py: this kernel has no netem)."""
        if self._closed:
            raise LabError(f"lab {self.name} is closed")
        for command in delay_commands(endpoint.netns, ms):
            run(command)
        argv = [*exec_prefix(endpoint), sys.executable, "-m", "swarm.netlab.delay", "--ms", str(ms)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._delays.append(proc)
        ready, _, _ = select.select([proc.stdout], [], [], COMMAND_TIMEOUT_S)
        line = proc.stdout.readline() if ready and proc.stdout is not None else ""
        if line.strip() != "ready":
            proc.kill()
            _, err = proc.communicate(timeout=COMMAND_TIMEOUT_S)
            why = (err.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            raise LabError(f"the delay of {endpoint.name} did not start: {why}")

    def _check_new(self, name: str) -> None:
        if self._closed:
            raise LabError(f"lab {self.name} is closed")
        if any(e.name == name for e in self.endpoints):
            raise ValueError(f"lab {self.name} already has an endpoint {name!r}")

    def _build(self, netns: str, commands: Sequence[Command]) -> None:
        """Run the commands that make `netns` (and what lives in it); on failure nothing of it remains."""
        self._made.append(netns)  # before the first command: an interruption still removes it
        try:
            for command in commands:
                run(command)
        except BaseException:
            if _undo(lambda: remove([netns])):
                self._made.remove(netns)
            raise

    def endpoint(self, name: str) -> Endpoint:
        for endpoint in self.endpoints:
            if endpoint.name == name:
                return endpoint
        raise KeyError(name)

    def close(self) -> None:
        """Stop what still runs inside and delete every namespace of the lab; idempotent."""
        if self._closed:
            return
        self._closed = True
        for proc in self._delays:  # ours to stop and reap; remove() would only SIGKILL them
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):  # the namespaces go all the same
                proc.wait(COMMAND_TIMEOUT_S)
        remove(self._made[::-1])

    def __enter__(self) -> Lab:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def _undo(cleanup: Callable[[], None]) -> bool:
    """Undo after a failure without hiding it: a cleanup that fails too is logged; True if it worked."""
    try:
        cleanup()
    except LabError as e:
        logger.error("could not undo a half-built lab: %s", e)
        return False
    return True


def exec_prefix(endpoint: Endpoint) -> list[str]:
    """The argv prefix that runs a command inside the endpoint's namespace (`ip netns exec`).
    A swarm-node is better started with process_control.start(..., netns=endpoint.netns): it is
    forked from the preloaded server and enters the namespace itself."""
    ip = tool("ip")
    if ip is None:
        raise LabError("ip not found")
    return [ip, "netns", "exec", endpoint.netns]
