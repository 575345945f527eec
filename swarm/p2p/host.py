"""P2PHost: a node's endpoint. Listens, dials (dialer.py), authenticates and encrypts (wire.py),
keeps one connection per peer (pool.py), and serves registered handlers (serving.py).

    async with P2PHost(identity, P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))) as host:
        host.add_handler("demo.echo", echo)
        reply = await host.call(other_maddr, "demo.echo", {"x": 1}, timeout=5)

Inbound connections are admitted by the per-source rules of admission.py: handshakes and
authenticated connections are capped per source IP, and at the global caps the host drops the
biggest source's oldest handshake, or closes an idle unknown peer, before it refuses anyone.
Peers we called are remembered (gate.py) and never evicted for a newcomer.

Failure modes: a dial that reaches a different PeerID than its /p2p/ part fails with
PeerIDMismatch; when both peers dial each other at once there may briefly be two connections,
and both sides then prefer the one dialed by the smaller PeerID (the other idles out; pool.py).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable, Iterable
from typing import Any

from swarm.p2p import handshake as hs
from swarm.p2p.autonat import DIALBACK, dialback_handler
from swarm.p2p.budget import HostStreams
from swarm.p2p.config import P2PConfig
from swarm.p2p.connection import Connection
from swarm.p2p.dialer import Dialer, PeerRef
from swarm.p2p.errors import ConnectionClosed, ConnectionLost, HandshakeError, MultiaddrError, RPCTimeout
from swarm.p2p.framing import FrameProtocol, Traffic
from swarm.p2p.gate import Gate
from swarm.p2p.handlers import CallContext, Handler, StreamHandler, UnaryHandler
from swarm.p2p.identity import Identity
from swarm.p2p.maddr import CircuitAddress, PeerAddress, TcpAddress, local_addresses, parse_maddr
from swarm.p2p.pacing import bytes_acked, max_pacing_rate, set_max_pacing_rate
from swarm.p2p.peer_id import PeerID
from swarm.p2p.pool import ConnectionPool
from swarm.p2p.relay_client import open_circuit
from swarm.p2p.relay_wire import Opening
from swarm.p2p.stream import Stream
from swarm.utils.log_once import RateLimitedLog

logger = logging.getLogger(__name__)

CLOSE_GRACE_SECONDS = 2.0  # how long close() lets connections flush before aborting them

__all__ = ["CallContext", "P2PHost", "PeerRef"]


class P2PHost:
    """Listens on config.host_maddrs, dials peers, serves handlers. See the module docstring.

    Owns the listening sockets, the handler table, the pool of authenticated connections
    (pool.py) and those still handshaking, the admission gate of inbound ones (gate.py) and the
    dialer with its address book (dialer.py). Use it with ``async with`` or start()/close()."""

    def __init__(self, identity: Identity | None = None, config: P2PConfig | None = None) -> None:
        self.identity = identity or Identity.generate()
        self.config = config or P2PConfig()
        self.peer_id = self.identity.peer_id
        self._handlers: dict[str, Handler] = {}
        self._servers: list[asyncio.AbstractServer] = []
        self._listen_addrs: list[TcpAddress] = []
        self._pool = ConnectionPool(self.peer_id)  # the authenticated connections, by peer
        self._handshaking: set[Connection] = set()
        self._gate = Gate(self.peer_id, self.config)  # which inbound connections we keep
        self._flood_log = RateLimitedLog(logger)  # a flood of throwaway sources must not flood the log
        self._host_streams = HostStreams(self.config.max_host_streams)  # inbound streams, all connections
        self._dialer = Dialer(self.config, new_protocol=self._new_protocol, new_connection=self._new_connection,
                              handshaking=self._handshaking, best=self._pool.best, adopt=self._pool.adopt,
                              open_circuit=self._open_circuit, listening=self.listening_address)  # fmt: skip
        self._relayed: tuple[CircuitAddress, ...] = ()  # where a relay reaches us (relay_client.RelayKeeper)
        # False behind a NAT: nobody can dial our own addresses, so we announce the relayed ones only
        self.announce_listening = True
        self._tasks: set[asyncio.Task[Any]] = set()
        self.traffic = Traffic()  # bytes on our sockets, all connections together (benchmarks read it)
        # the end-to-end bytes of our relayed connections: they reach the wire inside a relay
        # stream's frames, which `traffic` counts, so they must not be counted there a second time
        self.relayed_traffic = Traffic()
        self._started = False
        self._closing = False
        self.add_handler(DIALBACK, dialback_handler(self))  # every node helps others test reachability

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> P2PHost:
        if self._started:
            return self
        loop = asyncio.get_running_loop()
        try:
            for text in self.config.host_maddrs:
                addr = parse_maddr(text)
                if addr.host_protocol not in ("ip4", "ip6"):
                    raise MultiaddrError(f"listen address {text!r} must be /ip4 or /ip6")
                try:
                    server = await loop.create_server(self._accept, addr.host, addr.port, reuse_address=True,
                                                      reuse_port=self.config.reuse_port or None,
                                                      backlog=self.config.listen_backlog)  # fmt: skip
                except OSError as e:
                    if e.errno != errno.EADDRINUSE:
                        raise
                    raise OSError(e.errno, f"port {addr.port} of {addr.host} is in use (another node?): pick another "
                                           f"--host-maddrs, or /tcp/0 for any free port") from None  # fmt: skip
                self._servers.append(server)
                port = server.sockets[0].getsockname()[1]
                self._listen_addrs.append(TcpAddress(addr.host_protocol, addr.host, port, self.peer_id))
        except BaseException:
            await self.close()
            raise
        self._started = True
        return self

    async def close(self) -> None:
        """Stop listening, close every connection, cancel every task. Idempotent."""
        if self._closing:
            return
        self._closing = True
        for server in self._servers:
            server.close()
        self._dialer.close()
        conns = self._pool.all() + list(self._handshaking)
        for conn in conns:
            conn.close()
        for task in list(self._tasks):
            task.cancel()
        waits = [asyncio.ensure_future(c.wait_closed()) for c in conns] + list(self._tasks)
        if waits:
            # a graceful close flushes queued writes; a peer that stops reading gets aborted
            _, late = await asyncio.wait(waits, timeout=CLOSE_GRACE_SECONDS)
            if late:
                for conn in conns:
                    conn.protocol.abort(ConnectionLost("host closed"))
                await asyncio.wait(late, timeout=CLOSE_GRACE_SECONDS)
                for straggler in late:
                    straggler.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()
        self._pool.clear()

    async def __aenter__(self) -> P2PHost:
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    # --- handlers ---------------------------------------------------------------------------

    def add_handler(self, method: str, fn: UnaryHandler) -> None:
        """Serve unary calls: ``async fn(ctx, args) -> result`` (msgpack-able). Raise an RPCError
        subclass (e.g. BadRequest) to answer with that error code."""
        self._register(method, Handler(fn, is_stream=False))

    def add_stream_handler(self, method: str, fn: StreamHandler) -> None:
        """Serve stream calls: ``async fn(ctx, args, stream) -> None``; the stream is ended when
        fn returns."""
        self._register(method, Handler(fn, is_stream=True))

    def remove_handler(self, method: str) -> None:
        self._handlers.pop(method, None)

    def _register(self, method: str, handler: Handler) -> None:
        if not method or len(method) > 128:
            raise ValueError(f"bad method name {method!r}")
        if method in self._handlers:
            raise ValueError(f"a handler for {method!r} is already registered")
        self._handlers[method] = handler

    # --- addresses --------------------------------------------------------------------------

    @property
    def visible_maddrs(self) -> list[str]:
        """Multiaddrs peers can dial, with the real ports and our /p2p/ id, then our relayed ones."""
        relayed = [addr.to_maddr() for addr in self._relayed]
        if not self.announce_listening:
            return relayed
        if self.config.announce_maddrs:
            return [parse_maddr(m).with_peer_id(self.peer_id).to_maddr() for m in self.config.announce_maddrs] + relayed
        out: list[str] = []
        for addr in self._listen_addrs:
            hosts = [addr.host]
            if addr.host in ("0.0.0.0", "::"):
                hosts = local_addresses(ipv6=addr.host == "::")
            for host in hosts:
                text = TcpAddress(addr.host_protocol, host, addr.port, self.peer_id).to_maddr()
                if text not in out:
                    out.append(text)
        return out + relayed

    def set_relayed_addresses(self, addrs: Iterable[CircuitAddress]) -> None:
        """The relayed addresses we hold a reservation for (RelayKeeper sets them)."""
        self._relayed = tuple(addrs)

    def connected_peers(self) -> list[PeerID]:
        return self._pool.peers()

    def address_of(self, peer: PeerID) -> PeerAddress | None:
        return self._dialer.address_of(peer)

    # --- calls ------------------------------------------------------------------------------

    async def call(self, peer: PeerRef, method: str, args: Any = None, *, timeout: float | None = None) -> Any:
        """Unary call. Raises RemoteError, RPCTimeout, ConnectionLost, HandshakeError,
        MessageTooLarge. The timeout covers dialing too."""
        timeout = self.config.call_timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        start = loop.time()
        for attempt in range(2):
            conn = await self.connect(peer, timeout=timeout)
            remaining = timeout - (loop.time() - start)
            if remaining <= 0:
                raise RPCTimeout(f"{method}: dialing {peer} used up the {timeout:.3g}s timeout")
            self._gate.called(conn.peer_id)
            try:
                return await conn.call(method, args, remaining)
            except ConnectionClosed:  # closed under us (e.g. the peer's own dial-back probe): nothing was sent
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def open_stream(
        self, peer: PeerRef, method: str, args: Any = None, *, timeout: float | None = None
    ) -> Stream:
        """Start a stream call; `timeout` bounds dialing and then each read/write wait."""
        timeout = self.config.stream_timeout if timeout is None else timeout
        conn = await self.connect(peer, timeout=timeout)
        self._gate.called(conn.peer_id)
        try:
            return conn.open_stream(method, args, timeout)
        except ConnectionClosed:  # as in call(): nothing was sent, one more try
            conn = await self.connect(peer, timeout=timeout)
            return conn.open_stream(method, args, timeout)

    async def connect(self, peer: PeerRef, *, timeout: float | None = None) -> Connection:
        """The connection to a peer: an open one if any, else a new dial (deduplicated)."""
        return await self._dialer.connect(peer, timeout=timeout)

    def pace(self, peer: PeerID, bytes_per_s: float | None) -> int:
        """Cap what we send to `peer` at `bytes_per_s` on each open connection to it (None: lift
        the cap; pacing.py says why a round paces). How many connections took it."""
        return sum(set_max_pacing_rate(sock, bytes_per_s) for sock in self._pool.sockets(peer))

    def paces(self, peer: PeerID) -> list[int | None]:
        """The cap on each open connection to `peer`, bytes/s (None: uncapped)."""
        return [max_pacing_rate(sock) for sock in self._pool.sockets(peer)]

    def bytes_acked(self, peers: Iterable[PeerID]) -> int:
        """What these peers acknowledged of our sending, summed over our open connections to them
        (pacing.bytes_acked; 0 where the kernel does not say): rises as bytes leave the link."""
        return sum(bytes_acked(sock) or 0 for peer in peers for sock in self._pool.sockets(peer))

    async def probe(self, peer: PeerAddress | str, *, timeout: float | None = None) -> PeerID:
        """Dial `peer` on a fresh connection, authenticate, and close it: proves the address
        reaches the peer it names (the dial-back of swarm.p2p.autonat). Never reuses or keeps
        a connection. Raises like connect()."""
        return await self._dialer.probe(peer, timeout=timeout)

    # --- inbound ----------------------------------------------------------------------------

    def _new_protocol(self, *, relayed: bool = False) -> FrameProtocol:
        return FrameProtocol(
            max_head=hs.PRE_AUTH_MAX_HEAD,
            max_body=0,
            write_buffer_high=self.config.write_buffer_high_bytes,
            traffic=self.relayed_traffic if relayed else self.traffic,
        )

    def _new_connection(self, protocol: FrameProtocol, role: str) -> Connection:
        _set_nodelay(protocol.transport)
        return Connection(
            protocol,
            role=role,
            identity=self.identity,
            config=self.config,
            handlers=self._handlers,
            host_streams=self._host_streams,
            role_for=self._dialer.punch_role if role == hs.LISTENER else None,
        )

    def _accept(self) -> FrameProtocol:
        protocol = self._new_protocol()
        protocol.on_open = self._on_inbound_open
        return protocol

    def inbound_protocol(self, expected_peer: PeerID | None = None) -> FrameProtocol:
        """A protocol for an inbound connection on a transport of our own (a relay's circuit),
        admitted and served as one on our listening sockets. expected_peer: the only peer whose
        handshake it accepts (the one the relay says is dialing)."""
        protocol = self._new_protocol(relayed=True)
        protocol.on_open = lambda opened: self._on_inbound_open(opened, expected_peer)
        return protocol

    def listening_address(self) -> TcpAddress | None:
        """The first IPv4 listening address (what reuse_port dials bind to), once listening."""
        return next((a for a in self._listen_addrs if a.host_protocol == "ip4"), None)

    async def _open_circuit(self, addr: CircuitAddress) -> tuple[Stream, Opening]:
        return await open_circuit(self, addr, self.config.connect_timeout)

    def _on_inbound_open(self, protocol: FrameProtocol, expected_peer: PeerID | None = None) -> None:
        assert protocol.transport is not None
        peer = protocol.transport.get_extra_info("peername")
        if self._closing or not self._gate.may_handshake(str(peer[0]) if peer else "?"):
            self._flood_log.log(
                "handshakes",
                "%s: refusing connection from %s: %d handshakes pending (limits %d per source, %d in all)",
                self.peer_id,
                peer,
                len(self._gate.pending),
                self.config.max_pending_handshakes_per_ip,
                self.config.max_pending_handshakes,
            )
            protocol.transport.abort()
            return
        conn = self._new_connection(protocol, hs.LISTENER)
        self._handshaking.add(conn)
        self._gate.handshaking(conn)
        self._spawn(self._inbound_handshake(conn, peer, expected_peer))

    async def _inbound_handshake(self, conn: Connection, peer: Any, expected_peer: PeerID | None) -> None:
        try:
            await conn.handshake(expected_peer)
        except HandshakeError as e:
            self._flood_log.log("handshake failed", "%s: inbound handshake from %s failed: %s", self.peer_id, peer, e)
            return
        finally:
            self._handshaking.discard(conn)
            self._gate.handshake_over(conn)
        if conn.remote_hello_probe:  # a dial-back test: proven reachable, not kept for calls
            conn.close()
            return
        keep, victim = self._gate.admit(conn, self._pool.open())
        if victim is not None:
            self._pool.forget(victim)  # now: the next admission must not count it
            victim.protocol.abort(ConnectionLost("closed to make room for a new peer"))  # frees it at once
        if keep:
            self._pool.adopt(conn)

    # --- connection pool ----------------------------------------------------------------------

    def watch_connections(self, watcher: Callable[[Connection], None], *, stop: bool = False) -> None:
        """Call `watcher` with every connection the host keeps from now on (stop=True: no more)."""
        self._pool.watch(watcher, stop=stop)

    def connections_to(self, peer: PeerID) -> list[Connection]:
        """The open connections to `peer`, direct and relayed."""
        return self._pool.to(peer)

    def expect_punch(self, peer: PeerID, role: str, seconds: float) -> None:
        """A hole punch with `peer` starts (punch.py): what we accept from it takes `role`."""
        self._dialer.expect_punch(peer, role, seconds)

    async def punch_dial(self, addr: TcpAddress, role: str, *, timeout: float) -> Connection:
        """One end of a hole punch: dial from the listening port, authenticate with `role`."""
        return await self._dialer.dial_punch(addr, role, timeout=timeout)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def __repr__(self) -> str:
        return f"P2PHost({self.peer_id}, {len(self._pool)} peers)"


def _set_nodelay(transport: Any) -> None:
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
