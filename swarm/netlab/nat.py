"""Home networks behind NAT routers in a lab: the pure plan (names, addresses, nftables rules, the
exact commands). lab.py runs them (Lab.add_home, Lab.add_behind) and removes them with the lab.

A lab's bridge is the "internet": public endpoints (Lab.add) and each home's router sit on it
with an address of plan.NETWORK. A home `h0` (the k-th) is::

    namespace <lab>-h0      the router: eth0 on the internet bridge (shaped like an endpoint's
                            link: the home's uplink), the bridge lan0 with 10.78.k.1/24, IPv4
                            forwarding on, and the nftables table `swarmnat` below
    namespace <lab>-a       a host of the home: eth0 (the other end of h-a on lan0),
                            10.78.k.2/24, default route via 10.78.k.1

The router masquerades what the LAN sends out of eth0, forwards back only what belongs to a
connection the LAN opened (conntrack: established or related) and drops every unsolicited packet
that reaches it on eth0, so nobody outside can open a connection to a host inside, and a SYN
that arrives before its mapping exists is dropped rather than answered with a RST (which would
kill a hole punch). Netfilter's plain `masquerade` keeps a connection's source port when it is
free and maps a socket the same way whatever the destination, filtering by address and port:
a port-restricted cone NAT ("cone"). `masquerade fully-random` gives every connection a new
random port: a symmetric NAT ("symmetric"), where hole punching cannot work. Hosts behind one
router do not reach each other through its public address (no hairpinning), as on most routers.

All addresses are private (10.77.0.0/16 outside, 10.78.0.0/16 inside) and exist only in the
lab's namespaces; code that judges observed addresses must not take 10/8 for "not public" here.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re

from swarm.netlab.plan import ENDPOINT_IF, IFNAMSIZ, Command, Endpoint, namespace_on_bridge, plan_endpoint
from swarm.netlab.rates import Rate

NAT_KINDS = ("cone", "symmetric")
LANS = ipaddress.IPv4Network("10.78.0.0/16")  # a /24 per home, inside the lab only
MAX_HOMES = 256
MAX_HOSTS_PER_HOME = 250
LAN_BRIDGE = "lan0"  # in the router's namespace
HOST_PORT_PREFIX = "h-"  # the router-side end of a home host's veth: h-<host>
TABLE = "swarmnat"  # the router's nftables table
_HOST = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{IFNAMSIZ - len(HOST_PORT_PREFIX) - 1}}}")


@dataclasses.dataclass(frozen=True, slots=True)
class Home:
    """One home network: its router (an endpoint on the internet bridge) and its LAN."""

    name: str
    kind: str  # "cone" or "symmetric"
    router: Endpoint  # router.address is the home's public address, as peers outside see it
    lan: str  # e.g. 10.78.0.0/24
    gateway: str  # the router's LAN address, the hosts' default route

    @property
    def netns(self) -> str:
        return self.router.netns


def lan_of(home_index: int) -> ipaddress.IPv4Network:
    if not 0 <= home_index < MAX_HOMES:
        raise ValueError(f"a lab holds at most {MAX_HOMES} homes")
    return ipaddress.IPv4Network((int(LANS.network_address) + (home_index << 8), 24))


def nat_ruleset(kind: str, lan: str, *, wan: str = ENDPOINT_IF, lan_if: str = LAN_BRIDGE) -> str:
    """The router's nftables table: masquerade out, established back in, nothing else in."""
    if kind not in NAT_KINDS:
        raise ValueError(f"NAT kind {kind!r}: use one of {', '.join(NAT_KINDS)}")
    mapping = "masquerade fully-random" if kind == "symmetric" else "masquerade"
    return (
        f"table ip {TABLE} {{\n"
        f"  chain nat_out {{ type nat hook postrouting priority srcnat; policy accept;\n"
        f'    oifname "{wan}" ip saddr {lan} {mapping}; }}\n'
        f"  chain from_lan {{ type filter hook forward priority filter; policy drop;\n"
        # the LAN's own traffic is switched, as on a home router (where br_netfilter is loaded,
        # bridged packets cross this chain too)
        f'    iifname "{lan_if}" oifname "{wan}" accept; ct state established,related accept;\n'
        f'    iifname "{lan_if}" oifname "{lan_if}" accept; }}\n'
        f"  chain to_router {{ type filter hook input priority filter; policy accept;\n"
        f'    iifname "{wan}" ct state established,related accept; iifname "{wan}" drop; }}\n'
        f"}}"
    )


def plan_home(
    lab: str, index: int, home_index: int, name: str, kind: str, rate: Rate
) -> tuple[Home, tuple[Command, ...]]:
    """A home's router: the index-th endpoint on the internet bridge, and the home_index-th LAN."""
    lan = lan_of(home_index)
    gateway = str(lan.network_address + 1)
    router, wan_commands = plan_endpoint(lab, index, name, rate)
    ns = router.netns
    commands = (
        *wan_commands,
        ("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"),
        ("ip", "-n", ns, "link", "add", "name", LAN_BRIDGE, "type", "bridge"),
        ("ip", "-n", ns, "addr", "add", f"{gateway}/{lan.prefixlen}", "dev", LAN_BRIDGE),
        ("ip", "-n", ns, "link", "set", LAN_BRIDGE, "up"),
        ("ip", "netns", "exec", ns, "nft", nat_ruleset(kind, str(lan))),
    )
    return Home(name=name, kind=kind, router=router, lan=str(lan), gateway=gateway), commands


def plan_behind(lab: str, home: Home, host_index: int, name: str) -> tuple[Endpoint, tuple[Command, ...]]:
    """The host_index-th host of `home`: a namespace on the home's LAN, routed through its router."""
    if not _HOST.fullmatch(name):
        limit = IFNAMSIZ - len(HOST_PORT_PREFIX)
        raise ValueError(f"host name {name!r}: use 1-{limit} letters, digits, '_', '.' or '-'")
    port = HOST_PORT_PREFIX + name
    if not 0 <= host_index < MAX_HOSTS_PER_HOME:
        raise ValueError(f"a home holds at most {MAX_HOSTS_PER_HOME} hosts")
    lan = ipaddress.IPv4Network(home.lan)
    address = str(lan.network_address + 2 + host_index)
    ns, router = f"{lab}-{name}", home.netns
    host = Endpoint(name=name, index=host_index, netns=ns, address=address, rate=home.router.rate, port=port)
    commands = (
        *namespace_on_bridge(ns, router, LAN_BRIDGE, port, f"{address}/{lan.prefixlen}"),
        ("ip", "-n", ns, "route", "add", "default", "via", home.gateway),
    )
    return host, commands
