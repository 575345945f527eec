"""RelayService: a reachable host relays circuits for NATed peers (relay_wire.py is the protocol).

    async with RelayService(host, RelayConfig()) as relay:   # serves reserve, hop and accept
        ...

What a relay spends is bounded, whoever asks:
- reservations: at most max_reservations in all and max_reservations_per_ip per source (an IPv4
  address or an IPv6 /64, admission.source_of); a peer renewing keeps its one slot. At the total
  cap a newcomer takes the newest slot of the source holding the most, unless its own source
  holds as many: a flood of fresh identities from a few addresses cannot lock out other sources.
  A reservation ends at its expiry or when its peer's connection to us closes.
- circuits: at most max_circuits at once and max_circuits_per_peer touching one peer; each one
  carries at most circuit_bytes (both directions together) for at most circuit_seconds, and is
  then closed with ERROR circuit_limit at both ends.
- a target has stop_timeout_s to accept a circuit; a relay never dials a target (it only uses
  the connection the reservation came on) and never relays over a relayed connection.

Failure modes: a relay sees who talks to whom, when, and how much (never what: the two ends'
session is end-to-end encrypted and authenticated). Relayed traffic costs the relay twice its
bytes on its own link; the limits are what keep it a signalling path.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

from swarm.p2p.admission import admit_handshake, source_of
from swarm.p2p.circuit import is_relayed
from swarm.p2p.errors import BadRequest, Busy, NotFound, P2PError, RPCError, RPCTimeout
from swarm.p2p.handlers import CallContext
from swarm.p2p.maddr import TcpAddress
from swarm.p2p.peer_id import PeerID
from swarm.p2p.relay_wire import (
    ACCEPT,
    CIRCUIT_ID_BYTES,
    HOP,
    PING,
    RESERVE,
    STOP,
    VERSION,
    Limits,
    Opening,
    Reservation,
    StopRequest,
    check_version,
    circuit_field,
    observed_address,
    peer_field,
)
from swarm.p2p.stream import Stream
from swarm.p2p.wire import ErrorCode


class NoReservationHere(RPCError):
    code = ErrorCode.NO_RESERVATION


class CircuitLimitReached(RPCError):
    code = ErrorCode.CIRCUIT_LIMIT


class CircuitEnded(RPCError):
    code = ErrorCode.CIRCUIT_CLOSED


@dataclass(frozen=True, kw_only=True, slots=True)
class RelayConfig:
    reservation_ttl_s: float = 600.0  # a reservation's life; its holder renews it before then
    max_reservations: int = 128
    max_reservations_per_ip: int = 4  # a home NAT has a few volunteers; a flood has many identities
    max_circuits: int = 64
    # circuits to or from one peer, at once (go-libp2p's relay default too). A relayed member of a
    # group of relayed peers holds one to each, and two for a while when both ends of a pair dial
    # at once (the spare idles out): at 8, one of six relayed trainers starting together was refused
    # a circuit and missed its first round
    max_circuits_per_peer: int = 16
    circuit_bytes: int = 1 << 30  # both directions together
    circuit_seconds: float = 1800.0
    stop_timeout_s: float = 5.0  # how long a target has to accept a circuit
    exempt_ips: tuple[str, ...] = ()  # sources whose per-IP cap is the total (a lab's shared NAT)

    def __post_init__(self) -> None:
        for name in ("reservation_ttl_s", "max_reservations", "max_reservations_per_ip", "max_circuits",
                     "max_circuits_per_peer", "circuit_bytes", "circuit_seconds", "stop_timeout_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"RelayConfig.{name} must be positive, got {getattr(self, name)}")
        Limits(self.circuit_bytes, self.circuit_seconds)  # ValueError when out of range

    @property
    def limits(self) -> Limits:
        return Limits(self.circuit_bytes, self.circuit_seconds)


@dataclass(slots=True)
class _Held:
    source: str
    since: float
    expires: float


class Reservations:
    """The relay's reservation table: pure decisions, the time and the live peers passed in."""

    def __init__(self, *, per_source: int, total: int, exempt: tuple[str, ...] = ()) -> None:
        self.per_source, self.total, self._exempt = per_source, total, exempt
        self._held: dict[PeerID, _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def by_source(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for held in self._held.values():
            counts[held.source] = counts.get(held.source, 0) + 1
        return counts

    def purge(self, now: float, live: set[PeerID]) -> None:
        """Forget the expired reservations and those whose peer is no longer connected."""
        self._held = {p: h for p, h in self._held.items() if h.expires > now and p in live}

    def holds(self, peer: PeerID, now: float) -> bool:
        held = self._held.get(peer)
        return held is not None and held.expires > now

    def reserve(self, peer: PeerID, source: str, now: float, ttl: float) -> bool:
        """Grant or renew `peer`'s reservation; False at the caps. May evict another source's newest."""
        if (held := self._held.get(peer)) is not None and held.source == source:
            held.expires = now + ttl
            return True
        self._held.pop(peer, None)  # the same identity from another address: it moved
        pending = [(h.source, h.since) for h in self._held.values()]
        per_source = self.total if source in self._exempt else self.per_source
        verdict = admit_handshake(pending, source, per_source=per_source, total=self.total)
        if not verdict.admit:
            return False
        if verdict.drop_oldest_of is not None:
            theirs = [(h.since, p) for p, h in self._held.items() if h.source == verdict.drop_oldest_of]
            # the newest: a source's long-held reservations are its likeliest honest ones
            del self._held[max(theirs, key=lambda item: item[0])[1]]
        self._held[peer] = _Held(source, now, now + ttl)
        return True


class _RelayHost(Protocol):  # what the service needs of a P2PHost
    peer_id: PeerID

    def add_handler(self, method: str, fn: Any) -> None: ...
    def add_stream_handler(self, method: str, fn: Any) -> None: ...
    def remove_handler(self, method: str) -> None: ...
    def connected_peers(self) -> list[PeerID]: ...
    async def call(self, peer: Any, method: str, args: Any = None, *, timeout: float | None = None) -> Any: ...


@dataclass(slots=True)
class _Pending:
    """A circuit whose target has been asked (stop) and has not opened its end yet."""

    target: PeerID
    accepted: asyncio.Future[Stream]  # the target's accept stream
    ended: asyncio.Future[RPCError | None]  # how the splice ended: what the accept call answers


class RelayService:
    """Serves RESERVE, HOP and ACCEPT on `host` (see the module docstring)."""

    def __init__(self, host: _RelayHost, config: RelayConfig | None = None) -> None:
        self.host = host
        self.config = config or RelayConfig()
        cfg = self.config
        self.reservations = Reservations(
            per_source=cfg.max_reservations_per_ip, total=cfg.max_reservations, exempt=cfg.exempt_ips
        )
        self._pending: dict[bytes, _Pending] = {}
        self._observed: dict[PeerID, TcpAddress] = {}  # each reserving peer's address as we see it
        self._circuits_of: dict[PeerID, int] = {}
        self.circuits = 0  # open now
        self.relayed_bytes = 0  # all circuits so far, both directions
        self._started = False

    async def start(self) -> RelayService:
        if not self._started:
            self.host.add_handler(PING, self._ping)
            self.host.add_handler(RESERVE, self._reserve)
            self.host.add_stream_handler(HOP, self._hop)
            self.host.add_stream_handler(ACCEPT, self._accept)
            self._started = True
        return self

    async def close(self) -> None:
        """Stop serving; circuits still open end with their connections or their limits."""
        if self._started:
            for method in (PING, RESERVE, HOP, ACCEPT):
                self.host.remove_handler(method)
            self._started = False

    async def __aenter__(self) -> RelayService:
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    def _purge(self) -> float:
        now = asyncio.get_running_loop().time()
        self.reservations.purge(now, set(self.host.connected_peers()))
        return now

    async def _ping(self, ctx: CallContext, args: Any) -> dict[str, Any]:
        check_version(args)
        return {"v": VERSION}

    # --- reserve ------------------------------------------------------------------------------

    async def _reserve(self, ctx: CallContext, args: Any) -> dict[str, Any]:
        check_version(args)
        if is_relayed(ctx.remote_address):
            raise BadRequest("relay: a reservation must come on a direct connection")
        now = self._purge()
        ttl = self.config.reservation_ttl_s
        self._observed = {p: a for p, a in self._observed.items() if self.reservations.holds(p, now)}
        if not self.reservations.reserve(ctx.peer_id, source_of(ctx.remote_address[0]), now, ttl):
            cfg = self.config
            raise Busy(f"relay holds {len(self.reservations)} reservations (at most "
                       f"{cfg.max_reservations_per_ip} per source, {cfg.max_reservations} in all)")  # fmt: skip
        observed = observed_address(ctx.remote_address)
        if observed is not None:
            self._observed[ctx.peer_id] = observed
        return Reservation(ttl, self.config.limits, observed).encode()

    # --- hop: the dialer's end ----------------------------------------------------------------

    def _pick_target(self, wanted: PeerID) -> PeerID:
        """The peer to stop for a circuit to `wanted`: the one that reserved (an honest relay)."""
        if not self.reservations.holds(wanted, self._purge()):
            raise NoReservationHere(f"relay {self.host.peer_id} holds no reservation for {wanted}")
        return wanted

    async def _hop(self, ctx: CallContext, args: Any, stream: Stream) -> None:
        check_version(args)
        wanted = peer_field(args)
        if is_relayed(ctx.remote_address):
            raise BadRequest("relay: no circuit over a relayed connection")
        if wanted == ctx.peer_id:
            raise BadRequest("relay: a circuit to oneself")
        target = self._pick_target(wanted)
        cfg = self.config
        if self.circuits >= cfg.max_circuits:
            raise Busy(f"relay has {self.circuits} circuits open, its limit")
        if max(self._circuits_of.get(p, 0) for p in (ctx.peer_id, target)) >= cfg.max_circuits_per_peer:
            raise Busy(f"relay has {cfg.max_circuits_per_peer} circuits open for this pair's peers, its limit")
        circuit_id = os.urandom(CIRCUIT_ID_BYTES)
        loop = asyncio.get_running_loop()
        pending = _Pending(target, loop.create_future(), loop.create_future())
        self._pending[circuit_id] = pending
        self._count(+1, ctx.peer_id, target)
        ended: RPCError | None = None
        try:
            dialer_at = observed_address(ctx.remote_address)
            their_end = await self._stop(circuit_id, ctx.peer_id, dialer_at, pending)
            target_at = self._observed.get(target)
            await stream.write(msgpack.packb(Opening(cfg.limits, dialer_at, target_at).encode()))
            await self._splice(stream, their_end, cfg.limits)
        except RPCError as e:
            ended = e
            raise
        except P2PError as e:  # our own connection to the dialer or the target failed
            ended = CircuitEnded(f"the circuit failed: {e}")
            raise ended from None
        finally:
            self._pending.pop(circuit_id, None)
            self._count(-1, ctx.peer_id, target)
            if not pending.ended.done():
                pending.ended.set_result(ended)
            if not pending.accepted.done():
                pending.accepted.cancel()

    async def _stop(self, circuit_id: bytes, dialer: PeerID, dialer_at: TcpAddress | None, pending: _Pending) -> Stream:
        """Ask the target to open its end; its accept stream, or NoReservationHere."""
        cfg, target = self.config, pending.target
        if target not in self.host.connected_peers():  # never dial a target: it is behind NAT
            raise NoReservationHere(f"{target} is no longer connected to relay {self.host.peer_id}")
        request = StopRequest(circuit_id, dialer, cfg.limits, dialer_at).encode()
        try:
            await self.host.call(target, STOP, request, timeout=cfg.stop_timeout_s)
            return await asyncio.wait_for(asyncio.shield(pending.accepted), cfg.stop_timeout_s)
        except (P2PError, asyncio.TimeoutError) as e:
            raise NoReservationHere(f"{target} did not accept the circuit: {e}") from None

    def _count(self, step: int, *peers: PeerID) -> None:
        self.circuits += step
        for peer in peers:
            left = self._circuits_of.get(peer, 0) + step
            if left > 0:
                self._circuits_of[peer] = left
            else:
                self._circuits_of.pop(peer, None)

    # --- accept: the target's end -------------------------------------------------------------

    async def _accept(self, ctx: CallContext, args: Any, stream: Stream) -> None:
        check_version(args)
        pending = self._pending.get(circuit_field(args))
        if pending is None or pending.target != ctx.peer_id or pending.accepted.done():
            raise NotFound("relay: no circuit waits for this peer under that id")
        pending.accepted.set_result(stream)
        # the splice runs in the hop call; this call answers as it ends, within its time limit
        limit = self.config.circuit_seconds + self.config.stop_timeout_s
        try:
            ended = await asyncio.wait_for(asyncio.shield(pending.ended), limit)
        except asyncio.CancelledError:  # the target gave up its end (CANCEL): the splice must see it
            stream.abandon()
            raise
        if ended is not None:
            raise type(ended)(ended.message)

    # --- splicing -----------------------------------------------------------------------------

    async def _splice(self, ours: Stream, theirs: Stream, limits: Limits) -> None:
        """Pass chunks both ways until both ends ended; CircuitLimitReached at a limit,
        CircuitEnded when one end went away."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.seconds
        carried = [0]

        async def pump(src: Stream, dst: Stream) -> None:
            while (chunk := await src.read(timeout=max(deadline - loop.time(), 0.001))) is not None:
                carried[0] += len(chunk)
                self.relayed_bytes += len(chunk)
                if carried[0] > limits.bytes:
                    raise CircuitLimitReached(f"the circuit carried its limit of {limits.bytes} bytes")
                await dst.write(chunk, timeout=max(deadline - loop.time(), 0.001))
            await dst.end()

        tasks = [loop.create_task(pump(ours, theirs)), loop.create_task(pump(theirs, ours))]
        try:
            done, _ = await asyncio.wait(tasks, timeout=limits.seconds, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if not done or loop.time() >= deadline:
            raise CircuitLimitReached(f"the circuit reached its time limit of {limits.seconds:g}s")
        for task in done:
            error = task.exception()
            if isinstance(error, RPCError):
                raise error
            if isinstance(error, RPCTimeout):  # a read or write ran into the deadline
                raise CircuitLimitReached(f"the circuit reached its time limit of {limits.seconds:g}s")
            if error is not None:
                raise CircuitEnded(f"an end of the circuit went away: {error}")
