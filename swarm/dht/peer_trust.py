"""PeerTrust: what a DHT node believes about ids, in one place.

It holds this node's own proven id (found once at start, off the event loop), the routing table
built around it, the standing of every peer heard from (a verified costly id, when last heard:
quotas.py ranks stored entries by it), and a log of bad id proofs that names each peer once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

from swarm.dht.config import DHTConfig
from swarm.dht.id_proof import load_or_solve, solve, verify
from swarm.dht.quotas import PeerStandings, Quotas
from swarm.dht.routing import Contact, RoutingTable
from swarm.p2p.peer_id import PeerID

logger = logging.getLogger(__name__)

MAX_LOGGED_PEERS = 4096  # peers whose bad proof was logged: each is named once, then counted
_SOLVED: dict[tuple[PeerID, int], bytes] = {}  # costly proofs found in this process (a node restarted)
_MAX_SOLVED = 1024
_CACHE_FROM_BITS = 12  # cheaper proofs are solved again (a simulation makes 10,000 of them)
_SOLVED_LOCK = threading.Lock()


class PeerTrust:
    def __init__(self, peer_id: PeerID, config: DHTConfig, id_proof_path: str | os.PathLike[str] | None) -> None:
        self.peer_id = peer_id
        self.config = config
        self.id_proof_path = Path(id_proof_path) if id_proof_path is not None else None
        self.quotas = Quotas.from_config(config)
        # a cache store is one lookup's records for one key, from one peer: up to a batch of them
        self.cache_quotas = dataclasses.replace(self.quotas, max_per_source=config.max_store_batch)
        self.standings = PeerStandings()
        self.bad_proofs = 0  # contacts and senders dropped for a bad id proof
        self._logged: OrderedDict[PeerID, None] = OrderedDict()
        self._stop = threading.Event()
        self._proven: tuple[int, bytes, RoutingTable] | None = None

    async def prove_own_id(self) -> None:
        """Find (or load) this node's id proof in a worker thread: ~2^id_bits hashes."""
        nonce = await asyncio.to_thread(self._find_nonce)
        node_id = verify(self.peer_id, nonce, self.config.id_bits)
        self._proven = (node_id, nonce, RoutingTable(node_id, self.config.k))

    def stop_solving(self) -> None:
        self._stop.set()

    @property
    def node_id(self) -> int:
        return self._started()[0]

    @property
    def nonce(self) -> bytes:
        return self._started()[1]

    @property
    def table(self) -> RoutingTable:
        return self._started()[2]

    def own_contact(self, maddrs: tuple[str, ...]) -> Contact:
        return Contact(self.peer_id, maddrs, self.node_id, self.nonce)

    def heard_from(self, peer: PeerID, *, proven: bool) -> None:
        """A peer talked to us (or answered us) over its authenticated connection."""
        self.standings.heard_from(peer, time.time(), proven=proven)

    def bad_proof(self, peer: PeerID, reason: str, via: PeerID | None = None) -> None:
        """Drop a contact or sender whose id proof fails; log each peer once."""
        self.bad_proofs += 1
        if peer in self._logged:
            return
        self._logged[peer] = None
        if len(self._logged) > MAX_LOGGED_PEERS:
            self._logged.popitem(last=False)
        source = f" (named by {via})" if via is not None and via != peer else ""
        logger.info("dropped %s%s: bad DHT id proof: %s", peer, source, reason)

    def _started(self) -> tuple[int, bytes, RoutingTable]:
        if self._proven is None:
            raise RuntimeError("the DHT node has no id before start()")
        return self._proven

    def _find_nonce(self) -> bytes:
        bits = self.config.id_bits
        with _SOLVED_LOCK:
            nonce = _SOLVED.get((self.peer_id, bits))
        if nonce is None:
            started = time.perf_counter()
            if self.id_proof_path is not None:
                nonce = load_or_solve(self.id_proof_path, self.peer_id, bits, self._stop)
            else:
                nonce = solve(self.peer_id, bits, self._stop)
            elapsed = time.perf_counter() - started
            if elapsed > 0.1:
                logger.info("found a DHT id proof of %d bits in %.1f s", bits, elapsed)
            if bits >= _CACHE_FROM_BITS:
                with _SOLVED_LOCK:
                    if len(_SOLVED) >= _MAX_SOLVED:
                        _SOLVED.pop(next(iter(_SOLVED)))
                    _SOLVED[(self.peer_id, bits)] = nonce
        return nonce
