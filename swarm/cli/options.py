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
from swarm.p2p.maddr import parse_maddr, parse_maddrs

INITIAL_PEERS_ENV = "SWARM_INITIAL_PEERS"
_DHT_DEFAULTS = DHTConfig()
_P2P_DEFAULTS = P2PConfig()


def maddr_list(ctx: click.Context, param: click.Parameter, values: Sequence[str] | None) -> tuple[str, ...]:
    """A repeatable multiaddr option; each value may itself be a space or comma separated list."""
    texts = [t for value in values or () for t in value.replace(",", " ").split()]
    try:
        parse_maddrs(texts)
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
        callback=maddr_list,
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


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
verbose_option = click.option(
    "-v", "--verbose", count=True, help="Log at INFO (-v) or DEBUG (-vv); default: WARNING for serve, ERROR otherwise."
)


def maddr_argument(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        parse_maddr(value)
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
