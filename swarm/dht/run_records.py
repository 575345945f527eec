"""Reading a run's record key: its entries as peers wrote them, bounded, or none on a failure.

    for subkey, value in await record_entries(dht, state_key(run_id), "who holds state"):
        holder = decode_holder(subkey, value, bits)   # each reader decodes and validates its own

A key holds at most `max_subkeys_per_key` entries in any honest store; a reply with more (a lying
peer's) is cut there, so a reader never decodes more than that. A DHT failure is logged once per
call and reads as no entries: the callers retry on their own schedule.
"""

from __future__ import annotations

import logging
from typing import Any

from swarm.dht.errors import DHTError
from swarm.dht.node import DHTNode
from swarm.p2p.errors import P2PError

logger = logging.getLogger(__name__)

__all__ = ["record_entries"]


async def record_entries(dht: DHTNode, key: str, what: str) -> list[tuple[Any, Any]]:
    """The (subkey, value) entries under `key`, the newest of each; [] when there are none or the
    read failed (logged as "could not read {what}")."""
    try:
        found = await dht.get(key, latest=True)
    except (P2PError, DHTError, TimeoutError) as e:
        logger.info("could not read %s: %s", what, e)
        return []
    if found is None or not isinstance(found.value, dict):
        return []
    entries = list(found.value.items())[: dht.config.max_subkeys_per_key]
    return [(subkey, getattr(entry, "value", None)) for subkey, entry in entries]
