"""swarm-dht: run a DHT-only node, or ask the DHT from the command line.

    swarm-dht serve --host-maddrs /ip4/0.0.0.0/tcp/31337 --identity bootstrap.key
    swarm-dht store KEY VALUE --initial-peers MADDR [--subkey S [--owned]] [--ttl SECONDS]
    swarm-dht get KEY --initial-peers MADDR [--latest]
    swarm-dht ping MADDR
    swarm-dht peers --initial-peers MADDR
    swarm-dht inspect --run-id RUN --initial-peers MADDR [--serve PORT]

`serve` is a full node (bootstrap node on a public server). The other commands start a
short-lived client-mode DHTNode (it asks, serves nothing, peers don't add it to their tables),
bootstrap from --initial-peers, do one thing and close. `--json` prints one JSON object per
answer; bytes values appear as {"$bytes": "<base64>"}.

This module holds the group and the commands about nodes (serve, ping, peers); store and get are
in dht_records.py, inspect in dht_inspect.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import click

from swarm.cli.common import OneLineErrors, run_network, setup_logging
from swarm.cli.dht_client import ClientOptions, client_options, with_client
from swarm.cli.dht_inspect import inspect
from swarm.cli.dht_records import get, store
from swarm.cli.node_identity import node_identity
from swarm.cli.options import (
    OpenNetworkLimits,
    identity_option,
    initial_peers_option,
    json_option,
    maddr_argument,
    maddr_list,
    open_network_options,
    relay_options,
    verbose_option,
)
from swarm.cli.output import cell, duration, echo_json, new_table, print_table
from swarm.dht.id_proof import proof_path_for
from swarm.dht.node import DHTNode
from swarm.node.relay_records import advertise_relay_forever
from swarm.p2p.host import P2PHost
from swarm.p2p.maddr import TcpAddress, parse_address
from swarm.p2p.relay import RelayConfig, RelayService
from swarm.utils.supervised import Supervised

SERVE_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/31337",)


@click.group(cls=OneLineErrors, name="swarm-dht", context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Run a DHT node of the swarm, or ask the DHT: get, store, ping, peers, inspect."""


# store, get and inspect are written in modules of their own; this group is their one entry point
main.add_command(store)
main.add_command(get)
main.add_command(inspect)


# --- serve ----------------------------------------------------------------------------------


@main.command()
@click.option(
    "--host-maddrs",
    multiple=True,
    metavar="MADDR",
    callback=maddr_list,
    help=f"Where to listen (repeatable). Default: {SERVE_HOST_MADDRS[0]}.",
)
@click.option(
    "--announce-maddrs",
    multiple=True,
    metavar="MADDR",
    callback=maddr_list,
    help="What to tell peers instead of the listen addresses (a public IP behind NAT).",
)
@identity_option(
    help="Key file of this node (mode 0600), created if missing and kept: a restarted node keeps its "
    "PeerID. Default: ~/.config/swarm/identity/dht[-tcpPORT].key; 'ephemeral': a new one at each start."
)
@initial_peers_option(help="Multiaddr of a node to join; none: this is the first node of a new DHT.")
@open_network_options
@relay_options
@json_option
@verbose_option
def serve(
    host_maddrs: tuple[str, ...],
    announce_maddrs: tuple[str, ...],
    identity: Path | None,
    initial_peers: tuple[str, ...],
    as_json: bool,
    verbose: int,
    limits: OpenNetworkLimits,
    relay: RelayConfig | None,
) -> None:
    """Run a DHT-only node (e.g. a bootstrap node) until SIGINT or SIGTERM. It relays for peers
    behind NAT (--relay on, the default), so that one public server can start a run of volunteers
    at home.

    Prints its multiaddrs and the line to join it; with --json, the first line of output is
    {"peer_id": ..., "maddrs": [...], "pid": ...}, and the last, at exit, {"relayed_bytes": N}: what its
    relay carried, both ways, all circuits together.
    """
    setup_logging(verbose)
    node_key, key_file = node_identity(identity, checkpoint_dir=None, name="dht",
                                       host_maddrs=host_maddrs or SERVE_HOST_MADDRS)  # fmt: skip

    async def run() -> None:
        p2p_config = limits.p2p(host_maddrs=host_maddrs or SERVE_HOST_MADDRS, announce_maddrs=announce_maddrs)
        proof_path = proof_path_for(key_file) if key_file is not None else None  # the id proof, kept with the key
        host = P2PHost(node_key, p2p_config)
        node = DHTNode(initial_peers=initial_peers, config=limits.dht(), host=host, id_proof_path=proof_path)
        service = RelayService(host, relay) if relay is not None else None
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):  # no signal handlers on Windows' loop
                loop.add_signal_handler(sig, stop.set)
        stopping = asyncio.ensure_future(stop.wait())
        node_started = False
        # NATed nodes learn relays from the DHT's records, not only from their initial peers
        advert = Supervised("relay record", lambda: advertise_relay_forever(node, lambda: node.visible_maddrs))
        try:
            await host.start()
            if service is not None:
                await service.start()
            starting = asyncio.ensure_future(node.start())
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():  # stopped while bootstrapping
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
                return
            starting.result()
            node_started = True
            if service is not None:
                advert.start()
            _announce(node, as_json, key_file)
            await stopping
        finally:
            stopping.cancel()
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError):
                    loop.remove_signal_handler(sig)
            await advert.close()
            await node.close()
            if service is not None:
                await service.close()
            await host.close()
            if as_json and node_started:
                echo_json({"relayed_bytes": service.relayed_bytes if service is not None else 0})

    run_network(run)


def _announce(node: DHTNode, as_json: bool, key_file: Path | None) -> None:
    maddrs = node.visible_maddrs
    if as_json:
        # the pid: a harness that started us in a namespace (swarm-sim, the NAT lab's tests) can stop us
        echo_json({"peer_id": str(node.peer_id), "maddrs": maddrs, "pid": os.getpid()})
        return
    direct = [(m, parse_address(m)) for m in maddrs]
    public = [m for m, a in direct if isinstance(a, TcpAddress) and not a.host.startswith("127.") and a.host != "::1"]
    join = " ".join(public or maddrs)
    join = f'"{join}"' if " " in join else join
    lines = [f"DHT node {node.peer_id} listening on:", *(f"  {m}" for m in maddrs), "Join it with:"]
    lines += [f"  swarm-node --initial-peers {join}", f"  swarm-dht get KEY --initial-peers {join}"]
    if key_file is None:
        lines.append("(--identity ephemeral: a new PeerID on every start, and this join line with it)")
    else:
        lines.append(f"(its key: {key_file}; a restart keeps this PeerID)")
    lines.append("Serving; Ctrl+C or SIGTERM stops.")
    click.echo("\n".join(lines))
    click.get_text_stream("stdout").flush()


# --- ping / peers ---------------------------------------------------------------------------


@main.command()
@click.argument("maddr", callback=maddr_argument)
@click.option("--count", type=click.IntRange(1, 100), default=3, show_default=True, help="Pings after connecting.")
@client_options(bootstrap=False)
def ping(maddr: str, count: int, opts: ClientOptions) -> None:
    """Ping the node at MADDR: its PeerID and round-trip time.

    The first ping dials and authenticates (connect_ms); then --count pings on the open
    connection give rtt_ms (their median).
    """

    async def op(node: DHTNode) -> tuple[str, float, list[float]]:
        peer, first = await node.ping(maddr)
        rtts = [(await node.ping(maddr))[1] for _ in range(count)]
        return str(peer), first, rtts

    peer, first, rtts = with_client(opts, op, bootstrap=False)
    rtts_ms = [round(r * 1000, 3) for r in rtts]
    median = sorted(rtts_ms)[len(rtts_ms) // 2]
    if opts.as_json:
        echo_json({"maddr": maddr, "peer_id": peer, "connect_ms": round(first * 1000, 3), "rtt_ms": median})
    else:
        click.echo(f"{peer} at {maddr}: rtt {median:.3f} ms (connect and first ping {first * 1000:.3f} ms)")


@main.command()
@client_options()
def peers(opts: ClientOptions) -> None:
    """Bootstrap from --initial-peers and print the routing table it fills: peer, maddr,
    bucket, last seen."""

    async def op(node: DHTNode) -> tuple[str, list[dict[str, Any]]]:
        now = asyncio.get_running_loop().time()
        rows = [
            {
                "peer_id": str(c.peer_id),
                "maddrs": list(c.maddrs),
                "bucket": node.table.bucket_index(c.node_id),
                "last_seen_s": round(now - c.last_seen, 3),
            }
            for c in node.table.contacts()
        ]
        return str(node.peer_id), sorted(rows, key=lambda r: (r["bucket"], r["peer_id"]))

    own, rows = with_client(opts, op)
    if opts.as_json:
        echo_json({"peer_id": own, "client_mode": True, "peers": rows})
        return
    table = new_table(
        "peer", "maddr", "bucket", "last seen", title=f"routing table of {own} (client): {len(rows)} peers"
    )
    for row in rows:
        maddr = row["maddrs"][0] if row["maddrs"] else ""
        table.add_row(cell(row["peer_id"]), cell(maddr), str(row["bucket"]), f"{duration(row['last_seen_s'])} ago")
    print_table(table)
