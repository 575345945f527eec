"""store_or_warn: a DHT store whose failure is seen, for records a node keeps publishing.

    if not await store_or_warn(dht, key, value, expiration, owner_subkey(dht.peer_id), kind="progress"):
        ...  # stored nowhere, a warning says so: retried at the caller's next refresh

`DHTNode.store` returns how many nodes accepted a record, and 0 means it is stored nowhere (every
replica refused it, or none answered); a lookup that fails raises instead. Both are worth a few
quick tries (a refusal after a restart, a replica that just left), and neither may pass unseen:
a node whose progress, state or run listing is in no DHT is invisible to its peers. So a store
is tried up to `tries` times, `backoff` seconds apart (doubling), within `within` seconds; the
last failure is a WARNING that names the kind of record; the earlier ones are INFO.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from swarm.dht.errors import DHTError, RecordError
from swarm.dht.ids import Key
from swarm.dht.node import DHTNode
from swarm.p2p.errors import P2PError

logger = logging.getLogger(__name__)

STORE_TRIES = 3
STORE_BACKOFF = 0.25  # seconds before the second try; doubled before each next one


async def store_or_warn(
    dht: DHTNode,
    key: Key,
    value: Any,
    expiration: float,
    subkey: Key | None = None,
    *,
    kind: str,
    tries: int = STORE_TRIES,
    backoff: float | None = None,
    within: float | None = None,
) -> int:
    """Store the record (DHTNode.store), trying again while no node accepts it. Returns how many
    nodes accepted it on the try that worked, 0 when every try failed (logged as a WARNING with
    `kind`, e.g. "progress"). `within`: seconds after which no new try starts (the caller's
    budget; None: only `tries` bounds it). A record this node refuses to create (RecordError: a
    bug of the caller) is not tried again: it is a WARNING and 0 at once. `backoff` None:
    STORE_BACKOFF (read at each call, so that tests can shorten it)."""
    pause = STORE_BACKOFF if backoff is None else backoff
    if tries < 1 or pause < 0:
        raise ValueError(f"need tries >= 1 and backoff >= 0, got {tries} and {pause}")
    deadline = None if within is None else time.monotonic() + within
    for attempt in range(1, tries + 1):
        try:
            accepted = await dht.store(key, value, expiration, subkey)
        except RecordError as e:
            logger.warning("could not store the %s record under %r: refused here [%s] %s", kind, key, e.code, e)
            return 0
        except (P2PError, DHTError, asyncio.TimeoutError) as e:  # asyncio's: not the builtin one on 3.10
            accepted, why = 0, f"{type(e).__name__}: {e}"
        else:
            why = "no DHT node accepted it"
        if accepted > 0:
            if attempt > 1:
                logger.info("stored the %s record under %r at try %d", kind, key, attempt)
            return accepted
        out_of_time = deadline is not None and time.monotonic() + pause > deadline
        if attempt == tries or out_of_time:
            logger.warning("could not store the %s record under %r: %s (%d tr%s)", kind, key, why, attempt,
                           "y" if attempt == 1 else "ies")  # fmt: skip
            return 0
        logger.info("could not store the %s record under %r: %s; trying again in %.2fs", kind, key, why, pause)
        await asyncio.sleep(pause)
        pause *= 2
    raise AssertionError("unreachable: the last try returns")
