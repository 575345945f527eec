"""swarm-dht store and get: put one record into the DHT, or read what a key holds (a value, or
a table of its subkeys)."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import click

from swarm.cli.common import CliError
from swarm.cli.dht_client import ClientOptions, client_options, with_client
from swarm.cli.options import positive_seconds
from swarm.cli.output import cell, duration, echo_json, json_key, jsonable, new_table, print_table
from swarm.dht.config import DHTConfig
from swarm.dht.errors import RecordError
from swarm.dht.node import DHTNode
from swarm.dht.records import OWNER_PREFIX, Record, ValueWithExpiration, owner_subkey
from swarm.dht.store_retry import store_or_warn
from swarm.p2p.identity import Identity

DEFAULT_TTL = 3600.0
_DHT_DEFAULTS = DHTConfig()


def parse_value(text: str) -> Any:
    """VALUE as JSON when it parses ('5', '{"a": 1}', '"quoted"'), else the string itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


@click.command()
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


@click.command()
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
