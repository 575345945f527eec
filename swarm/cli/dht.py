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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import time
from pathlib import Path
from typing import Any, TypeVar

import click

from swarm.cli.common import (
    ClientOptions,
    CliError,
    OneLineErrors,
    OpenNetworkLimits,
    cell,
    client_options,
    duration,
    echo_json,
    identity_option,
    initial_peers_option,
    json_key,
    json_option,
    jsonable,
    load_identity,
    maddr_argument,
    maddr_list,
    new_table,
    open_network_options,
    positive_seconds,
    print_table,
    run_network,
    setup_logging,
    show,
    verbose_option,
    with_client,
)
from swarm.dht import run_keys
from swarm.dht.config import DHTConfig
from swarm.dht.errors import RecordError
from swarm.dht.id_proof import proof_path_for
from swarm.dht.node import DHTNode, user_value
from swarm.dht.records import OWNER_PREFIX, Record, ValueWithExpiration, owner_of, owner_subkey
from swarm.dht.store_retry import store_or_warn
from swarm.node.run_lookup import listed_runs
from swarm.p2p.identity import Identity
from swarm.p2p.maddr import parse_maddr

T = TypeVar("T")

SERVE_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/31337",)
DEFAULT_TTL = 3600.0
_DHT_DEFAULTS = DHTConfig()


@click.group(cls=OneLineErrors, name="swarm-dht", context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Run a DHT node of the swarm, or ask the DHT: get, store, ping, peers, inspect."""


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
@identity_option(help="Key file of this node, created if missing; keeps the PeerID across restarts.")
@initial_peers_option(help="Multiaddr of a node to join; none: this is the first node of a new DHT.")
@open_network_options
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
) -> None:
    """Run a DHT-only node (e.g. a bootstrap node) until SIGINT or SIGTERM.

    Prints its multiaddrs and the line to join it; with --json, the first line of output is
    {"peer_id": ..., "maddrs": [...]}.
    """
    setup_logging(verbose)
    node_identity = load_identity(identity)

    async def run() -> None:
        p2p_config = limits.p2p(host_maddrs=host_maddrs or SERVE_HOST_MADDRS, announce_maddrs=announce_maddrs)
        proof_path = proof_path_for(identity) if identity is not None else None  # the id proof, kept with the key
        node = DHTNode(node_identity, initial_peers, config=limits.dht(), p2p_config=p2p_config,
                       id_proof_path=proof_path)  # fmt: skip
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):  # no signal handlers on Windows' loop
                loop.add_signal_handler(sig, stop.set)
        stopping = asyncio.ensure_future(stop.wait())
        try:
            starting = asyncio.ensure_future(node.start())
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():  # stopped while bootstrapping
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
                return
            starting.result()
            _announce(node, as_json, persistent=identity is not None)
            await stopping
        finally:
            stopping.cancel()
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError):
                    loop.remove_signal_handler(sig)
            await node.close()

    run_network(run)


def _announce(node: DHTNode, as_json: bool, *, persistent: bool) -> None:
    maddrs = node.visible_maddrs
    if as_json:
        echo_json({"peer_id": str(node.peer_id), "maddrs": maddrs})
        return
    public = [m for m in maddrs if not parse_maddr(m).host.startswith("127.") and parse_maddr(m).host != "::1"]
    join = " ".join(public or maddrs)
    join = f'"{join}"' if " " in join else join
    lines = [f"DHT node {node.peer_id} listening on:", *(f"  {m}" for m in maddrs), "Join it with:"]
    lines += [f"  swarm-node --initial-peers {join}", f"  swarm-dht get KEY --initial-peers {join}"]
    if not persistent:
        lines.append("(a new PeerID on every start: pass --identity FILE to keep one)")
    lines.append("Serving; Ctrl+C or SIGTERM stops.")
    click.echo("\n".join(lines))
    click.get_text_stream("stdout").flush()


# --- store / get ----------------------------------------------------------------------------


def parse_value(text: str) -> Any:
    """VALUE as JSON when it parses ('5', '{"a": 1}', '"quoted"'), else the string itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


@main.command()
@click.argument("key")
@click.argument("value")
@click.option("--subkey", default=None, help="Store under this subkey of KEY (a key holds many subkeys).")
@click.option(
    "--owned", is_flag=True, help="Make the subkey [owner:<own PeerID>]SUBKEY: only this identity may overwrite it."
)
@click.option(
    "--ttl",
    type=float,
    default=DEFAULT_TTL,
    show_default=True,
    callback=positive_seconds,
    metavar="SECONDS",
    help="Seconds until the record expires.",
)
@client_options()
def store(key: str, value: str, subkey: str | None, owned: bool, ttl: float, opts: ClientOptions) -> None:
    """Store VALUE under KEY (VALUE is parsed as JSON when it parses, else stored as a string).

    Prints how many nodes accepted it; exits 1 when none did. Owned subkeys ([owner:<PeerID>])
    need the owner's key file: pass --identity.
    """
    if ttl > _DHT_DEFAULTS.max_ttl:
        raise click.BadParameter(f"at most {_DHT_DEFAULTS.max_ttl:g} seconds", param_hint="'--ttl'")
    identity = opts.identity or Identity.generate()
    opts = dataclasses.replace(opts, identity=identity)
    if owned:
        if subkey is not None and subkey.startswith(OWNER_PREFIX):
            raise click.BadParameter("--owned adds the owner marker itself; give the subkey without one")
        subkey = owner_subkey(identity.peer_id, subkey or "")
    item = parse_value(value)
    expiration = time.time() + ttl
    try:  # refuse here what every node would refuse, before any network
        Record.create(key, subkey, item, expiration, identity).validate(opts.dht_config(), time.time())
    except RecordError as e:
        hint = " (use the owner's --identity)" if e.code == "bad_signature" else ""
        raise CliError(f"record refused [{e.code}]: {e.message}{hint}") from None

    async def op(node: DHTNode) -> int:  # a few tries: a refusal or a lost reply is often brief
        return await store_or_warn(node, key, item, expiration, subkey, kind="command-line")

    accepted = with_client(opts, op)
    if opts.as_json:
        echo_json({"key": key, "subkey": subkey, "accepted": accepted, "expiration": expiration})
    else:
        where = f"{key!r}" + (f" subkey {subkey!r}" if subkey is not None else "")
        click.echo(f"stored {where} on {accepted} node{'s' * (accepted != 1)}, expires in {duration(ttl)}")
    if accepted == 0:
        raise CliError("no node accepted the record (each holds one that expires later, or none answered; -v says why)")


@main.command()
@click.argument("key")
@click.option("--latest", is_flag=True, help="Ask all the nodes closest to KEY and merge, not just the first holder.")
@client_options()
def get(key: str, latest: bool, opts: ClientOptions) -> None:
    """Print the value under KEY (a table of subkeys for a key that has them).

    --json: {"key", "value", "expiration", "subkeys"}; for a key with subkeys, value is
    {subkey: {"value", "expiration"}}. Exits 1 when the key is not found.
    """
    found = with_client(opts, lambda node: node.get(key, latest=latest))
    if found is None:
        raise CliError(f"key {key!r} not found")
    entries = subkey_entries(found)
    if opts.as_json:
        if entries is None:
            echo_json({"key": key, "value": jsonable(found.value), "expiration": found.expiration, "subkeys": False})
        else:
            value = {json_key(s): {"value": jsonable(v.value), "expiration": v.expiration} for s, v in entries}
            echo_json({"key": key, "value": value, "expiration": found.expiration, "subkeys": True})
        return
    now = time.time()
    table = new_table("subkey" if entries is not None else "key", "value", "expires in", title=None)
    for name, item in entries if entries is not None else [(key, found)]:
        table.add_row(cell(name), cell(item.value), duration(item.expiration - now))
    print_table(table)


def subkey_entries(found: ValueWithExpiration) -> list[tuple[Any, ValueWithExpiration]] | None:
    """(subkey, value) pairs of a key with subkeys, None for a plain value."""
    value = found.value
    if isinstance(value, dict) and value and all(isinstance(v, ValueWithExpiration) for v in value.values()):
        return list(value.items())
    return None


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


# --- inspect --------------------------------------------------------------------------------


def run_id_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return run_keys.check_run_id(value)
    except ValueError as e:
        raise click.BadParameter(str(e), ctx, param) from None


@main.command()
@click.option("--run-id", default=None, callback=run_id_option, help="The run to inspect (default: list the runs).")
@click.option(
    "--serve",
    "serve_port",
    type=click.IntRange(0, 65535),
    default=None,
    metavar="PORT",
    help="Serve the run's live dashboard on this port (0: any) until Ctrl+C, instead of one table.",
)
@click.option("--serve-host", default="127.0.0.1", show_default=True, help="Where --serve listens.")
@client_options()
def inspect(run_id: str | None, serve_port: int | None, serve_host: str, opts: ClientOptions) -> None:
    """What a training run publishes: its nodes (outer step, addresses) and its state holders;
    without --run-id, the runs this DHT carries. --serve PORT: the same, live, as a web page."""
    if serve_port is not None:
        if run_id is None:
            raise click.UsageError("--serve needs --run-id (swarm-dht inspect lists the runs)")
        from swarm.cli.watch import serve_dashboard

        return serve_dashboard(run_id, opts, serve_host, serve_port)
    if run_id is None:
        return _list_runs(opts)
    keys = {"nodes": run_keys.nodes_key(run_id), "state": run_keys.state_key(run_id)}

    async def op(node: DHTNode) -> list[ValueWithExpiration | None]:
        results = await asyncio.gather(*(node.lookup_value(k, latest=True) for k in keys.values()))
        if not any(r.closest for r in results):  # not "nothing published": nobody answered in time
            asked = sum(r.asked for r in results)
            raise CliError(f"no DHT node answered the lookups for run {run_id!r} ({asked} asked); try again")
        now = time.time()
        return [user_value(r.records(k, now)) for r, k in zip(results, keys.values(), strict=True)]

    found = dict(zip(keys, with_client(opts, op), strict=True))
    sections = {name: run_entries(value) for name, value in found.items()}
    if not any(sections.values()):
        raise CliError(f"run {run_id!r} publishes nothing: no records under {' or '.join(keys.values())}")
    if opts.as_json:
        out = {
            name: [{**e, "value": jsonable(e["value"]), "subkey": jsonable(e["subkey"])} for e in es]
            for name, es in sections.items()
        }
        echo_json({"run_id": run_id, "keys": keys, **out})
        return
    shown = {"nodes": ("step", "inner", "train_loss", "eval_loss", "tokens_per_s", "group_size", "client"),
             "state": ("step", "manifest")}  # fmt: skip
    for name, columns in shown.items():
        entries = sections[name]
        table = new_table("peer", "maddr", *columns, "expires in", "other", title=f"{keys[name]}: {len(entries)}")
        now = time.time()
        for e in sorted(entries, key=_by_step_desc):
            value = e["value"] if isinstance(e["value"], dict) else {}
            maddrs = value.get("maddrs")
            maddr = maddrs[0] if isinstance(maddrs, list) and maddrs else ""
            other = {k: v for k, v in value.items() if k not in ("maddrs", *columns)} if value else e["value"]
            table.add_row(
                cell(e["peer_id"] or show(e["subkey"])),
                cell(maddr),
                *(cell(value.get(c, "")) for c in columns),
                duration(e["expiration"] - now),
                cell(other if other else ""),
            )
        print_table(table)


MAX_RUNS_LISTED = 100  # rows of `swarm-dht inspect` without --run-id (the most listed runs)


def _list_runs(opts: ClientOptions) -> None:
    async def op(node: DHTNode) -> ValueWithExpiration | None:
        result = await node.lookup_value(run_keys.RUNS_KEY, latest=True)
        if not result.closest:
            raise CliError(f"no DHT node answered the lookup of the runs ({result.asked} asked); try again")
        return user_value(result.records(run_keys.RUNS_KEY, time.time()))

    entries = run_entries(with_client(opts, op))
    runs = listed_runs(((e["subkey"], e["value"]) for e in entries), limit=MAX_RUNS_LISTED)
    if opts.as_json:
        echo_json({"runs": [{"run_id": run, "nodes": r.nodes, "step": r.step, "model": r.model}
                            for run, r in runs.items()]})  # fmt: skip
        return
    if not runs:
        raise CliError("this DHT lists no runs: no training node has published under it (yet)")
    table = new_table("run", "nodes", "outer step", "model", title=f"runs: {len(runs)}")
    for run, r in runs.items():
        table.add_row(cell(run), str(r.nodes), str(r.step), cell(r.model or ""))
    print_table(table)
    click.echo(f"inspect one with: swarm-dht inspect --run-id {next(iter(runs))} --initial-peers ...")


def run_entries(found: ValueWithExpiration | None) -> list[dict[str, Any]]:
    """One entry per subkey: {"subkey", "peer_id" (its owner, or None), "value", "expiration"}."""
    if found is None:
        return []
    pairs = subkey_entries(found)
    if pairs is None:  # someone stored a plain value here: show it anyway
        return [{"subkey": None, "peer_id": None, "value": found.value, "expiration": found.expiration}]
    entries = []
    for subkey, item in pairs:
        try:
            owner = owner_of(subkey)
        except RecordError:
            owner = None
        peer_id = str(owner) if owner is not None else None
        entries.append({"subkey": subkey, "peer_id": peer_id, "value": item.value, "expiration": item.expiration})
    return entries


def _by_step_desc(entry: dict[str, Any]) -> tuple[float, str]:
    value = entry["value"]
    step = value.get("step") if isinstance(value, dict) else None
    ok = isinstance(step, int | float) and not isinstance(step, bool)
    return (-float(step) if ok else float("inf"), str(entry["peer_id"] or entry["subkey"]))
