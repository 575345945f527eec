"""The DHT's RPC handlers (the serving half of DHTNode; protocol.py is the spec they follow).

Each handler parses its arguments with protocol.py's bounded parsers, notes the sender's
standing (PeerTrust) and adds it to the routing table only when it serves and its id proof
checks out, then answers. Stores are charged to the sender (quotas.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from swarm.dht import protocol as proto
from swarm.dht.config import DHTConfig
from swarm.dht.errors import RecordError
from swarm.dht.freshest import FreshestRecords
from swarm.dht.ids import Key, key_id
from swarm.dht.records import Record
from swarm.dht.routing import RoutingTable
from swarm.dht.storage import RecordStorage
from swarm.p2p.errors import BadRequest
from swarm.p2p.handlers import CallContext
from swarm.p2p.peer_id import PeerID

logger = logging.getLogger("swarm.dht.node")


class DHTServing:
    """Mixin of DHTNode: dht.ping, dht.find and dht.store as seen by the node that answers."""

    config: DHTConfig
    storage: RecordStorage
    cache: RecordStorage
    _sender: dict[str, Any]

    @property
    def table(self) -> RoutingTable:
        raise NotImplementedError

    def _heard_from_sender(self, peer: PeerID, args: Any, fallback_maddr: str | None = None) -> None:
        raise NotImplementedError

    def _local_records(self, key: Key, now: float) -> FreshestRecords:
        raise NotImplementedError

    async def _rpc_ping(self, ctx: CallContext, args: Any) -> dict[str, Any]:
        proto.parse_addrs(args, self.config)
        self._heard_from_sender(ctx.peer_id, args)
        return self._sender

    async def _rpc_find(self, ctx: CallContext, args: Any) -> dict[str, Any]:
        proto.parse_addrs(args, self.config)
        target, key = proto.parse_find(args, self.config)
        if key is not None and key_id(key) != target:
            raise BadRequest("find: id is not the id of key")
        self._heard_from_sender(ctx.peer_id, args)
        reply: dict[str, Any] = {}
        if key is not None:
            now = time.time()
            records = self._local_records(key, now).records(now)
            if records:
                reply["records"] = proto.encode_found(records)
        if "records" not in reply or args.get("peers", True) is not False:
            reply["peers"] = proto.encode_contacts(self.table.closest(target, self.config.k, exclude=ctx.peer_id))
        return reply

    async def _rpc_store(self, ctx: CallContext, args: Any) -> dict[str, Any]:
        proto.parse_addrs(args, self.config)
        items, cache = proto.parse_store(args, self.config)
        self._heard_from_sender(ctx.peer_id, args)
        now = time.time()
        results = []
        storage = self.cache if cache else self.storage
        for item in items:
            try:
                record = Record.from_wire(item)
                record.validate(self.config, now)
                storage.put(record, now, source=ctx.peer_id)
            except RecordError as e:
                if e.code != "outdated":
                    logger.info("refused a record from %s: [%s] %s", ctx.peer_id, e.code, e.message)
                results.append(e.code)
            else:
                results.append(proto.OK)
        return {"results": results}
