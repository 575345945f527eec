"""What a lab is made of: its names, addresses and the exact `ip` and `tc` commands that build it,
as pure functions of (run name, owner PID, endpoints). lab.py runs them; tests read them.

A lab of run `sim-1a2b` owned by PID 4242, with endpoints `bootstrap` and `node0`:

    namespace swarmlab-4242-sim-1a2b              the bridge br0, and one port per endpoint:
                                                  v-bootstrap, v-node0 (veth), each shaped to its
                                                  endpoint's rate: what the endpoint receives
    namespace swarmlab-4242-sim-1a2b-bootstrap    lo up; eth0, the other end of v-bootstrap,
                                                  10.77.0.1/16, shaped to the rate: what it sends
    namespace swarmlab-4242-sim-1a2b-node0        the same with 10.77.0.2/16

Each endpoint's namespace holds exactly one process tree (process_control.start's `netns`): its
only way out is its own link, limited to its rate in both directions by a token bucket (tbf).
Nothing is made in the host's namespace, so labs never clash with the host's interfaces or with
each other (every lab uses the same subnet, each behind its own bridge), and deleting a lab's
namespaces deletes all of it: a veth pair dies with either end.

Every name starts with PREFIX and the owner's PID: a lab whose owner is gone (a killed run) is
found by name and removed at the next start (`stale_namespaces`). If the PID has since been
reused by another process, the leftovers wait for a later start.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Callable, Iterable, Sequence

from swarm.netlab.rates import Rate

PREFIX = "swarmlab-"
NETWORK = ipaddress.IPv4Network("10.77.0.0/16")  # inside the lab's namespaces only
BRIDGE = "br0"  # in the lab's own namespace
ENDPOINT_IF = "eth0"  # in each endpoint's namespace
PORT_PREFIX = "v-"  # the bridge-side end of an endpoint's veth: v-<endpoint>
IFNAMSIZ = 15  # the kernel's limit on an interface name
MAX_ENDPOINTS = 1000  # a Linux bridge takes at most 1024 ports

_RUN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}")
_ENDPOINT = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{IFNAMSIZ - len(PORT_PREFIX) - 1}}}")

Command = tuple[str, ...]  # argv; the program is "ip" or "tc", found on the host by lab.py


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
    """One place on the lab's network: a namespace with one shaped link to the bridge."""

    name: str  # who sits there: "bootstrap", "node0", ...
    index: int  # 0, 1, ... in the order they were added
    netns: str  # its process runs there: process_control.start(..., netns=netns)
    address: str  # its IPv4 address on the lab's network (eth0 in netns)
    rate: Rate  # each way
    port: str  # the bridge-side veth end, in the lab's namespace


@dataclasses.dataclass(frozen=True, slots=True)
class LabPlan:
    name: str  # the lab's namespace (the bridge), and the prefix of its endpoints' namespaces
    endpoints: tuple[Endpoint, ...]
    commands: tuple[Command, ...]  # run in order, they build the whole lab

    @property
    def namespaces(self) -> tuple[str, ...]:
        return (self.name, *(e.netns for e in self.endpoints))


def lab_name(run: str, pid: int) -> str:
    """The lab's namespace: PREFIX, the owner's PID, the run."""
    if not _RUN.fullmatch(run):
        raise ValueError(f"run name {run!r}: use 1-40 letters, digits, '_', '.' or '-'")
    if pid <= 0:
        raise ValueError(f"owner PID must be positive, got {pid}")
    return f"{PREFIX}{pid}-{run}"


def owner_pid(netns: str) -> int | None:
    """The PID in a lab namespace's name; None for a namespace that is not a lab's."""
    if not netns.startswith(PREFIX):
        return None
    pid, dash, _ = netns[len(PREFIX) :].partition("-")
    return int(pid) if dash and pid.isdigit() and int(pid) > 0 else None


def stale_namespaces(names: Iterable[str], alive: Callable[[int], bool]) -> list[str]:
    """The lab namespaces among `names` whose owner is gone, endpoints before their bridge."""
    stale = [name for name in names if (pid := owner_pid(name)) is not None and not alive(pid)]
    return sorted(stale, key=lambda name: (-len(name), name))  # a lab's name prefixes its endpoints'


def bridge_commands(lab: str) -> tuple[Command, ...]:
    return (
        ("ip", "netns", "add", lab),
        ("ip", "-n", lab, "link", "add", "name", BRIDGE, "type", "bridge"),
        ("ip", "-n", lab, "link", "set", BRIDGE, "up"),
    )


def address(index: int) -> str:
    """The index-th endpoint's address: 10.77.0.1, 10.77.0.2, ..."""
    if not 0 <= index < MAX_ENDPOINTS:
        raise ValueError(f"a lab holds at most {MAX_ENDPOINTS} endpoints")
    return str(NETWORK.network_address + index + 1)


def plan_endpoint(lab: str, index: int, name: str, rate: Rate) -> tuple[Endpoint, tuple[Command, ...]]:
    """The endpoint and the commands that add it to a built lab."""
    if not _ENDPOINT.fullmatch(name):
        limit = IFNAMSIZ - len(PORT_PREFIX)
        raise ValueError(f"endpoint name {name!r}: use 1-{limit} letters, digits, '_', '.' or '-'")
    endpoint = Endpoint(
        name=name, index=index, netns=f"{lab}-{name}", address=address(index), rate=rate, port=PORT_PREFIX + name
    )
    ns, port = endpoint.netns, endpoint.port
    commands = (
        *namespace_on_bridge(ns, lab, BRIDGE, port, f"{endpoint.address}/{NETWORK.prefixlen}"),
        shape(ns, ENDPOINT_IF, rate),  # what it sends
        shape(lab, port, rate),  # what it receives: the bridge sends it out through this port
    )
    return endpoint, commands


def namespace_on_bridge(ns: str, bridge_ns: str, bridge: str, port: str, cidr: str) -> tuple[Command, ...]:
    """A new namespace `ns` whose ENDPOINT_IF, at `cidr`, is the far end of a veth whose near end
    `port` is a port of `bridge` in namespace `bridge_ns`."""
    return (
        ("ip", "netns", "add", ns),
        ("ip", "-n", ns, "link", "set", "lo", "up"),
        ("ip", "-n", bridge_ns, "link", "add", "name", port, "type", "veth", "peer", "name", ENDPOINT_IF, "netns", ns),
        ("ip", "-n", bridge_ns, "link", "set", port, "master", bridge),
        ("ip", "-n", bridge_ns, "link", "set", port, "up"),
        ("ip", "-n", ns, "addr", "add", cidr, "dev", ENDPOINT_IF),
        ("ip", "-n", ns, "link", "set", ENDPOINT_IF, "up"),
    )


def shape(netns: str, device: str, rate: Rate) -> Command:
    """A token bucket on the device's egress: `rate` on average, `burst` bytes at once at most."""
    return (
        "tc", "-n", netns, "qdisc", "add", "dev", device, "root", "tbf",
        "rate", rate.tc, "burst", str(rate.burst_bytes), "limit", str(rate.limit_bytes),
    )  # fmt: skip


def plan_lab(run: str, pid: int, endpoints: Sequence[tuple[str, Rate]]) -> LabPlan:
    """The whole lab: the bridge, then each (name, rate) in order."""
    lab = lab_name(run, pid)
    names = [name for name, _ in endpoints]
    if len(set(names)) != len(names):
        raise ValueError(f"endpoint names must differ: {names}")
    built: list[Endpoint] = []
    commands = list(bridge_commands(lab))
    for index, (name, rate) in enumerate(endpoints):
        endpoint, more = plan_endpoint(lab, index, name, rate)
        built.append(endpoint)
        commands += more
    return LabPlan(name=lab, endpoints=tuple(built), commands=tuple(commands))


def teardown_commands(namespaces: Sequence[str]) -> tuple[Command, ...]:
    """Delete the namespaces, last made first (endpoints, then the bridge's)."""
    return tuple(("ip", "netns", "del", ns) for ns in reversed(namespaces))
