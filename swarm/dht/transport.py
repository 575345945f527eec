"""How a DHT node reaches peers: over swarm.p2p (P2PTransport), or over an in-memory network
(MemoryNetwork) that runs the very same node code with no sockets, for simulations of 10,000
nodes in one process. Both raise swarm.p2p's errors, so the node cannot tell them apart.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgpack

from swarm.p2p.errors import ConnectionLost, RemoteError, RPCError
from swarm.p2p.handlers import CallContext
from swarm.p2p.host import P2PHost
from swarm.p2p.maddr import parse_address
from swarm.p2p.peer_id import PeerID

Handler = Callable[[CallContext, Any], Awaitable[Any]]


class Transport(Protocol):
    peer_id: PeerID

    def add_handler(self, method: str, fn: Handler) -> None: ...

    def remove_handler(self, method: str) -> None: ...

    def visible_maddrs(self) -> list[str]: ...

    async def call(self, peer: PeerID, maddrs: tuple[str, ...], method: str, args: Any, timeout: float) -> Any:
        """Call `method` on `peer`, dialing one of `maddrs` when not connected."""
        ...

    async def call_maddr(self, maddr: str, method: str, args: Any, timeout: float) -> tuple[PeerID, Any]:
        """Call whoever answers at `maddr` (bootstrap); returns its PeerID and the reply."""
        ...


class P2PTransport:
    def __init__(self, host: P2PHost) -> None:
        self.host = host
        self.peer_id = host.peer_id

    def add_handler(self, method: str, fn: Handler) -> None:
        self.host.add_handler(method, fn)

    def remove_handler(self, method: str) -> None:
        self.host.remove_handler(method)

    def visible_maddrs(self) -> list[str]:
        return self.host.visible_maddrs

    async def call(self, peer: PeerID, maddrs: tuple[str, ...], method: str, args: Any, timeout: float) -> Any:
        if peer in self.host.connected_peers() or not maddrs:
            return await self.host.call(peer, method, args, timeout=timeout)
        error: Exception | None = None
        for maddr in maddrs:  # the first address that works; an unparsable one is skipped
            try:
                target = parse_address(maddr).with_peer_id(peer)
            except ValueError as e:
                error = e
                continue
            try:
                return await self.host.call(target, method, args, timeout=timeout)
            except ConnectionLost as e:
                error = e
        raise ConnectionLost(f"no address of {peer} answered: {error}")

    async def call_maddr(self, maddr: str, method: str, args: Any, timeout: float) -> tuple[PeerID, Any]:
        conn = await self.host.connect(maddr, timeout=timeout)
        return conn.peer_id, await conn.call(method, args, timeout)


class MemoryNetwork:
    """Nodes that call each other's handlers directly. Arguments and replies go through msgpack
    as on the wire; a call to a stopped node fails like a refused TCP connection."""

    def __init__(self) -> None:
        self.nodes: dict[PeerID, MemoryTransport] = {}
        self.by_maddr: dict[str, PeerID] = {}
        self.calls = 0

    def transport(self, peer_id: PeerID) -> MemoryTransport:
        transport = MemoryTransport(self, peer_id, f"/memory/{len(self.by_maddr)}/p2p/{peer_id}")
        self.nodes[peer_id] = transport
        self.by_maddr[transport.maddr] = peer_id
        return transport

    def stop(self, peer_id: PeerID) -> None:
        self.nodes.pop(peer_id, None)


class MemoryTransport:
    def __init__(self, network: MemoryNetwork, peer_id: PeerID, maddr: str) -> None:
        self.network = network
        self.peer_id = peer_id
        self.maddr = maddr
        self.handlers: dict[str, Handler] = {}

    def add_handler(self, method: str, fn: Handler) -> None:
        self.handlers[method] = fn

    def remove_handler(self, method: str) -> None:
        self.handlers.pop(method, None)

    def visible_maddrs(self) -> list[str]:
        return [self.maddr]

    async def call(self, peer: PeerID, maddrs: tuple[str, ...], method: str, args: Any, timeout: float) -> Any:
        self.network.calls += 1
        remote = self.network.nodes.get(peer)
        if remote is None or self.network.nodes.get(self.peer_id) is not self:
            raise ConnectionLost(f"cannot connect to {peer}: connection refused")
        handler = remote.handlers.get(method)
        if handler is None:
            raise RemoteError("unknown_method", method, method=method, peer=str(peer))
        context = CallContext(peer_id=self.peer_id, method=method, remote_address=("memory", 0))
        request = msgpack.unpackb(msgpack.packb(args, use_bin_type=True), raw=False)
        try:  # handlers answer without waiting on the network, so no timeout is needed here
            reply = await handler(context, request)
        except RPCError as e:
            raise RemoteError(e.code, e.message, method=method, peer=str(peer)) from None
        return msgpack.unpackb(msgpack.packb(reply, use_bin_type=True), raw=False)

    async def call_maddr(self, maddr: str, method: str, args: Any, timeout: float) -> tuple[PeerID, Any]:
        peer = self.network.by_maddr.get(maddr)
        if peer is None:
            raise ConnectionLost(f"cannot connect to {maddr}: no such node")
        return peer, await self.call(peer, (maddr,), method, args, timeout)
