"""Both ends of a circuit (relay_wire.py), as a P2PHost uses them.

- open_circuit(): the dialer's side of HOP. P2PHost dials a relayed multiaddr with it and then
  runs the ordinary handshake through the circuit (dialer.py).
- RelayKeeper: a NATed host's reservation. It times a call to each candidate relay, reserves on
  the nearest, renews before expiry, moves to the next nearest when its relay dies or refuses,
  announces the relayed multiaddr in host.visible_maddrs, and answers STOP from the relay it
  holds a reservation on by opening its end (ACCEPT) and accepting the connection through it as
  an inbound one, expecting the PeerID the relay named.

    async with RelayKeeper(host, ["/ip4/203.0.113.7/tcp/31337/p2p/12D3Koo..."]) as keeper:
        await keeper.wait_reserved(timeout=10)
        print(host.visible_maddrs)   # ..., "/ip4/203.0.113.7/tcp/31337/p2p/12D3Koo.../p2p-circuit/p2p/<us>"
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import msgpack

from swarm.p2p.circuit import CircuitTransport, circuit_peername
from swarm.p2p.config import P2PConfig
from swarm.p2p.errors import BadRequest, NoReservation, P2PError, ProtocolError, RelayRefused, RemoteError
from swarm.p2p.framing import FrameProtocol
from swarm.p2p.handlers import CallContext
from swarm.p2p.maddr import CircuitAddress, TcpAddress, parse_maddr
from swarm.p2p.peer_id import PeerID
from swarm.p2p.relay_wire import (
    ACCEPT,
    HOP,
    PING,
    RESERVE,
    STOP,
    VERSION,
    Opening,
    Reservation,
    decode_opening,
    decode_reservation,
    decode_stop,
)
from swarm.p2p.stream import Stream
from swarm.p2p.wire import ErrorCode
from swarm.utils.supervised import Supervised

logger = logging.getLogger(__name__)

MAX_OPENING_BYTES = 256  # the relay's first chunk on HOP: a small msgpack map
RENEW_AT = 0.5  # renew a reservation when this fraction of its ttl has passed
RETRY_S = 2.0  # wait between rounds when no candidate relay would take us


class _ClientHost(Protocol):  # what this module needs of a P2PHost (host.py imports this module)
    peer_id: PeerID
    config: P2PConfig

    async def call(self, peer: Any, method: str, args: Any = None, *, timeout: float | None = None) -> Any: ...
    async def open_stream(
        self, peer: Any, method: str, args: Any = None, *, timeout: float | None = None
    ) -> Stream: ...
    async def connect(self, peer: Any, *, timeout: float | None = None) -> Any: ...
    def add_handler(self, method: str, fn: Any) -> None: ...
    def remove_handler(self, method: str) -> None: ...
    def inbound_protocol(self, expected_peer: PeerID | None = None) -> FrameProtocol: ...
    def set_relayed_addresses(self, addrs: Sequence[CircuitAddress]) -> None: ...


async def open_circuit(host: _ClientHost, addr: CircuitAddress, timeout: float) -> tuple[Stream, Opening]:
    """Ask addr.relay for a circuit to addr.peer_id: the open HOP stream and the relay's opening
    (the circuit's limits, and the two ends' addresses as the relay sees them).
    NoReservation if the relay holds none for the peer; RelayRefused if it is at its caps."""
    request = {"v": VERSION, "peer": addr.peer_id.to_bytes()}
    stream = await host.open_stream(addr.relay, HOP, request, timeout=timeout)
    try:
        first = await stream.read(timeout=timeout)
    except RemoteError as e:
        await stream.cancel()
        if e.code == ErrorCode.NO_RESERVATION:
            raise NoReservation(f"relay {addr.relay.peer_id} cannot reach {addr.peer_id}: {e.message}") from None
        raise RelayRefused(f"relay {addr.relay.peer_id} refused a circuit to {addr.peer_id}: {e}") from None
    except BaseException:
        await stream.cancel()
        raise
    try:
        if first is None or len(first) > MAX_OPENING_BYTES:
            raise ProtocolError("the relay's first chunk must be a small map")
        opening = decode_opening(msgpack.unpackb(bytes(first), raw=False))
    except (ProtocolError, ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        await stream.cancel()
        raise RelayRefused(f"relay {addr.relay.peer_id} opened the circuit badly: {e}") from None
    return stream, opening


class RelayKeeper:
    """Keeps one reservation for `host` on the nearest live relay of `relays` (module docstring)."""

    def __init__(self, host: _ClientHost, relays: Sequence[str], *, call_timeout: float = 5.0) -> None:
        self.host = host
        self.candidates = [parse_maddr(text) for text in relays]
        for addr in self.candidates:
            if addr.peer_id is None:
                raise ValueError(f"relay address {addr} must end in /p2p/<relay's PeerID>")
        self.call_timeout = call_timeout
        self.current: CircuitAddress | None = None  # our relayed address, while reserved
        self.reservation: Reservation | None = None
        self.rtts: dict[str, float] = {}  # the last round trip measured to each candidate, seconds
        self._reserved = asyncio.Event()
        # set when a whole pass over the candidates ended without a reservation (each refused or
        # did not answer): waiting for one longer is waiting for nothing
        self._tried_all = asyncio.Event()
        self._task = Supervised("relay reservation", self._keep)
        self._started = False

    async def start(self) -> RelayKeeper:
        if not self._started:
            self.host.add_handler(STOP, self._on_stop)
            self._task.start()
            self._started = True
        return self

    async def close(self) -> None:
        if self._started:
            self._started = False
            await self._task.close()
            self.host.remove_handler(STOP)
            self._set(None, None)

    async def __aenter__(self) -> RelayKeeper:
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def wait_reserved(self, timeout: float) -> CircuitAddress:
        """Our relayed address once a reservation holds (RelayRefused after `timeout` seconds, or
        as soon as every candidate has refused or not answered once)."""
        waits = [asyncio.ensure_future(self._reserved.wait()), asyncio.ensure_future(self._tried_all.wait())]
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        if self.current is None:
            how = "each refused or did not answer" if self._tried_all.is_set() else f"none within {timeout:g}s"
            raise RelayRefused(f"no relay of {len(self.candidates)} took a reservation: {how}")
        return self.current

    def _set(self, relay: TcpAddress | None, reservation: Reservation | None) -> None:
        if relay is None or relay.peer_id is None:
            self.current, self.reservation = None, None
            self._reserved.clear()
            self.host.set_relayed_addresses(())
            return
        self.current, self.reservation = CircuitAddress(relay, self.host.peer_id), reservation
        self.host.set_relayed_addresses((self.current,))
        self._reserved.set()

    # --- choosing and keeping -------------------------------------------------------------

    async def _keep(self) -> None:
        while True:
            for relay in await self._by_rtt():
                try:
                    await self._hold(relay)
                except P2PError as e:
                    logger.info("%s: reservation on relay %s ended: %s", self.host.peer_id, relay.peer_id, e)
                self._set(None, None)
            self._tried_all.set()
            await asyncio.sleep(RETRY_S)

    async def _by_rtt(self) -> list[TcpAddress]:
        """The candidates that answer a ping, nearest first (RTT of one call on a connection)."""

        async def rtt(addr: TcpAddress) -> float | None:
            loop = asyncio.get_running_loop()
            try:
                await self.host.connect(addr, timeout=self.call_timeout)
                began = loop.time()
                await self.host.call(addr, PING, {"v": VERSION}, timeout=self.call_timeout)
            except P2PError as e:
                logger.debug("relay %s does not answer: %s", addr, e)
                return None
            self.rtts[str(addr)] = loop.time() - began
            return self.rtts[str(addr)]

        measured = await asyncio.gather(*(rtt(addr) for addr in self.candidates))
        alive = [(t, i) for i, t in enumerate(measured) if t is not None]
        return [self.candidates[i] for _, i in sorted(alive)]

    async def _hold(self, relay: TcpAddress) -> None:
        """Reserve on `relay` and renew until it fails (raises P2PError then)."""
        while True:
            conn = await self.host.connect(relay, timeout=self.call_timeout)
            try:
                reply = await self.host.call(relay, RESERVE, {"v": VERSION}, timeout=self.call_timeout)
            except RemoteError as e:
                raise RelayRefused(f"relay {relay.peer_id} refused the reservation: {e}") from None
            reservation = decode_reservation(reply)
            self._set(relay, reservation)
            # renew at RENEW_AT of the ttl, and well within the idle timeout (a renewal is what keeps
            # the connection, and so the reservation, from idling out); at once if the connection goes
            renew_in = min(reservation.ttl * RENEW_AT, self.host.config.idle_timeout / 3)
            try:
                await asyncio.wait_for(conn.wait_closed(), renew_in)
            except asyncio.TimeoutError:
                continue
            raise P2PError(f"the connection to relay {relay.peer_id} closed")

    # --- stop: our end of a circuit ---------------------------------------------------------

    async def _on_stop(self, ctx: CallContext, args: Any) -> dict[str, Any]:
        request = decode_stop(args)
        current = self.current
        if current is None or current.relay.peer_id != ctx.peer_id:
            raise BadRequest("we hold no reservation on this relay")
        if request.peer == self.host.peer_id:
            raise BadRequest("a circuit from ourselves")
        stream = await self.host.open_stream(
            ctx.peer_id, ACCEPT, {"v": VERSION, "circuit": request.circuit}, timeout=self.call_timeout
        )
        protocol = self.host.inbound_protocol(expected_peer=request.peer)
        observed = self.reservation.observed if self.reservation is not None else None
        CircuitTransport(stream, protocol, peername=circuit_peername(ctx.peer_id), time_limit_s=request.limits.seconds,
                         observed=observed, peer_observed=request.observed).start()  # fmt: skip
        return {"v": VERSION}
