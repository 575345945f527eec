"""swarm-dht inspect: what a training run publishes in the DHT (its nodes and its state holders)
as a table, live as a web page with --serve, or without --run-id the runs the DHT carries."""

from __future__ import annotations

import asyncio
import shutil
import time
from typing import TYPE_CHECKING, Any

import click

from swarm.cli import inspect_view
from swarm.cli.common import CliError
from swarm.cli.dht_client import ClientOptions, client_options, with_client
from swarm.cli.dht_records import subkey_entries
from swarm.cli.output import PIPED_WIDTH, cell, duration, echo_json, jsonable, new_table, print_table, show
from swarm.dht import run_keys
from swarm.dht.errors import DHTError, RecordError
from swarm.dht.node import DHTNode, user_value
from swarm.dht.records import ValueWithExpiration, owner_of
from swarm.node.run_lookup import listed_runs
from swarm.p2p.errors import P2PError

if TYPE_CHECKING:
    from swarm.data.progress import EpochProgress


def run_id_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return run_keys.check_run_id(value)
    except ValueError as e:
        raise click.BadParameter(str(e), ctx, param) from None


@click.command()
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
    """What a training run publishes: its settings, then a row per node (steps done, inner i/H,
    losses, tokens/s, group, reachability, state hash, last seen); -v every field, --json all of
    it. Peers that no longer answer are left out. Without --run-id, the runs this DHT carries.
    --serve PORT: the same, live, as a web page."""
    if serve_port is not None:
        if run_id is None:
            raise click.UsageError("--serve needs --run-id (swarm-dht inspect lists the runs)")
        from swarm.cli.watch import serve_dashboard

        return serve_dashboard(run_id, opts, serve_host, serve_port)
    if run_id is None:
        return _list_runs(opts)
    keys = {"nodes": run_keys.nodes_key(run_id), "state": run_keys.state_key(run_id),
            "chunks": run_keys.chunks_key(run_id)}  # fmt: skip

    async def op(node: DHTNode) -> tuple[list[ValueWithExpiration | None], dict[str, bool | None]]:
        results = await asyncio.gather(*(node.lookup_value(k, latest=True) for k in keys.values()))
        if not any(r.closest for r in results):  # not "nothing published": nobody answered in time
            asked = sum(r.asked for r in results)
            raise CliError(f"no DHT node answered the lookups for run {run_id!r} ({asked} asked); try again")
        now = time.time()
        values = [user_value(r.records(now)) for r in results]
        entries = [e for v in values[:2] for e in run_entries(v)]
        return values, await _answers(node, entries)

    values, answered = with_client(opts, op)
    found = dict(zip(keys, values, strict=True))
    sections = {name: run_entries(value) for name, value in found.items() if name != "chunks"}
    data = _data_progress(found["chunks"], opts)
    if not any(sections.values()):
        raise CliError(f"run {run_id!r} publishes nothing: no records under {' or '.join(keys.values())}")
    now = time.time()
    gone = _gone(sections, answered, now)
    live = {name: [e for e in es if e["peer_id"] not in gone] for name, es in sections.items()}
    settings, others = inspect_view.run_settings(live["nodes"])
    if opts.as_json:
        out = {
            name: [{**e, "value": jsonable(e["value"]), "subkey": jsonable(e["subkey"])} for e in es]
            for name, es in live.items()
        }
        echo_json({"run_id": run_id, "keys": keys, "settings": jsonable(settings), **out,
                   "data": data.wire() if data is not None else None,
                   "gone": [{"peer_id": p, "reason": r} for p, r in gone.items()]})  # fmt: skip
        return
    verbose = click.get_current_context().params.get("verbose", 0) > 0
    width = shutil.get_terminal_size((PIPED_WIDTH, 24)).columns
    click.echo("\n".join(inspect_view.settings_lines(settings, others, width)))
    if verbose:
        _print_wide(keys, live, now)
    else:
        _print_compact(keys, live, now)
    if gone:
        click.echo("\n".join(inspect_view.gone_lines(gone, width, reasons=verbose)))
    if data is not None:
        click.echo(f"data: epoch {data.epoch}, {data.chunks_done:,} of {data.chunks:,} chunks done "
                   f"({data.share:.1%}), {data.tokens:,} tokens this epoch; "
                   f"{data.claiming} of {data.nodes} nodes claiming")  # fmt: skip


PING_TIMEOUT = 3.0  # seconds a record's peer has to answer inspect's ping


async def _answers(node: DHTNode, entries: list[dict[str, Any]]) -> dict[str, bool | None]:
    """Whether each record's peer answers a ping at its address, as itself (None: not asked, as
    nobody can dial it). When no peer answers at all, this client is the one cut off (a firewall,
    no route): nobody is judged by pings then, only by the age of their records."""
    targets: dict[str, str] = {}
    for e in entries:
        target = inspect_view.ping_target(e["value"])
        if e["peer_id"] and target and e["peer_id"] not in targets:
            targets[e["peer_id"]] = target

    async def ask(peer: str, maddr: str) -> bool:
        try:
            who, _ = await asyncio.wait_for(node.ping(maddr), PING_TIMEOUT)
        except (OSError, TimeoutError, P2PError, DHTError, ValueError):
            return False
        return str(who) == peer

    replies = dict(zip(targets, await asyncio.gather(*(ask(p, m) for p, m in targets.items())), strict=True))
    if replies and not any(replies.values()):
        return {}
    return {peer: replies.get(peer) for peer in {e["peer_id"] for e in entries if e["peer_id"]}}


def _gone(sections: dict[str, list[dict[str, Any]]], answered: dict[str, bool | None], now: float) -> dict[str, str]:
    """{PeerID: why} of the peers whose records are left out: its node record says it is gone,
    or (a state holder with no node record) it did not answer."""
    gone: dict[str, str] = {}
    with_record = set()
    for e in sections["nodes"]:
        if e["peer_id"]:
            with_record.add(e["peer_id"])
            reason = inspect_view.gone_reason(e["value"], answered.get(e["peer_id"]), now)
            if reason:
                gone[e["peer_id"]] = reason
    for e in sections["state"]:
        if e["peer_id"] and e["peer_id"] not in with_record and answered.get(e["peer_id"]) is False:
            gone[e["peer_id"]] = "does not answer at its address"
    return gone


def _print_compact(keys: dict[str, str], live: dict[str, list[dict[str, Any]]], now: float) -> None:
    rows = inspect_view.node_rows(live["nodes"], live["state"], now)
    click.echo(f"{keys['nodes']}: {len(rows)} node{'s' if len(rows) != 1 else ''}")
    if rows:
        click.echo("\n".join(inspect_view.table_lines(rows)))
    listed = {r.peer for r in rows}
    for e in live["state"]:  # holders with no node record of their own
        if e["peer_id"] not in listed:
            value = e["value"] if isinstance(e["value"], dict) else {}
            peer = e["peer_id"] or show(e["subkey"])
            click.echo(f"state holder …{peer[-inspect_view.SUFFIX:]}: step {show(value.get('step', '?'))}, "
                       f"manifest {show(value.get('manifest', '?'))[:16]}")  # fmt: skip


def _print_wide(keys: dict[str, str], live: dict[str, list[dict[str, Any]]], now: float) -> None:
    """-v: every field of every record, the settings left out (printed once above)."""
    shown = {"nodes": ("step", "inner", "H", "train_loss", "eval_loss", "tokens_per_s", "group_size", "client",
                       "reach"), "state": ("step", "manifest")}  # fmt: skip
    for name, columns in shown.items():
        entries = live[name]
        table = new_table("peer", "maddr", *columns, "expires in", "other", title=f"{keys[name]}: {len(entries)}")
        for e in sorted(entries, key=_by_step_desc):
            value = e["value"] if isinstance(e["value"], dict) else {}
            maddrs = value.get("maddrs")
            maddr = maddrs[0] if isinstance(maddrs, list) and maddrs else ""
            left = ("maddrs", "settings", *columns)
            other = {k: v for k, v in value.items() if k not in left} if value else e["value"]
            table.add_row(
                cell(e["peer_id"] or show(e["subkey"])),
                cell(maddr),
                *(cell(value.get(c, "")) for c in columns),
                duration(e["expiration"] - now),
                cell(other if other else ""),
            )
        print_table(table)


def _data_progress(found: ValueWithExpiration | None, opts: ClientOptions) -> EpochProgress | None:
    """The swarm's way through a prepared dataset (data/progress.py), from `<run>/chunks`, its
    records held to what a node's claim reader holds them to."""
    from swarm.data.progress import read_progress  # numpy: only for a run's view

    if found is None or not isinstance(found.value, dict):
        return None
    entries = [(subkey, getattr(entry, "value", None)) for subkey, entry in found.value.items()]
    config = opts.dht_config()
    return read_progress(entries, id_bits=config.id_bits, max_records=config.max_subkeys_per_key, now=time.time())


MAX_RUNS_LISTED = 100  # rows of `swarm-dht inspect` without --run-id (the most listed runs)


def _list_runs(opts: ClientOptions) -> None:
    async def op(node: DHTNode) -> ValueWithExpiration | None:
        result = await node.lookup_value(run_keys.RUNS_KEY, latest=True)
        if not result.closest:
            raise CliError(f"no DHT node answered the lookup of the runs ({result.asked} asked); try again")
        return user_value(result.records(time.time()))

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
