"""The one form of a run setting's value, and the one comparison of two maps of settings.

    canonical({"outer_lr": 1.0, "seed": 0.0})        # {"outer_lr": 1, "seed": 0}
    digest(settings)                                  # 32 bytes, equal for equal settings
    differences(ours, theirs)                         # ["outer_lr 0.5 (this node: 0.7)", ...]

The node's RunSettings (swarm/node/settings.py) is built on these, and so is the state manifest's
check (checkpoint.py): the model layer cannot import the node's, and one implementation of "the
same setting" serves both, so that a node the join check lets in also shares the digest that
matchmaking and receipts compare, and can use the states the run makes.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

MAX_FIELDS = 32
MAX_TEXT = 128  # characters of one string value


def canonical_value(value: Any) -> Any:
    """The one form of a settings value that every comparison and the digest use. A float that
    holds a whole number is that int: `outer_lr=1` (swarm.join) and `1.0` (the CLI), or a 0
    that msgpack hands back as 0.0, are one setting, and nodes that pass the join check must
    also share a digest or they never group. Bools stay bools (True is not the setting 1)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def canonical(settings: Mapping[str, Any]) -> dict[str, Any]:
    return {name: canonical_value(value) for name, value in settings.items()}


def same_value(a: Any, b: Any) -> bool:
    """Equal settings values, as the digest sees them (canonical_value; bools apart from ints)."""
    a, b = canonical_value(a), canonical_value(b)
    return type(a) is type(b) and a == b


def digest(settings: Mapping[str, Any]) -> bytes:
    """SHA-256 of the canonical JSON of the canonical settings (sorted keys, no spaces)."""
    body = json.dumps(canonical(settings), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(b"swarm-settings/1\x00" + body.encode()).digest()


def decode_settings(value: Any) -> dict[str, Any] | None:
    """A peer's settings map in canonical form, or None when it is malformed (bounded: peers' input)."""
    if not isinstance(value, dict) or len(value) > MAX_FIELDS:
        return None
    for key, item in value.items():
        if not isinstance(key, str) or len(key) > MAX_TEXT:
            return None
        if isinstance(item, str):
            if len(item) > MAX_TEXT:
                return None
        elif isinstance(item, float):
            if not math.isfinite(item):
                return None
        elif item is not None and not isinstance(item, int | bool):
            return None
    return canonical(value)


def differences(
    ours: Mapping[str, Any],
    theirs: Mapping[str, Any],
    order: Iterable[str] = (),
    label: Callable[[str], str] = str,
) -> list[str]:
    """`label(name) their value (this node: ours)` for each setting that differs: the names in
    `order` first, then the others sorted."""
    known = list(order)
    names = [n for n in known if n in ours or n in theirs] + sorted((set(ours) | set(theirs)) - set(known))
    return [f"{label(n)} {theirs.get(n)!r} (this node: {ours.get(n)!r})"
            for n in names if not same_value(ours.get(n), theirs.get(n))]  # fmt: skip
