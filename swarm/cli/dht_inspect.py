"""swarm-dht inspect: what a training run publishes in the DHT (its nodes and its state holders)
as a table, live as a web page with --serve, or without --run-id the runs the DHT carries."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import click

from swarm.cli.common import CliError
from swarm.cli.dht_client import ClientOptions, client_options, with_client
from swarm.cli.dht_records import subkey_entries
from swarm.cli.output import cell, duration, echo_json, jsonable, new_table, print_table, show
from swarm.dht import run_keys
from swarm.dht.errors import RecordError
from swarm.dht.node import DHTNode, user_value
from swarm.dht.records import ValueWithExpiration, owner_of
from swarm.node.run_lookup import listed_runs


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
    """What a training run publishes: its nodes (outer step, addresses) and its state holders;
    without --run-id, the runs this DHT carries. --serve PORT: the same, live, as a web page."""
    if serve_port is not None:
        if run_id is None:
            raise click.UsageError("--serve needs --run-id (swarm-dht inspect lists the runs)")
        from swarm.cli.watch import serve_dashboard

        return serve_dashboard(run_id, opts, serve_host, serve_port)
    if run_id is None:
        return _list_runs(opts)
    keys = {"nodes": run_keys.nodes_key(run_id), "state": run_keys.state_key(run_id),
            "chunks": run_keys.chunks_key(run_id)}  # fmt: skip

    async def op(node: DHTNode) -> list[ValueWithExpiration | None]:
        results = await asyncio.gather(*(node.lookup_value(k, latest=True) for k in keys.values()))
        if not any(r.closest for r in results):  # not "nothing published": nobody answered in time
            asked = sum(r.asked for r in results)
            raise CliError(f"no DHT node answered the lookups for run {run_id!r} ({asked} asked); try again")
        now = time.time()
        return [user_value(r.records(k, now)) for r, k in zip(results, keys.values(), strict=True)]

    found = dict(zip(keys, with_client(opts, op), strict=True))
    sections = {name: run_entries(value) for name, value in found.items() if name != "chunks"}
    data = _data_progress(found["chunks"])
    if not any(sections.values()):
        raise CliError(f"run {run_id!r} publishes nothing: no records under {' or '.join(keys.values())}")
    if opts.as_json:
        out = {
            name: [{**e, "value": jsonable(e["value"]), "subkey": jsonable(e["subkey"])} for e in es]
            for name, es in sections.items()
        }
        echo_json({"run_id": run_id, "keys": keys, **out, "data": data})
        return
    shown = {"nodes": ("step", "inner", "train_loss", "eval_loss", "tokens_per_s", "group_size", "client", "reach"),
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
    if data is not None:
        click.echo(f"data: epoch {data['epoch']}, {data['chunks_done']:,} of {data['chunks']:,} chunks done "
                   f"({data['chunks_done'] / data['chunks']:.1%}), {data['tokens']:,} tokens this epoch; "
                   f"{data['claiming']} of {data['nodes']} nodes claiming")  # fmt: skip


def _data_progress(found: ValueWithExpiration | None) -> dict[str, int] | None:
    """The swarm's way through a prepared dataset (data/claims.py), from `<run>/chunks`."""
    from swarm.data.claims import swarm_progress  # numpy: only for a run's view

    if found is None or not isinstance(found.value, dict):
        return None
    entries = [(subkey, getattr(entry, "value", None)) for subkey, entry in found.value.items()]
    return swarm_progress(entries, time.time())


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
