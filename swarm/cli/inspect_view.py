"""What `swarm-dht inspect --run-id` prints about a run's nodes: the run's settings once, then one
short row per node (100 columns hold it, with 8 nodes or 80), and which records belong to peers
that are gone. Pure functions over the records read from the DHT; the command does the I/O.

A record is a peer's own word (untrusted): every field is shown only when it has the expected
type, anything else prints as "?", and nothing here raises on a malformed record.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# A node refreshes its progress record every few seconds (NodeConfig.publish_interval, 3 s by
# default): one not refreshed for this long is of a node that stopped, even where nobody can
# dial it to ask (a client behind NAT, a relayed node).
STALE_S = 30.0
SUFFIX = 6  # characters of a PeerID's end that name it in the table (more where two share them)
COLUMNS = ("peer", "done", "inner", "train", "eval", "tok/s", "group", "reach", "state", "seen")
WIDTHS = (7, 6, 9, 7, 7, 8, 5, 8, 8, 5)
RIGHT = {"done", "inner", "train", "eval", "tok/s", "group", "seen"}


@dataclass(frozen=True, slots=True)
class NodeRow:
    """One node as the compact table shows it; None where its record does not say."""

    peer: str  # the whole PeerID (or the subkey's text for a record without an owner)
    done: int | None  # outer steps done: the step it works on, counted from 0
    inner: int | None  # inner steps done in that step
    h: int | None  # inner steps it does in that step
    train_loss: float | None
    eval_loss: float | None
    tokens_per_s: float | None
    group: int | None  # members of its last averaging group
    reach: str  # direct, punched, relayed, or client (accepts no connections)
    state: str | None  # the manifest sha256 of the state it advertises
    seen_s: float | None  # seconds since the record's figures


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _num(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _fields(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def ping_target(value: Any) -> str | None:
    """The address to ask whether a record's peer still answers, or None where nobody can dial
    it (a client-mode node, a relayed one, no plain address)."""
    v = _fields(value)
    if v.get("client") is True or v.get("reach") == "relayed":
        return None
    maddrs = v.get("maddrs")
    if not isinstance(maddrs, list):
        return None
    plain = [m for m in maddrs if isinstance(m, str) and m.startswith("/") and "/p2p-circuit" not in m]
    return plain[0] if plain else None


def gone_reason(value: Any, answered: bool | None, now: float) -> str | None:
    """Why a node's record is of a peer that is gone (None: it is not): it did not answer at its
    address, or (where it was not asked) its figures stopped being refreshed, or its last record
    says it left the run."""
    if _fields(value).get("left") is True:
        return "it left the run"
    if answered is False:
        return "does not answer at its address"
    if answered is None:
        when = _num(_fields(value).get("time"))
        if when is not None and now - when > STALE_S:
            return f"its record was last refreshed {now - when:.0f}s ago"
    return None


def node_rows(nodes: Sequence[Mapping[str, Any]], states: Sequence[Mapping[str, Any]], now: float) -> list[NodeRow]:
    """A row per node entry ({"peer_id", "subkey", "value"}), with the state its peer
    advertises; sorted by outer steps done (most first), then PeerID."""
    state_of = {e["peer_id"]: _fields(e["value"]).get("manifest") for e in states if e.get("peer_id")}
    rows = []
    for e in nodes:
        v = _fields(e["value"])
        peer = e.get("peer_id") or json.dumps(e.get("subkey"), default=str)
        when = _num(v.get("time"))
        reach = "client" if v.get("client") is True else v.get("reach")
        manifest = state_of.get(e.get("peer_id"))
        rows.append(NodeRow(
            peer=peer, done=_int(v.get("step")), inner=_int(v.get("inner")), h=_int(v.get("H")),
            train_loss=_num(v.get("train_loss")), eval_loss=_num(v.get("eval_loss")),
            tokens_per_s=_num(v.get("tokens_per_s")), group=_int(v.get("group_size")),
            reach=reach if isinstance(reach, str) else "?", state=manifest if isinstance(manifest, str) else None,
            seen_s=None if when is None else max(0.0, now - when),
        ))  # fmt: skip
    return sorted(rows, key=lambda r: (-(r.done if r.done is not None else -1), r.peer))


def suffixes(peers: Sequence[str], length: int = SUFFIX) -> dict[str, str]:
    """Each PeerID's shortest end of at least `length` characters that no other one shares."""
    out = {}
    for peer in peers:
        n = length
        while n < len(peer) and any(o != peer and o.endswith(peer[-n:]) for o in peers):
            n += 1
        out[peer] = peer[-n:]
    return out


def run_settings(nodes: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any] | None, list[str]]:
    """The settings most node records carry, and the PeerIDs of those whose records carry others."""
    seen: Counter[str] = Counter()
    first: dict[str, Mapping[str, Any]] = {}  # as the first record of each carries it: in its order
    by_peer: dict[str, str] = {}
    for e in nodes:
        settings = _fields(e["value"]).get("settings")
        if isinstance(settings, Mapping):
            text = json.dumps(settings, sort_keys=True, default=str)
            seen[text] += 1
            first.setdefault(text, settings)
            by_peer[str(e.get("peer_id") or e.get("subkey"))] = text
    if not seen:
        return None, []
    common = seen.most_common(1)[0][0]
    return dict(first[common]), sorted(p for p, t in by_peer.items() if t != common)


def settings_lines(settings: Mapping[str, Any] | None, others: Sequence[str], width: int) -> list[str]:
    """`settings: model=tiny inner_steps=50 ...` wrapped to `width`, and who trains with others."""
    if settings is None:
        return ["settings: not published"]
    items = " ".join(f"{k}={_setting_text(v)}" for k, v in settings.items())
    lines = textwrap.wrap(f"settings: {items}", width=width, subsequent_indent="  ", break_long_words=True)
    if others:
        names = suffixes(others)
        lines += textwrap.wrap(
            f"{len(others)} {'node publishes' if len(others) == 1 else 'nodes publish'} other settings "
            "(--json shows them): " + " ".join("…" + names[p] for p in others), width=width,
            subsequent_indent="  ")  # fmt: skip
    return lines


def _setting_text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:12]  # a digest: its start names it
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _cells(row: NodeRow, suffix: str) -> tuple[str, ...]:
    def loss(x: float | None) -> str:
        return "?" if x is None else f"{x:.4f}" if x < 10 else f"{x:.2f}"

    inner = f"{'?' if row.inner is None else row.inner}/{'?' if row.h is None else row.h}"
    speed = "?" if row.tokens_per_s is None else _short_number(row.tokens_per_s)
    seen = "?" if row.seen_s is None else _age(row.seen_s)
    return ("…" + suffix, "?" if row.done is None else str(row.done), inner, loss(row.train_loss),
            loss(row.eval_loss), speed, "?" if row.group is None else str(row.group), row.reach[:8],
            (row.state or "-")[:8], seen)  # fmt: skip


def _short_number(x: float) -> str:
    """12,345 -> '12.3k', 4,567,890 -> '4.57M': at most 6 characters."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.0f}"


def _age(seconds: float) -> str:
    s = round(seconds)
    return f"{s}s" if s < 100 else f"{s // 60}m" if s < 6000 else f"{s // 3600}h"


def table_lines(rows: Sequence[NodeRow]) -> list[str]:
    """The compact table: a header and a row per node, each line at most sum(WIDTHS) + 2 * 9
    characters (88) whatever the records hold (longer only where two PeerIDs share 6 end characters)."""
    names = suffixes([r.peer for r in rows])
    widths = (max([WIDTHS[0], *(1 + len(s) for s in names.values())]), *WIDTHS[1:])

    def line(cells: Sequence[str]) -> str:
        out = []
        for name, text, width in zip(COLUMNS, cells, widths, strict=True):
            text = text if len(text) <= width else text[: width - 1] + "…"
            out.append(text.rjust(width) if name in RIGHT else text.ljust(width))
        return "  ".join(out).rstrip()

    return [line(COLUMNS)] + [line(_cells(r, names[r.peer])) for r in rows]


def gone_lines(gone: Mapping[str, str], width: int, *, reasons: bool) -> list[str]:
    """`left out: 2 peers gone (…abc123, …def456)`, with why for each when `reasons`."""
    names = suffixes(list(gone))
    each = ", ".join(f"…{names[p]}: {why}" if reasons else f"…{names[p]}" for p, why in gone.items())
    text = f"left out: {len(gone)} peer{'s' if len(gone) != 1 else ''} gone ({each})"
    return textwrap.wrap(text, width=width, subsequent_indent="  ")
