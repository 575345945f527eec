"""What the swarm commands share: option parsing, one-line errors, logging, JSON and tables.

Every failure a user can cause (a bad argument, an unreachable peer, a missing key, a refused
record, a timeout) ends the command with one line on stderr and a non-zero exit: 2 for a bad
command line, 1 for everything else. A traceback means a bug.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import logging
import math
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from swarm.dht.config import DHTConfig
from swarm.dht.errors import DHTError, RecordError
from swarm.dht.node import DHTNode
from swarm.model.compression_spec import CompressionSpec
from swarm.p2p.config import P2PConfig
from swarm.p2p.errors import P2PError
from swarm.p2p.identity import Identity
from swarm.p2p.maddr import parse_maddr, parse_maddrs
from swarm.utils import eventloop

if TYPE_CHECKING:  # rich is imported when a table is printed: --json answers start faster
    from rich.table import Table
    from rich.text import Text

T = TypeVar("T")

INITIAL_PEERS_ENV = "SWARM_INITIAL_PEERS"
CLIENT_HOST_MADDRS = ("/ip4/127.0.0.1/tcp/0",)  # a client is never dialed: listen on loopback only
DEFAULT_TIMEOUT = 15.0
_DHT_DEFAULTS = DHTConfig()
_P2P_DEFAULTS = P2PConfig()
PIPED_WIDTH = 240
BYTES_TAG = "$bytes"  # JSON form of a bytes value: {"$bytes": "<base64>"}


class CliError(click.ClickException):
    """A failure the command explains in one line (exit 1)."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        ctx = click.get_current_context(silent=True)
        self.command_path = ctx.command_path if ctx is not None else ""
        super().__init__(one_line(message))


_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2


class _OneLineMain:
    """Errors print as one line on stderr, usage errors included (click's default prints the
    usage and a hint over four lines)."""

    name: str | None

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            result = super().main(*args, standalone_mode=False, **kwargs)
        except _NO_ARGS_IS_HELP as e:  # `swarm-dht` alone: the help, as click prints it
            e.show()
            sys.exit(e.exit_code)
        except click.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else self.name
            click.echo(f"{where}: error: {one_line(e.format_message())} (see '{where} --help')", err=True)
            sys.exit(e.exit_code)
        except CliError as e:
            click.echo(f"{e.command_path or self.name}: error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            click.echo(f"{self.name}: error: {one_line(e.format_message())}", err=True)
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo(f"{self.name}: interrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:  # `swarm-dht peers | head`: stop quietly, as other tools do
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        sys.exit(result if isinstance(result, int) else 0)


class OneLineErrors(_OneLineMain, click.Group):
    """A command group with one-line errors."""


class OneLineCommand(_OneLineMain, click.Command):
    """A single command with one-line errors (use as `@click.command(cls=OneLineCommand)`)."""


def one_line(message: str) -> str:
    return " ".join(str(message).split())


# --- option callbacks ---------------------------------------------------------------------


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


def setup_logging(verbose: int, quiet_level: int = logging.WARNING) -> None:
    """Log to stderr at quiet_level, INFO with -v, DEBUG with -vv."""
    level = quiet_level if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# --- running a network operation ----------------------------------------------------------


def run_network(main: Callable[[], Coroutine[Any, Any, T]], timeout: float | None = None) -> T:
    """Run main() on a fresh (uv)loop; the errors a network or a peer can cause become CliError."""
    try:
        return eventloop.run(main())
    except (asyncio.TimeoutError, TimeoutError) as e:
        if isinstance(e, P2PError) and str(e):
            raise CliError(str(e)) from None
        after = f" within {timeout:g}s (see --timeout)" if timeout is not None else ""
        raise CliError(f"no answer{after}") from None
    except RecordError as e:
        raise CliError(f"record refused [{e.code}]: {e.message}") from None
    except (P2PError, DHTError) as e:
        raise CliError(str(e) or type(e).__name__) from None
    except ValueError as e:  # a malformed multiaddr or config value
        raise CliError(str(e)) from None
    except OSError as e:  # listening: address in use, permission denied
        raise CliError(f"{e.strerror or e}") from None


# --- client commands: a short-lived client-mode DHT node -----------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ClientOptions:
    """The options every client command takes (see `client_options`)."""

    initial_peers: tuple[str, ...]
    identity: Identity | None  # None: a fresh throwaway identity
    host_maddrs: tuple[str, ...]
    timeout: float  # the whole command: bootstrap and the operation
    as_json: bool

    def dht_config(self) -> DHTConfig:
        t = self.timeout
        return DHTConfig(rpc_timeout=min(_DHT_DEFAULTS.rpc_timeout, t), lookup_timeout=t, bootstrap_timeout=t)

    def p2p_config(self) -> P2PConfig:
        t = min(_P2P_DEFAULTS.connect_timeout, self.timeout)
        return P2PConfig(host_maddrs=self.host_maddrs, connect_timeout=t, handshake_timeout=t)


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


def client_options(*, bootstrap: bool = True) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Add the shared client options (--initial-peers only when the command bootstraps) and
    hand them to the command as `opts`."""

    def decorator(fn: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(fn)
        def command(
            *args: Any,
            identity: Path | None,
            host_maddrs: tuple[str, ...],
            timeout: float,
            as_json: bool,
            verbose: int,
            initial_peers: tuple[str, ...] = (),
            **kwargs: Any,
        ) -> None:
            setup_logging(verbose, logging.ERROR)  # the one error line says it: no warnings around it
            opts = ClientOptions(
                initial_peers=initial_peers,
                identity=load_identity(identity),
                host_maddrs=host_maddrs or CLIENT_HOST_MADDRS,
                timeout=timeout,
                as_json=as_json,
            )
            fn(*args, opts=opts, **kwargs)

        decorators = [
            *(
                [initial_peers_option(help="Multiaddr of a DHT node to bootstrap from (required).")]
                if bootstrap
                else []
            ),
            identity_option(help="Key file of this client (created if missing). Default: a throwaway identity."),
            click.option(
                "--host-maddrs",
                multiple=True,
                metavar="MADDR",
                callback=maddr_list,
                help=f"Where this client listens. Default: {CLIENT_HOST_MADDRS[0]}.",
            ),
            click.option(
                "--timeout",
                type=float,
                default=DEFAULT_TIMEOUT,
                show_default=True,
                callback=positive_seconds,
                metavar="SECONDS",
                help="Give up after this long (bootstrap and the operation together).",
            ),
            json_option,
            verbose_option,
        ]
        for decorate in reversed(decorators):
            command = decorate(command)
        return command

    return decorator


def with_client(opts: ClientOptions, op: Callable[[DHTNode], Awaitable[T]], *, bootstrap: bool = True) -> T:
    """Start a client-mode node, bootstrap it, run op(node), close it; errors become one line."""
    if bootstrap and not opts.initial_peers:
        raise click.UsageError(
            f"--initial-peers is required: the multiaddr of any node of the DHT (or set ${INITIAL_PEERS_ENV})",
            click.get_current_context(silent=True),
        )

    async def main() -> T:
        node = DHTNode(
            opts.identity,
            opts.initial_peers if bootstrap else (),
            config=opts.dht_config(),
            p2p_config=opts.p2p_config(),
            client_mode=True,
        )
        try:
            return await asyncio.wait_for(_start_then(node, op), opts.timeout)
        finally:
            await node.close()

    return run_network(main, opts.timeout)


async def _start_then(node: DHTNode, op: Callable[[DHTNode], Awaitable[T]]) -> T:
    await node.start()
    return await op(node)


def maddr_argument(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        parse_maddr(value)
    except ValueError as e:
        raise click.BadParameter(str(e), ctx, param) from None
    return value


# --- output -------------------------------------------------------------------------------


def jsonable(value: Any) -> Any:
    """A value read from the DHT (msgpack types) in JSON types: bytes become {"$bytes": base64},
    bytes map keys "$bytes:<base64>", other non-string map keys their JSON text."""
    if isinstance(value, bytes | bytearray | memoryview):
        return {BYTES_TAG: base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        return {json_key(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def json_key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, bytes):
        return f"{BYTES_TAG}:{base64.b64encode(key).decode('ascii')}"
    return json.dumps(jsonable(key))


def echo_json(obj: Any) -> None:
    """One JSON object on one line of stdout, flushed (scripts read it line by line)."""
    click.echo(json.dumps(obj, separators=(",", ":")))
    sys.stdout.flush()


def show(value: Any) -> str:
    """A DHT value for a table cell: strings as they are, everything else as compact JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(jsonable(value), separators=(", ", ": "))


def cell(value: Any) -> Text:
    """Table cells are Text, never markup: subkeys like [owner:...] must print as they are."""
    from rich.text import Text

    return Text(value if isinstance(value, str) else show(value))


def new_table(*columns: str, title: str | None = None) -> Table:
    from rich.table import Table

    return Table(*columns, title=title)


def print_table(table: Table) -> None:
    """A table on stdout; piped output (unless $COLUMNS says otherwise) gets a wide fixed width
    so that nothing is cut."""
    from rich.console import Console

    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    Console(width=PIPED_WIDTH if wide else None, highlight=False).print(table)


def duration(seconds: float) -> str:
    """3725 -> '1h 2m', 59.4 -> '59s', -3 -> 'expired'."""
    if not math.isfinite(seconds):
        return "?"
    if seconds < 0:
        return "expired"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def compression_option(codecs: Sequence[str]) -> Callable[[click.Context, click.Parameter, str], str]:
    """The click callback of `--compression CODEC[:DENSITY]` (model/compression_spec.py)."""

    def check(ctx: click.Context, param: click.Parameter, value: str) -> str:
        try:
            CompressionSpec.parse(value, codecs)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
        return value

    return check
