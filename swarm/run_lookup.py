"""What a joining node learns of its run before it builds anything: the run's settings.

    settings = await read_run_settings(run_id, initial_peers, p2p_config, dht_config)
    adopted = adoptable_settings(theirs=settings, given={"lr"}, ours=training_settings(config))

swarm-node calls this when it has --initial-peers: a short-lived client-mode DHT node (with the
node's identity; it stores nothing) reads the run's progress records, and every setting the
user did not give (model, H, batch, schedule, ...) takes the run's value, so that a volunteer
joins with `--run-id` and `--initial-peers` alone. A setting given on the command line or in the
config file is never overridden: when it contradicts the run, the node refuses to start, naming
both values (SwarmNode, run_settings.disagreement). Whose settings are the run's is
run_settings.run_settings's rule (the initial peers' first, else most records').
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from swarm.dht.config import DHTConfig
from swarm.dht.errors import DHTError
from swarm.dht.node import DHTNode
from swarm.dht.run_keys import nodes_key
from swarm.model.run_settings import FIELDS, run_settings, same_value
from swarm.p2p import P2PConfig
from swarm.p2p.errors import P2PError
from swarm.p2p.identity import Identity
from swarm.p2p.maddr import parse_maddr
from swarm.p2p.peer_id import PeerID
from swarm.progress import decode_progress

logger = logging.getLogger(__name__)

LOOKUP_TIMEOUT = 15.0  # seconds: the bootstrap and one lookup


async def read_run_settings(
    run_id: str, initial_peers: Iterable[str], p2p_config: P2PConfig, dht_config: DHTConfig,
    vouched: frozenset[PeerID], identity: Identity | None = None, id_proof_path: Path | None = None,
    timeout: float = LOOKUP_TIMEOUT,
) -> dict[str, Any] | None:  # fmt: skip
    """The run's settings as its progress records say (None: no record carries any, or the DHT
    did not answer in time: the node then runs with its own and checks again once it joined).
    `identity` and `id_proof_path`: the node's own, so that its costly DHT id is solved (and
    saved) once, not again for the lookup."""
    node = DHTNode(identity, list(initial_peers), config=dht_config, p2p_config=p2p_config, client_mode=True,
                   id_proof_path=id_proof_path)  # fmt: skip
    try:
        found = await asyncio.wait_for(_read(node, nodes_key(run_id)), timeout)
    except (P2PError, DHTError, TimeoutError, asyncio.TimeoutError, OSError) as e:
        logger.info("could not read the run's settings before starting: %s", e)
        return None
    finally:
        await node.close()
    peers = []
    for subkey, entry in found.items():
        progress = decode_progress(subkey, getattr(entry, "value", None))
        if progress is not None:
            peers.append((progress.peer_id, progress.settings))
    return run_settings(peers, vouched)


async def _read(node: DHTNode, key: str) -> dict[Any, Any]:
    await node.start()
    found = await node.get(key, latest=True)
    return found.value if found is not None and isinstance(found.value, dict) else {}


def adoptable_settings(theirs: Mapping[str, Any] | None, given: set[str], ours: Mapping[str, Any]) -> dict[str, Any]:
    """The settings to take from the run (pure): each known setting the user did not give whose
    value differs from ours."""
    if theirs is None:
        return {}
    return {n: theirs[n] for n in FIELDS if n in theirs and n not in given and not same_value(theirs[n], ours.get(n))}


def initial_peer_ids(maddrs: tuple[str, ...]) -> frozenset[PeerID]:
    """The PeerIDs named in --initial-peers (their advertised states are preferred: trust.py)."""
    ids = set()
    for text in maddrs:
        with contextlib.suppress(ValueError):
            peer_id = parse_maddr(text).peer_id
            if peer_id is not None:
                ids.add(peer_id)
    return frozenset(ids)
