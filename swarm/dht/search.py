"""DHTSearch: how a DHTNode asks the network, the asking half of DHTNode (serving.py is the
answering half): the iterative lookup of an id or a key over disjoint paths (lookup.py's
algorithm, with the node's requests plugged in), storing records on every path's k closest,
and Kademlia's caching of a found value on the path. Every request goes through `call`: a reply
refreshes the contact in the routing table, a failure removes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any, Protocol

from swarm.dht import protocol as proto
from swarm.dht.config import DHTConfig
from swarm.dht.errors import RecordError
from swarm.dht.freshest import FreshestRecords
from swarm.dht.ids import Key, id_to_bytes, key_id
from swarm.dht.lookup import LookupResult, iterative_lookup
from swarm.dht.peer_trust import PeerTrust
from swarm.dht.records import Record
from swarm.dht.routing import Contact, RoutingTable
from swarm.dht.storage import RecordStorage
from swarm.dht.transport import Transport
from swarm.p2p.errors import BadRequest, P2PError
from swarm.p2p.peer_id import PeerID

logger = logging.getLogger("swarm.dht.node")  # the node's: its log lines keep one name


class SearchingNode(Protocol):
    """What DHTSearch reads and calls of the DHTNode that owns it (node.py): typed here, so that
    the search does not import the node. The underscored three are the node's own upkeep, which
    every request it sends takes part in."""

    @property
    def config(self) -> DHTConfig: ...

    @property
    def client_mode(self) -> bool: ...  # a client stores nothing itself and is no replica

    @property
    def peer_id(self) -> PeerID: ...

    @property
    def node_id(self) -> int: ...

    @property
    def storage(self) -> RecordStorage: ...  # the records this node holds for the swarm

    @property
    def table(self) -> RoutingTable: ...

    @property
    def trust(self) -> PeerTrust: ...  # told of the peers a reply names with a bad id proof

    @property
    def transport(self) -> Transport: ...

    @property
    def _sender(self) -> dict[str, Any]: ...  # "a" and "n" of every request (protocol.py)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...  # a task the node owns and ends at close

    def _heard_from(self, contact: Contact) -> None: ...  # contact answered: refresh it in the routing table


class DHTSearch:
    """A DHTNode's lookups, stores and requests (the module docstring); the node owns one and
    asks through it."""

    def __init__(self, node: SearchingNode) -> None:
        self.node = node

    async def store_records(self, key: Key, records: list[Record]) -> int:
        """Store on the k closest of every disjoint path (LookupResult.replicas): m nodes that
        sit closest to the key and drop what they get hold every copy only if m >= paths * k."""
        node = self.node
        target = key_id(key)
        found = await asyncio.wait_for(self.lookup(target, None, stop_on_value=False), node.config.lookup_timeout)
        now = time.time()
        nodes, accepted = found.replicas(), 0
        full = len(found.closest) >= node.config.k  # else this node is among the k closest anyway
        if not node.client_mode and (not full or (node.node_id ^ target) < (found.closest[-1].node_id ^ target)):
            nodes = nodes[: len(nodes) - full]  # this node is a replica: the farthest one is not
            accepted += any(_put_local(node.storage, record, now) for record in records)
        wire = [r.to_wire() for r in records]
        args = {**node._sender, "records": wire}
        replies = await asyncio.gather(*(self.call(c, proto.STORE, args) for c in nodes), return_exceptions=True)
        reasons: dict[str, int] = {}
        for reply in replies:
            if isinstance(reply, BaseException):
                continue
            results = reply.get("results") if isinstance(reply, dict) else None
            if isinstance(results, list) and proto.OK in results:
                accepted += 1
            elif isinstance(results, list):
                for code in results:
                    reasons[str(code)] = reasons.get(str(code), 0) + 1
        if not accepted:
            logger.debug("store of %r accepted by no node (%d asked; refusals %s)", key, len(nodes), reasons)
        return accepted

    def cache_on_path(self, key: Key, result: LookupResult) -> None:
        """Kademlia's caching: the closest node that answered without the value gets a copy."""
        node = self.node
        for contact in result.closest:
            if contact.peer_id not in result.holders:
                records = [r.to_wire() for r in result.records(time.time())][: node.config.max_store_batch]
                if records:
                    args = {**node._sender, "records": records, "cache": True}
                    node._spawn(self.call_quietly(contact, proto.STORE, args))
                return

    async def lookup(
        self, target: int, key: Key | None, *, stop_on_value: bool, found: FreshestRecords | None = None
    ) -> LookupResult:
        node = self.node
        args: dict[str, Any] = {**node._sender, "id": id_to_bytes(target)}
        if key is not None:
            args["key"] = key
            if stop_on_value:
                args["peers"] = False  # a holder's records end this lookup: its peers would go unread

        found = FreshestRecords() if found is None else found

        async def ask(contact: Contact) -> tuple[list[Contact], list[Record], bool]:
            reply = await self.call(contact, proto.FIND, args)
            try:
                if not isinstance(reply, dict):
                    raise BadRequest("a find reply must be a map")
                peers, dropped = proto.decode_contacts(reply.get("peers", []), node.config)
                records, holds = (
                    proto.decode_found(key, reply["records"], node.config, time.time(), found)
                    if key is not None and "records" in reply
                    else ([], False)
                )
            except BadRequest as e:
                logger.info("bad find reply from %s: %s", contact.peer_id, e)
                node.table.remove(contact.peer_id)
                raise
            for peer, reason in dropped:
                node.trust.bad_proof(peer, reason, via=contact.peer_id)
            return peers, records, holds

        # k contacts per path: were the paths to share our k closest, ids ground to sit nearest
        # the key (each one priced, but 20 are within an attacker's reach) could be all of them,
        # and every path would start inside their group and hear only of each other: the next
        # k closest give the other paths honest nodes to start from
        initial = node.table.closest(target, node.config.k * node.config.disjoint_paths)
        return await iterative_lookup(
            target,
            initial,
            ask,
            own_id=node.peer_id,
            k=node.config.k,
            alpha=node.config.alpha,
            stop_on_value=stop_on_value,
            found=found,
            paths=node.config.disjoint_paths,
        )

    async def call(self, contact: Contact, method: str, args: Any) -> Any:
        """A request to a contact (its id proof checked when we learned it); success refreshes
        it in the routing table, failure removes it."""
        node = self.node
        try:
            reply = await node.transport.call(contact.peer_id, contact.maddrs, method, args, node.config.rpc_timeout)
        except P2PError:
            node.table.remove(contact.peer_id)
            raise
        node._heard_from(contact)
        return reply

    async def call_quietly(self, contact: Contact, method: str, args: Any) -> None:
        with contextlib.suppress(P2PError):
            await self.call(contact, method, args)


def _put_local(storage: RecordStorage, record: Record, now: float) -> bool:
    try:
        storage.put(record, now)
    except RecordError:
        return False
    return True
