"""The commands that ask the DHT one thing: a short-lived client-mode DHT node (it asks, serves
nothing, peers don't add it to their tables), the options it takes, and running one operation on
it with every error as one line."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click

from swarm.cli.common import run_network, setup_logging
from swarm.cli.options import (
    INITIAL_PEERS_ENV,
    identity_option,
    initial_peers_option,
    json_option,
    load_identity,
    maddr_list,
    positive_seconds,
    verbose_option,
)
from swarm.dht.config import DHTConfig
from swarm.dht.node import DHTNode
from swarm.p2p.config import P2PConfig
from swarm.p2p.identity import Identity

T = TypeVar("T")

CLIENT_HOST_MADDRS = ("/ip4/127.0.0.1/tcp/0",)  # a client is never dialed: listen on loopback only
DEFAULT_TIMEOUT = 45.0  # a busy machine: inspect at load 28 on 2 cores answered after 36 s
_DHT_DEFAULTS = DHTConfig()
_P2P_DEFAULTS = P2PConfig()


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
