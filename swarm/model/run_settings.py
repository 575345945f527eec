"""The run's training settings: what every node of a run must agree on, and how a node checks that it does.

    settings = training_settings(config)        # {"inner_steps": 50, "lr_schedule": "cosine", ...}
    digest = settings_digest(settings)           # 32 bytes, the same on every node of equal settings
    problem = disagreement(settings, peers, vouched)   # None, or the line that refuses to start

Three places carry them, so that a node of other settings can neither train into the run nor
pull the run into its own:
- progress records (`<run>/nodes`, progress.py) carry the whole map: a node that joins compares
  its own with the run's before it trains, and refuses to start with one line that names both
  values of every field that differs (`disagreement`);
- matchmaking records carry the settings' digest (averaging/ready.py): nodes of other settings
  that start at the same moment (so that neither saw the other's record) never form a group
  together, and neither takes the other's state for the swarm's;
- the state manifest (`RunInfo.settings`): a state made under other settings is refused, like one
  of another model.

Whose settings are "the run's": those of the peers this node joined through (its
--initial-peers), when they publish a record; else those most of the run's records carry. A
minority of records with other settings (an attacker's, or a misconfigured volunteer's) does not
stop a node that agrees with the run; it is logged.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

MAX_FIELDS = 32
MAX_TEXT = 128  # characters of one string value

# the fields whose values must be equal on every node of a run (NodeConfig names)
FIELDS = (
    "model", "seed", "data", "tokenizer", "inner_steps", "batch_size", "seq_len", "lr", "warmup_steps",
    "lr_schedule", "total_steps", "decay_fraction", "min_lr_ratio", "outer_lr", "outer_momentum", "fragments",
    "compression",
)  # fmt: skip
FLAGS = {name: "--" + name.replace("_", "-") for name in FIELDS}


def training_settings(config: Any) -> dict[str, Any]:
    """The run settings of a NodeConfig (or anything with those attributes)."""
    return {name: getattr(config, name) for name in FIELDS}


CUSTOM_MODEL = "custom"  # NodeConfig.model of a node that trains the caller's own model (swarm.join)
# what every node of a custom-model run must agree on: the rest of FIELDS belong to the caller's
# loop (data, batches, inner optimizer and its schedule), which the swarm does not see
CUSTOM_FIELDS = (
    "model", "inner_steps", "batch_size", "seq_len", "outer_lr", "outer_momentum", "fragments", "compression",
)  # fmt: skip


def custom_settings(config: Any, *, architecture: str, initial_state: str) -> dict[str, Any]:
    """The run settings of a node that trains a caller's model: CUSTOM_FIELDS, the model's
    architecture (parameter names, shapes, dtypes) and its initial weights, both as digests:
    nodes that would average tensors of other shapes, or start from other weights, never train
    together."""
    return {**{n: getattr(config, n) for n in CUSTOM_FIELDS}, "architecture": architecture,
            "initial_state": initial_state}  # fmt: skip


def join_flags(config: Any, defaults: Any) -> str:
    """The flags a joining node needs to train with config's settings: `--model` and every
    setting that differs from `defaults` (a NodeConfig()), each followed by a space."""
    settings, usual = training_settings(config), training_settings(defaults)
    names = ["model"] + [n for n in FIELDS if n != "model" and not same_value(settings[n], usual[n])]
    return "".join(f"{FLAGS[n]} {settings[n]} " for n in names if settings[n] is not None)


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


def settings_digest(settings: Mapping[str, Any]) -> bytes:
    """SHA-256 of the canonical JSON of the canonical settings (sorted keys, no spaces)."""
    body = json.dumps(canonical(settings), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(b"swarm-settings/1\x00" + body.encode()).digest()


def decode_settings(value: Any) -> dict[str, Any] | None:
    """A peer's settings map, or None when it is malformed (bounded: peers' input)."""
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
    return dict(value)


def differences(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[str]:
    """`field: the run's value vs ours` for each field that differs, in FIELDS order."""
    names = [n for n in FIELDS if n in ours or n in theirs] + sorted((set(ours) | set(theirs)) - set(FIELDS))
    return [f"{FLAGS.get(n, n)} {theirs.get(n)!r} (this node: {ours.get(n)!r})"
            for n in names if not same_value(ours.get(n), theirs.get(n))]  # fmt: skip


def same_value(a: Any, b: Any) -> bool:
    """Equal settings values, as the digest sees them (canonical_value; bools apart from ints)."""
    a, b = canonical_value(a), canonical_value(b)
    return type(a) is type(b) and a == b


def run_settings(
    peers: Iterable[tuple[Any, dict[str, Any] | None]], vouched: frozenset[Any] | set[Any]
) -> dict[str, Any] | None:
    """The run's settings as this node sees them: those of the peers in `vouched` (our
    --initial-peers) when any of them publishes some; else those most records carry (a tie, or
    no settings at all: None)."""
    known = [(peer, s) for peer, s in peers if s is not None]
    pool = [s for peer, s in known if peer in vouched] or [s for _, s in known]
    if not pool:
        return None
    digests = [settings_digest(s) for s in pool]
    (best, n), *rest = Counter(digests).most_common()
    if rest and rest[0][1] == n:
        return None
    return pool[digests.index(best)]


CLI_REMEDY = ("Leave these flags out (a joining node adopts the run's settings it is not given), pass the run's "
              "values, or pick another --run-id")  # fmt: skip
API_REMEDY = ("Build the same model from the same seed on every process (torch.manual_seed before building it), "
              "pass the run's values, or pick another run_id")  # fmt: skip


def disagreement(
    ours: Mapping[str, Any],
    peers: Iterable[tuple[Any, dict[str, Any] | None]],
    vouched: frozenset[Any] | set[Any],
    remedy: str = CLI_REMEDY,
) -> str | None:
    """Why this node must not train in this run (None: it may): the line to print. Pure."""
    theirs = run_settings(peers, vouched)
    if theirs is None:
        return None
    diff = differences(ours, theirs)
    if not diff:
        return None
    return "this run trains with other settings: " + "; ".join(diff) + ". " + remedy
