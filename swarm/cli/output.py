"""How swarm commands print what they found: DHT values as JSON (bytes as {"$bytes": base64})
and as rich tables, and durations in words."""

from __future__ import annotations

import base64
import json
import math
import os
import sys
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:  # rich is imported when a table is printed: --json answers start faster
    from rich.table import Table
    from rich.text import Text

PIPED_WIDTH = 240
BYTES_TAG = "$bytes"  # JSON form of a bytes value: {"$bytes": "<base64>"}


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
