"""Expiration caps per kind of key: a run's `<run>/nodes` record lives for minutes, not a week.

Kinds are the run keys of run_keys.py, matched on the key's shape (a run id has no '/'):

    <run>/nodes -> "nodes"     <run>/state -> "state"     <run>/ready/<N> -> "ready"     runs -> "runs"
    <run>/receipts/<N> -> "receipts"     <run>/chunks -> "chunks"

Any other key is capped by DHTConfig.max_ttl alone. A signed record cannot be shortened by the
node that stores it (the signature covers the expiration), so one that asks for too long is
refused (ExpirationOutOfRange), never clamped.
"""

from __future__ import annotations

from swarm.dht.config import DHTConfig
from swarm.dht.ids import Key

RUNS_KEY = "runs"  # the DHT's list of runs (run_keys.py; here to avoid an import cycle)


def key_kind(key: Key) -> str | None:
    if not isinstance(key, str):
        return None
    if key == RUNS_KEY:
        return "runs"
    run, sep, rest = key.partition("/")
    if not run or not sep:
        return None
    if rest in ("nodes", "state", "chunks"):
        return rest
    for kind in ("ready", "receipts"):
        if rest.startswith(f"{kind}/") and rest[len(kind) + 1 :].isdigit():
            return kind
    return None


def max_ttl_for(key: Key, config: DHTConfig) -> float:
    kind = key_kind(key)
    if kind is not None:
        for name, ttl in config.ttl_caps:
            if name == kind:
                return ttl
    return config.max_ttl
