"""DHTNode: one Kademlia node (routing table, storage, RPC handlers, lookups, maintenance).

    async with DHTNode(identity, initial_peers=["/ip4/1.2.3.4/tcp/31337/p2p/12D3Koo..."]) as node:
        await node.store("run1/ready", {"step": 7}, time.time() + 60, subkey=owner_subkey(node.peer_id))
        found = await node.get("run1/ready")   # ValueWithExpiration(value={subkey: ...}, expiration)

With no initial peers the node is the first of a new DHT. A node either owns its P2PHost (made
from p2p_config), shares one handed in with `host=` (a training node shares it with averaging),
or runs over any Transport (the in-memory one of the simulator). client_mode: the node asks but
never serves; peers do not add it to their routing tables (for nodes nobody can dial).

S/Kademlia: the node id carries a proof of work bound to the PeerID (id_proof.py),
solved at start in a worker thread or read from `id_proof_path`; clients solve one too, so their
records rank as costly identities (quotas.py, which also charges each record to its sender).
Lookups run over disjoint paths and stores go to every path's k closest (lookup.py).

The node answers in serving.py and asks in search.py (lookups, stores, every request it sends).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Iterable
from typing import Any

from swarm.dht import protocol as proto
from swarm.dht.config import DHTConfig
from swarm.dht.errors import BootstrapError
from swarm.dht.freshest import FreshestRecords
from swarm.dht.id_proof import BadIdProof
from swarm.dht.ids import Key, key_id, random_id_between
from swarm.dht.lookup import LookupResult
from swarm.dht.peer_trust import PeerTrust
from swarm.dht.records import Record, ValueWithExpiration, unpack_value
from swarm.dht.rejoin import RejoinSchedule
from swarm.dht.routing import Contact, RoutingTable
from swarm.dht.search import DHTSearch
from swarm.dht.serving import DHTServing
from swarm.dht.storage import RecordStorage
from swarm.dht.transport import P2PTransport, Transport
from swarm.p2p.config import P2PConfig
from swarm.p2p.errors import P2PError
from swarm.p2p.host import P2PHost
from swarm.p2p.identity import Identity
from swarm.p2p.peer_id import PeerID
from swarm.utils.supervised import Supervised

logger = logging.getLogger(__name__)


class DHTNode(DHTServing):
    """One Kademlia node. Owns its routing table, its record storage and cache, its RPC handlers
    (PING, FIND, STORE: none in client mode), its own records to republish, and its supervised
    maintenance (bucket refresh, republishing). Use it as an async context manager or with
    `start()` / `close()`; `store`, `get` and `find_node` are the whole API (module docstring)."""

    def __init__(
        self,
        identity: Identity | None = None,
        initial_peers: Iterable[str] = (),
        *,
        config: DHTConfig | None = None,
        p2p_config: P2PConfig | None = None,
        host: P2PHost | None = None,
        transport: Transport | None = None,
        client_mode: bool = False,
        id_proof_path: str | os.PathLike[str] | None = None,
    ) -> None:
        if sum(x is not None for x in (p2p_config, host, transport)) > 1:
            raise ValueError("pass at most one of p2p_config, host and transport")
        self.config = config or DHTConfig()
        self.initial_peers = [str(p) for p in initial_peers]
        self.client_mode = client_mode
        self._own_host: P2PHost | None = None
        if transport is None:
            if host is None:
                host = self._own_host = P2PHost(identity, p2p_config or P2PConfig())
            transport = P2PTransport(host)
            identity = host.identity
        self.transport = transport
        self.identity = identity
        self.peer_id: PeerID = transport.peer_id
        if identity is not None and identity.peer_id != self.peer_id:
            raise ValueError("identity does not match the transport's PeerID")
        self.trust = PeerTrust(self.peer_id, self.config, id_proof_path)
        trust, per_key = self.trust, self.config.max_subkeys_per_key
        self.storage = RecordStorage(self.config.max_records, per_key, trust.quotas, trust.standings)
        self.cache = RecordStorage(self.config.max_cache_records, per_key, trust.cache_quotas, trust.standings)
        self._own_records: dict[tuple[Key, Key | None], Record] = {}  # what we republish
        self._tasks: set[asyncio.Task[Any]] = set()
        self._maintenance: Supervised | None = None
        self._started = False
        self._closed = False
        self._addrs: tuple[str, ...] | None = None
        self._sender: dict[str, Any] = {}  # "a" and "n" of every request (protocol.py)
        self.search = DHTSearch(self)  # our lookups, stores and requests (search.py)
        self._initial_ids: dict[str, PeerID] = {}  # who answered at each initial peer's maddr
        self._rejoin = RejoinSchedule(min(self.config.rejoin_interval, self.config.refresh_interval),
                                      self.config.refresh_interval)  # fmt: skip

    @property
    def node_id(self) -> int:
        """This node's Kademlia id (id_proof.py), known once start() found its proof."""
        return self.trust.node_id

    @property
    def table(self) -> RoutingTable:
        return self.trust.table

    # --- lifecycle --------------------------------------------------------------------------

    @property
    def id_nonce(self) -> bytes:
        """The nonce that proves our costly id (id_proof.py); other records carry it too
        (averaging/ready.py), so that readers can price the identities behind them."""
        return self.trust.nonce

    async def start(self) -> DHTNode:
        if self._started:
            return self
        self._started = True
        try:
            await self.trust.prove_own_id()
        except BaseException:
            await self.close()
            raise
        if self._own_host is not None:
            await self._own_host.start()
        self._addrs = None if self.client_mode else tuple(self.transport.visible_maddrs())
        self._sender = {"a": self._addrs, "n": self.trust.nonce}
        if not self.client_mode:
            self.transport.add_handler(proto.PING, self._rpc_ping)
            self.transport.add_handler(proto.FIND, self._rpc_find)
            self.transport.add_handler(proto.STORE, self._rpc_store)
        try:
            await self.bootstrap(self.initial_peers)
        except BaseException:
            await self.close()
            raise
        self._maintenance = Supervised("DHT maintenance", self._maintain).start()
        return self

    async def bootstrap(self, maddrs: list[str]) -> None:
        """Ping the given peers, then look up our own id to fill the routing table."""
        if not maddrs:
            return
        replies = await asyncio.gather(*(self.ping(m) for m in maddrs), return_exceptions=True)
        for maddr, reply in zip(maddrs, replies, strict=True):
            if not isinstance(reply, BaseException):
                self._initial_ids[maddr] = reply[0]
        if all(isinstance(r, BaseException) for r in replies):
            reasons = "; ".join(f"{m}: {r}" for m, r in zip(maddrs, replies, strict=True))
            raise BootstrapError(f"none of the {len(maddrs)} initial peers answered ({reasons})")
        await asyncio.wait_for(self.find_node(self.node_id), self.config.bootstrap_timeout)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.trust.stop_solving()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._maintenance is not None and (error := await self._maintenance.close()) is not None:
            logger.warning("DHT maintenance had failed %d time(s), last: %r", self._maintenance.failures, error)
        if not self.client_mode and self._addrs is not None:
            for method in (proto.PING, proto.FIND, proto.STORE):
                self.transport.remove_handler(method)
        if self._own_host is not None:
            await self._own_host.close()

    async def __aenter__(self) -> DHTNode:
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    @property
    def visible_maddrs(self) -> list[str]:
        return self.transport.visible_maddrs()

    # --- the user's API ---------------------------------------------------------------------

    async def store(self, key: Key, value: Any, expiration_time: float, subkey: Key | None = None) -> int:
        """Store on the k nodes closest to the key (this one too when it is among them).
        Returns how many nodes accepted the record: 0 means it was stored nowhere (for example
        every node holds one that expires later). A record this node refuses to create (too
        large, expired, owned by someone else) raises the RecordError that says why."""
        record = Record.create(key, subkey, value, expiration_time, self.identity)
        record.validate(self.config, time.time())
        self._own_records[(key, subkey)] = record
        if len(self._own_records) > self.config.max_records:  # forget the record that expires first
            del self._own_records[min(self._own_records, key=lambda s: self._own_records[s].expiration)]
        return await self.search.store_records(key, [record])

    async def get(self, key: Key, latest: bool = False) -> ValueWithExpiration | None:
        """The value under key, or None when no live record is found. Ends at the first node
        that holds it unless `latest`, which asks all k closest nodes and merges their answers.
        For a key with subkeys the value is {subkey: ValueWithExpiration}."""
        result = await self.lookup_value(key, latest=latest)
        return user_value(result.records(time.time()))

    async def lookup_value(self, key: Key, latest: bool = False) -> LookupResult:
        """The lookup behind get(), with its statistics (rounds, holders) for benchmarks."""
        found = self._local_records(key, time.time())
        result = await asyncio.wait_for(
            self.search.lookup(key_id(key), key, stop_on_value=not latest, found=found), self.config.lookup_timeout
        )
        if result.holders:
            self.search.cache_on_path(key, result)
        return result

    def _local_records(self, key: Key, now: float) -> FreshestRecords:
        """What this node stores and caches for key, merged by the storage rules."""
        return FreshestRecords(self.storage.get(key, now) + self.cache.get(key, now))

    async def find_node(self, target: int) -> list[Contact]:
        """The k nodes closest to target that answered (this node left out)."""
        result = await self.search.lookup(target, None, stop_on_value=False)
        return result.closest

    async def ping(self, maddr: str) -> tuple[PeerID, float]:
        """Ping whoever answers at maddr and add it to the routing table; (PeerID, seconds)."""
        start = time.perf_counter()
        peer, reply = await self.transport.call_maddr(maddr, proto.PING, self._sender, self.config.rpc_timeout)
        rtt = time.perf_counter() - start
        self._heard_from_sender(peer, reply, fallback_maddr=maddr)
        return peer, rtt

    # --- routing table upkeep ---------------------------------------------------------------

    def _heard_from(self, contact: Contact, own_word: bool = False) -> None:
        """contact answered us (own_word: it named its id itself, in a request or a ping reply)."""
        self.trust.heard_from(contact.peer_id, proven=True)
        proof = {"node_id": contact.node_id, "nonce": contact.nonce, "own_word": own_word}
        stale = self.table.add(contact.peer_id, contact.maddrs, asyncio.get_running_loop().time(), **proof)
        if stale is not None and not self._closed:
            self._spawn(self._check_stale(stale))

    def _heard_from_sender(self, peer: PeerID, args: Any, fallback_maddr: str | None = None) -> None:
        """A request (or ping reply) from peer: note its standing; add it to the routing table
        when it serves and its id proof checks out (else drop it, logged once)."""
        try:
            contact = proto.parse_sender_id(args, peer, self.config)
        except BadIdProof as e:
            self.trust.heard_from(peer, proven=False)
            self.trust.bad_proof(peer, str(e))
            return
        if contact is None:  # client mode: still proven if its nonce checks out
            proven = isinstance(args, dict) and proto.proves_id(args.get("n"), peer, self.config)
            self.trust.heard_from(peer, proven=proven)
            return
        if not contact.maddrs and fallback_maddr is not None:
            contact.maddrs = (fallback_maddr,)
        self._heard_from(contact, own_word=True)

    async def _check_stale(self, stale: Contact) -> None:
        """Ping the least recently seen contact of a full bucket; replace it only if it fails."""
        try:
            await self.transport.call(stale.peer_id, stale.maddrs, proto.PING, self._sender, self.config.ping_timeout)
        except P2PError:
            self.table.ping_failed(stale.peer_id)
        else:
            self.table.ping_succeeded(stale.peer_id, asyncio.get_running_loop().time())

    async def _maintain(self) -> None:
        """Ping lost initial peers, refresh stale buckets and republish our own records, forever,
        with jitter."""
        config = self.config
        loop = asyncio.get_running_loop()
        every = min(config.refresh_interval, config.republish_interval) / 2
        next_refresh = loop.time() + self._jittered(every)
        next_republish = loop.time() + self._jittered(config.republish_interval)
        while True:
            await asyncio.sleep(self._jittered(min(every, self._rejoin.base)))
            try:
                await self._rejoin_lost()
                if loop.time() >= next_refresh:
                    next_refresh = loop.time() + self._jittered(every)
                    for bucket in self.table.stale_buckets(loop.time(), config.refresh_interval):
                        await self.find_node(random_id_between(bucket.lo, bucket.hi))
                        bucket.last_updated = loop.time()
                if loop.time() >= next_republish:
                    next_republish = loop.time() + self._jittered(config.republish_interval)
                    await self.republish()
            except (P2PError, TimeoutError, asyncio.TimeoutError) as e:
                logger.info("DHT maintenance round failed: %s", e)

    async def _rejoin_lost(self) -> None:
        """Ping the initial peers our table lost (rejoin.py); through one that answers, look up
        our own id as at start-up, so that the nodes on its side learn of us and we of them."""
        loop = asyncio.get_running_loop()

        def in_table(maddr: str) -> bool:
            peer = self._initial_ids.get(maddr)
            return peer is not None and peer in self.table

        back = False
        for maddr in self._rejoin.due(self.initial_peers, in_table, loop.time()):
            try:
                self._initial_ids[maddr] = (await self.ping(maddr))[0]
            except P2PError as e:
                logger.debug("initial peer %s still unreachable: %s", maddr, e)
                self._rejoin.tried(maddr, loop.time(), answered=False, kept=False)
                continue
            kept = in_table(maddr)
            self._rejoin.tried(maddr, loop.time(), answered=True, kept=kept)
            back = back or kept
        if back:
            logger.info("reached an initial peer our routing table had lost: looking up our neighbours again")
            await asyncio.wait_for(self.find_node(self.node_id), self.config.bootstrap_timeout)

    async def republish(self) -> None:
        """Re-store our live records on the nodes now closest to their keys."""
        now = time.time()
        by_key: dict[Key, list[Record]] = {}
        for slot, record in list(self._own_records.items()):
            if record.expiration <= now:
                del self._own_records[slot]
            else:
                by_key.setdefault(record.key, []).append(record)
        for key, records in by_key.items():
            for start in range(0, len(records), self.config.max_store_batch):
                await self.search.store_records(key, records[start : start + self.config.max_store_batch])

    def _jittered(self, interval: float) -> float:
        return interval * (1 + random.random() * self.config.maintenance_jitter)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def user_value(records: list[Record]) -> ValueWithExpiration | None:
    """What get() returns for a lookup's records: the value, or {subkey: value} for subkeys."""
    if not records:
        return None
    if len(records) == 1 and records[0].subkey is None:
        return ValueWithExpiration(unpack_value(records[0].value), records[0].expiration)
    values = {r.subkey: ValueWithExpiration(unpack_value(r.value), r.expiration) for r in records}
    return ValueWithExpiration(values, max(r.expiration for r in records))
