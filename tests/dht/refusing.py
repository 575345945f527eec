"""A DHT of two nodes on the in-memory network in which stores can be refused: a client node
(it stores nothing itself) and the one server it knows, whose STORE handler refuses the first
`refuse` requests as a full storage would. Tests of store failures use it (store_retry.py and
its callers: progress records, state holders)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from swarm.dht import DHTConfig, DHTNode
from swarm.dht import protocol as proto
from swarm.dht.records import Record
from swarm.dht.transport import MemoryNetwork
from swarm.p2p.connection import CallContext
from swarm.p2p.identity import Identity

CONFIG = DHTConfig(id_bits=0)  # no proof of work among in-memory nodes


@dataclass
class RefusingDHT:
    client: DHTNode  # stores through the server only (client mode)
    server: DHTNode
    refuse: int  # STORE requests still to refuse (every one: a large number)
    stores: list[str] = field(default_factory=list)  # the key of each STORE request the server got

    def stored(self, key: str) -> int:
        return self.stores.count(key)


@contextlib.asynccontextmanager
async def refusing_dht(refuse: int = 1 << 30) -> AsyncIterator[RefusingDHT]:
    network = MemoryNetwork()
    server_identity, client_identity = Identity.generate(), Identity.generate()
    server = await DHTNode(server_identity, transport=network.transport(server_identity.peer_id), config=CONFIG).start()
    client = DHTNode(client_identity, server.visible_maddrs, transport=network.transport(client_identity.peer_id),
                     config=CONFIG, client_mode=True)  # fmt: skip
    dht = RefusingDHT(await client.start(), server, refuse)
    accept = network.nodes[server.peer_id].handlers[proto.STORE]

    async def store(ctx: CallContext, args: Any) -> Any:
        records = args.get("records", []) if isinstance(args, dict) else []
        dht.stores.extend(Record.from_wire(r).key for r in records[:1])
        if dht.refuse > 0:
            dht.refuse -= 1
            return {"results": ["full"] * len(records)}
        return await accept(ctx, args)

    network.nodes[server.peer_id].add_handler(proto.STORE, store)
    try:
        yield dht
    finally:
        await client.close()
        await server.close()
