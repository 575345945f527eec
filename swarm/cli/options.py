"""The options several swarm commands take, and their checks: multiaddrs, seconds, an identity
file, the limits of a public node, --json, -v and --compression. A bad value is a bad parameter
(one line, exit 2)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from swarm.cli.common import CliError
from swarm.dht.config import DHTConfig
from swarm.model.compression_spec import CompressionSpec
from swarm.p2p.config import P2PConfig
from swarm.p2p.errors import P2PError
from swarm.p2p.identity import Identity
from swarm.p2p.maddr import parse_address, parse_maddrs
from swarm.p2p.relay import RelayConfig

INITIAL_PEERS_ENV = "SWARM_INITIAL_PEERS"
_DHT_DEFAULTS = DHTConfig()
_P2P_DEFAULTS = P2PConfig()
_RELAY_DEFAULTS = RelayConfig()


def maddr_list(ctx: click.Context, param: click.Parameter, values: Sequence[str] | None) -> tuple[str, ...]:
    """A repeatable multiaddr option; each value may itself be a space or comma separated list."""
    texts = [t for value in values or () for t in value.replace(",", " ").split()]
    try:
        parse_maddrs(texts)
    except ValueError as e:  # MultiaddrError
        raise click.BadParameter(str(e), ctx, param) from None
    return tuple(texts)


def peer_maddr_list(ctx: click.Context, param: click.Parameter, values: Sequence[str] | None) -> tuple[str, ...]:
    """Like maddr_list, for peers to dial: a relayed multiaddr (.../p2p-circuit/p2p/PEER) is one too."""
    texts = [t for value in values or () for t in value.replace(",", " ").split()]
    for text in texts:
        try:
            parse_address(text)
        except ValueError as e:  # MultiaddrError
            raise click.BadParameter(str(e), ctx, param) from None
    return tuple(texts)


def positive_seconds(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise click.BadParameter(f"must be a positive number of seconds, got {value}", ctx, param)
    return value


def load_identity(path: Path | None) -> Identity | None:
    """The identity at path (created if missing), or None for a fresh throwaway one."""
    if path is None:
        return None
    try:
        return Identity.load_or_create(path)
    except P2PError as e:  # a file that is not a key: say how to get going again
        raise CliError(f"{e} (move it away to make a new identity, or pass another --identity)") from None
    except OSError as e:
        raise CliError(f"cannot create identity file {path}: {e.strerror or e}") from None


def initial_peers_option(*, help: str) -> Callable[[Any], Any]:
    return click.option(
        "--initial-peers",
        multiple=True,
        metavar="MADDR",
        envvar=INITIAL_PEERS_ENV,
        callback=peer_maddr_list,
        help=f"{help} Repeatable; a value may list several, separated by spaces or commas. "
        f"Default: ${INITIAL_PEERS_ENV}.",
    )


def identity_option(*, help: str) -> Callable[[Any], Any]:
    return click.option(
        "--identity", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE", default=None, help=help
    )


@dataclass(frozen=True, slots=True)
class OpenNetworkLimits:
    """What an operator of a public node tunes against floods (P2PConfig, DHTConfig)."""

    max_connections: int
    max_connections_per_ip: int
    exempt_ips: tuple[str, ...]
    dht_id_bits: int

    def p2p(self, **settings: Any) -> P2PConfig:
        return P2PConfig(max_connections=self.max_connections, max_connections_per_ip=self.max_connections_per_ip,
                         exempt_ips=self.exempt_ips, **settings)  # fmt: skip

    def dht(self) -> DHTConfig:
        return DHTConfig(id_bits=self.dht_id_bits)


def open_network_options(command: Callable[..., None]) -> Callable[..., None]:
    """--max-connections, --max-connections-per-ip, --exempt-ip, --dht-id-bits, handed to the
    command as `limits` (an OpenNetworkLimits)."""

    @functools.wraps(command)
    def wrapper(*args: Any, max_connections: int, max_connections_per_ip: int, exempt_ip: tuple[str, ...],
                dht_id_bits: int, **kwargs: Any) -> None:  # fmt: skip
        exempt = tuple(exempt_ip) if exempt_ip else _P2P_DEFAULTS.exempt_ips
        limits = OpenNetworkLimits(max_connections, max_connections_per_ip, exempt, dht_id_bits)
        command(*args, limits=limits, **kwargs)

    options = [
        click.option("--max-connections", type=click.IntRange(1), default=_P2P_DEFAULTS.max_connections,
                     show_default=True, help="Connections in all; at the cap, idle unknown peers make room."),
        click.option("--max-connections-per-ip", type=click.IntRange(1), default=_P2P_DEFAULTS.max_connections_per_ip,
                     show_default=True, help="Inbound connections from one IP (an IPv6 /64)."),
        click.option("--exempt-ip", multiple=True, metavar="IP",
                     help="Not held to the per-IP caps (repeatable; e.g. a NAT your own nodes share). "
                     f"Default: {', '.join(_P2P_DEFAULTS.exempt_ips)}."),
        click.option("--dht-id-bits", type=click.IntRange(0, 32), default=_DHT_DEFAULTS.id_bits, show_default=True,
                     help="Proof of work of a DHT id (2^bits hashes); every node of a DHT must use the same."),
    ]  # fmt: skip
    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def relay_options(command: Callable[..., None]) -> Callable[..., None]:
    """--relay on|off and the relay's limits, handed to the command as `relay` (a RelayConfig, or
    None: off). A node relays only when peers can dial it; NATed peers reserve on it."""

    @functools.wraps(command)
    def wrapper(*args: Any, relay: str, relay_reservations: int, relay_circuits: int, relay_circuit_mib: float,
                relay_circuit_minutes: float, **kwargs: Any) -> None:  # fmt: skip
        config = None
        if relay == "on":
            try:
                config = RelayConfig(max_reservations=relay_reservations, max_circuits=relay_circuits,
                                     circuit_bytes=max(1, int(relay_circuit_mib * 2**20)),
                                     circuit_seconds=relay_circuit_minutes * 60)  # fmt: skip
            except ValueError as e:
                raise click.UsageError(str(e)) from None
        command(*args, relay=config, **kwargs)

    options = [
        click.option("--relay", type=click.Choice(["on", "off"]), default="on", show_default=True,
                     help="Relay for peers behind NAT when peers can dial this node (circuits carry their "
                     "encrypted sessions; this node cannot read them)."),
        click.option("--relay-reservations", type=click.IntRange(1), default=_RELAY_DEFAULTS.max_reservations,
                     show_default=True, help="NATed peers this node relays for at once (at most "
                     f"{_RELAY_DEFAULTS.max_reservations_per_ip} per IP)."),
        click.option("--relay-circuits", type=click.IntRange(1), default=_RELAY_DEFAULTS.max_circuits,
                     show_default=True, help="Relayed connections at once."),
        click.option("--relay-circuit-mib", type=click.FloatRange(0.001), default=_RELAY_DEFAULTS.circuit_bytes / 2**20,
                     show_default=True, help="MiB one relayed connection may carry (both ways) before it is closed."),
        click.option("--relay-circuit-minutes", type=click.FloatRange(0.01), show_default=True,
                     default=_RELAY_DEFAULTS.circuit_seconds / 60, help="Minutes one relayed connection may last."),
    ]  # fmt: skip
    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
verbose_option = click.option(
    "-v", "--verbose", count=True, help="Log at INFO (-v) or DEBUG (-vv); default: WARNING for serve, ERROR otherwise."
)


def maddr_argument(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        parse_address(value)  # a peer to dial: directly or through a relay
    except ValueError as e:
        raise click.BadParameter(str(e), ctx, param) from None
    return value


def compression_option(codecs: Sequence[str]) -> Callable[[click.Context, click.Parameter, str], str]:
    """The click callback of `--compression CODEC[:DENSITY]` (model/compression_spec.py)."""

    def check(ctx: click.Context, param: click.Parameter, value: str) -> str:
        try:
            CompressionSpec.parse(value, codecs)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
        return value

    return check
