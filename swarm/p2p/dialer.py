"""Dialer: a host's outbound side. It dials peers, authenticates them, and remembers where each
peer answered (the address book).

connect() returns the open connection to a peer if there is one, else dials: one dial per
address at a time, shared by every caller of that address, each caller bounded by its own
timeout (a caller that gives up leaves the dial to the others). A dial that reaches a different
PeerID than its /p2p/ part fails with PeerIDMismatch. probe() dials a fresh connection only to
prove that an address reaches the peer it names, and closes it.

The address book holds the address each peer was last dialed at (so a bare PeerID can be called
again) and who answered at an address dialed without /p2p/.
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Awaitable, Callable

from swarm.p2p import handshake as hs
from swarm.p2p.circuit import CircuitTransport, circuit_peername
from swarm.p2p.config import P2PConfig
from swarm.p2p.connection import Connection
from swarm.p2p.errors import ConnectionLost, RPCTimeout
from swarm.p2p.framing import FrameProtocol
from swarm.p2p.maddr import CircuitAddress, PeerAddress, TcpAddress, parse_address
from swarm.p2p.peer_id import PeerID
from swarm.p2p.relay_wire import Opening
from swarm.p2p.stream import Stream

PeerRef = PeerID | TcpAddress | CircuitAddress | str  # a PeerID we know an address for, or a multiaddr
OpenCircuit = Callable[[CircuitAddress], Awaitable[tuple[Stream, Opening]]]


class Dialer:
    """The dials of one host (see the module docstring).

    Owns the dials in flight (by address) and the address book. The host's connection pool stays
    the host's: the dialer asks it for a peer's open connection (`best`) and hands it every new
    connection it keeps (`adopt`); a connection still handshaking sits in the host's
    `handshaking` set, so that closing the host closes it. `close()` cancels the dials in flight
    and refuses new ones."""

    def __init__(
        self,
        config: P2PConfig,
        *,
        new_protocol: Callable[..., FrameProtocol],  # relayed=True: a circuit's (counted apart)
        new_connection: Callable[[FrameProtocol, str], Connection],
        handshaking: set[Connection],
        best: Callable[[PeerID], Connection | None],
        adopt: Callable[[Connection], None],
        open_circuit: OpenCircuit,
        listening: Callable[[], TcpAddress | None],
    ) -> None:
        self.config = config
        self._new_protocol = new_protocol
        self._new_connection = new_connection
        self._handshaking = handshaking
        self._best_connection = best
        self._adopt = adopt
        self._open_circuit = open_circuit  # a relay's HOP stream to a relayed address's peer
        self._listening = listening  # where we listen: config.reuse_port dials go out from there
        self._dialing: dict[str, asyncio.Future[Connection]] = {}
        self._addresses: dict[PeerID, PeerAddress] = {}  # last address each peer was dialed at
        self._peer_at: dict[str, PeerID] = {}  # who answered at a dialed address (for maddrs without /p2p/)
        self._punching: dict[PeerID, tuple[str, float]] = {}  # the role each punch agreed, until when
        self._closing = False

    def close(self) -> None:
        self._closing = True
        for dial in self._dialing.values():
            dial.cancel()

    def address_of(self, peer: PeerID) -> PeerAddress | None:
        return self._addresses.get(peer)

    async def connect(self, peer: PeerRef, *, timeout: float | None = None) -> Connection:
        """The connection to a peer: an open one if any, else a new dial (deduplicated)."""
        if self._closing:
            raise ConnectionLost("host is closed")
        addr: PeerAddress | None
        if isinstance(peer, PeerID):
            if (conn := self._best_connection(peer)) is not None:
                return conn
            addr = self._addresses.get(peer)
            if addr is None:
                raise ConnectionLost(f"no connection to {peer} and no known address for it")
        else:
            addr = parse_address(peer) if isinstance(peer, str) else peer
            known = addr.peer_id or self._peer_at.get(addr.to_maddr(with_peer_id=False))
            if known is not None and (conn := self._best_connection(known)) is not None:
                return conn
        key = addr.to_maddr()
        dial = self._dialing.get(key)
        if dial is None:
            dial = asyncio.ensure_future(self._dial(addr))
            self._dialing[key] = dial
            dial.add_done_callback(lambda done: self._dial_done(key, done))
        timeout = self.config.connect_timeout + self.config.handshake_timeout if timeout is None else timeout
        try:
            return await asyncio.wait_for(asyncio.shield(dial), timeout)
        except asyncio.TimeoutError:
            raise RPCTimeout(f"could not connect to {addr} within {timeout:.3g}s") from None

    def _dial_done(self, key: str, dial: asyncio.Future[Connection]) -> None:
        self._dialing.pop(key, None)
        if not dial.cancelled():
            dial.exception()  # retrieved: every caller may have given up (timeout, cancelled lookup)

    async def probe(self, peer: PeerAddress | str, *, timeout: float | None = None) -> PeerID:
        """Dial `peer` on a fresh connection, authenticate, and close it: proves the address
        reaches the peer it names (the dial-back of swarm.p2p.autonat). Never reuses or keeps
        a connection. Raises like connect()."""
        addr = parse_address(peer) if isinstance(peer, str) else peer
        timeout = self.config.connect_timeout + self.config.handshake_timeout if timeout is None else timeout
        try:
            conn = await asyncio.wait_for(self._open_authenticated(addr, probe=True), timeout)
        except asyncio.TimeoutError:
            raise RPCTimeout(f"could not reach {addr} within {timeout:.3g}s") from None
        conn.close()
        return conn.peer_id

    async def _open_transport(self, addr: PeerAddress) -> FrameProtocol:
        """A protocol on a new transport to `addr`: a TCP socket, or a circuit through a relay."""
        if isinstance(addr, CircuitAddress):
            stream, opening = await asyncio.wait_for(self._open_circuit(addr), self.config.connect_timeout)
            protocol = self._new_protocol(relayed=True)
            CircuitTransport(stream, protocol, peername=circuit_peername(addr.relay.peer_id),
                             time_limit_s=opening.limits.seconds, observed=opening.observed,
                             peer_observed=opening.peer_observed).start()  # fmt: skip
            return protocol
        loop = asyncio.get_running_loop()
        try:
            sock = await asyncio.wait_for(self._from_listening_port(addr), self.config.connect_timeout)
            connecting = (
                loop.create_connection(self._new_protocol, sock=sock)
                if sock is not None
                else loop.create_connection(self._new_protocol, addr.host, addr.port)
            )
            _, protocol = await asyncio.wait_for(connecting, self.config.connect_timeout)
        except asyncio.TimeoutError:
            raise RPCTimeout(f"TCP connect to {addr} timed out") from None
        except OSError as e:
            raise ConnectionLost(f"cannot connect to {addr}: {e.strerror or e}") from None
        return protocol

    # --- hole punching (punch.py) --------------------------------------------------------------

    def expect_punch(self, peer: PeerID, role: str, seconds: float) -> None:
        """For `seconds`, a connection from `peer` that we accept is a punch's and takes `role`."""
        now = asyncio.get_running_loop().time()
        self._punching = {p: v for p, v in self._punching.items() if v[1] > now}
        self._punching[peer] = (role, now + seconds)

    def punch_role(self, peer: PeerID) -> str | None:
        held = self._punching.get(peer)
        return held[0] if held is not None and held[1] > asyncio.get_running_loop().time() else None

    async def dial_punch(self, addr: TcpAddress, role: str, *, timeout: float) -> Connection:
        """A connection to `addr` from our listening port, authenticated with the agreed `role`.
        ConnectionLost when the port already has a connection to `addr` (the peer's own SYN got
        there first and was accepted: that connection is the punch's)."""
        loop = asyncio.get_running_loop()
        try:
            sock = await asyncio.wait_for(self._from_listening_port(addr), timeout)
        except asyncio.TimeoutError:
            raise RPCTimeout(f"punch to {addr}: no answer within {timeout:.3g}s") from None
        except OSError as e:
            raise ConnectionLost(f"punch to {addr}: {e.strerror or e}") from None
        if sock is None:
            raise ConnectionLost(f"punch to {addr}: no connection from the listening port (in use, or reuse_port off)")
        _, protocol = await loop.create_connection(self._new_protocol, sock=sock)
        conn = self._new_connection(protocol, role)
        self._handshaking.add(conn)
        try:
            await asyncio.wait_for(conn.handshake(addr.peer_id), timeout)
        except BaseException:
            conn.close()
            raise
        finally:
            self._handshaking.discard(conn)
        self._adopt(conn)
        return conn

    async def _from_listening_port(self, addr: TcpAddress) -> socket.socket | None:
        """A socket connected to `addr` from our listening port (config.reuse_port), or None:
        off, not listening on IPv4, not an IPv4 address, or that port already has a connection
        to `addr` (then an ephemeral port serves)."""
        local = self._listening() if self.config.reuse_port else None
        if local is None or addr.host_protocol != "ip4":
            return None
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.setblocking(False)
            sock.bind((local.host, local.port))
            await asyncio.get_running_loop().sock_connect(sock, (addr.host, addr.port))
        except OSError as e:
            sock.close()
            if e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                return None
            raise
        except BaseException:
            sock.close()
            raise
        return sock

    async def _open_authenticated(self, addr: PeerAddress, *, probe: bool = False) -> Connection:
        protocol = await self._open_transport(addr)
        conn = self._new_connection(protocol, hs.DIALER)
        self._handshaking.add(conn)
        try:
            await conn.handshake(addr.peer_id, probe=probe)
        except BaseException:  # a failed or cancelled handshake leaves no half-open socket
            conn.close()
            raise
        finally:
            self._handshaking.discard(conn)
        return conn

    async def _dial(self, addr: PeerAddress) -> Connection:
        conn = await self._open_authenticated(addr)
        if self._closing:
            conn.close()
            raise ConnectionLost("host is closing")
        self._addresses[conn.peer_id] = addr.with_peer_id(conn.peer_id)
        self._peer_at[addr.to_maddr(with_peer_id=False)] = conn.peer_id
        existing = self._best_connection(conn.peer_id)
        if existing is not None and existing.role == hs.DIALER:
            # we dialed this peer before under another address: keep one connection. (An inbound
            # one from the peer is kept: the peer may be closing its duplicate of ours right now.)
            conn.close()
            return existing
        self._adopt(conn)
        return conn
