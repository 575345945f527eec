"""Both ends of a circuit (relay_wire.py), as a P2PHost uses them.

- open_circuit(): the dialer's side of HOP. P2PHost dials a relayed multiaddr with it and then
  runs the ordinary handshake through the circuit (dialer.py).
- RelayKeeper: a NATed host's reservations. It times a call to each candidate relay (the given
  ones, and those `discover` returns: relays others announce, such as the DHT's records), reserves
  on the nearest until it holds `want` (1 or 2), renews each before expiry, and replaces one at
  once when its relay dies or refuses. It announces the relayed multiaddrs in
  host.visible_maddrs, nearest first, and answers STOP from a relay it holds a reservation on by
  opening its end (ACCEPT) and accepting the connection through it as an inbound one, expecting
  the PeerID the relay named. A learned relay is untrusted: one that does not answer or refuses
  is skipped for FAILED_FOR_S, so that a flood of fake announcements costs a few pings per pass
  and never hides a real relay for long.

    async with RelayKeeper(host, ["/ip4/203.0.113.7/tcp/31337/p2p/12D3Koo..."]) as keeper:
        await keeper.wait_reserved(timeout=10)
        print(host.visible_maddrs)   # ..., "/ip4/203.0.113.7/tcp/31337/p2p/12D3Koo.../p2p-circuit/p2p/<us>"
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

from swarm.p2p.circuit import CircuitTransport, circuit_peername
from swarm.p2p.config import P2PConfig
from swarm.p2p.errors import (
    BadRequest,
    MultiaddrError,
    NoReservation,
    P2PError,
    ProtocolError,
    RelayRefused,
    RemoteError,
)
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
LOOK_AGAIN_S = 60.0  # holding fewer reservations than wanted, look again after at most this long
MAX_WANT = 2  # a second relay keeps us reachable while the first is replaced; more buys little
MAX_LEARNED = 16  # relays learned from others tried in one pass, beside the given ones
FAILED_FOR_S = 300.0  # a learned relay that did not answer or refused is not tried again for this long
# passes in a row that come after RETRY_S because the one before ruled dead learned relays out: a
# flood of fake relay records (addresses an attacker chose) is then dialed at the backoff's pace
QUICK_PASSES = 2

# relays others announce (multiaddrs naming their PeerID); returns [] rather than raise on a failure
Discover = Callable[[], Awaitable[Sequence[str]]]


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


@dataclass(slots=True)
class _Hold:
    """One reservation we hold: on which relay, its terms, the RTT it was chosen by, its renewer."""

    relay: TcpAddress
    reservation: Reservation
    rtt: float
    task: asyncio.Task[None] | None = None


class RelayKeeper:
    """Keeps `want` reservations for `host` on the nearest live relays (module docstring)."""

    def __init__(self, host: _ClientHost, relays: Sequence[str], *, want: int = 1, discover: Discover | None = None,
                 call_timeout: float = 5.0) -> None:  # fmt: skip
        if not 1 <= want <= MAX_WANT:
            raise ValueError(f"a host keeps 1 to {MAX_WANT} reservations, not {want}")
        self.host = host
        self.candidates = [parse_maddr(text) for text in relays]
        for addr in self.candidates:
            if addr.peer_id is None:
                raise ValueError(f"relay address {addr} must end in /p2p/<relay's PeerID>")
        self.want = want
        self._discover = discover  # relays others announce (the DHT's records), asked when short of `want`
        self.call_timeout = call_timeout
        self.held: dict[PeerID, _Hold] = {}  # the reservations we hold, by relay
        self.rtts: dict[str, float] = {}  # the last round trip measured to each candidate, seconds
        # learned relays that did not answer or refused, until when they are not tried again: a
        # flood of fake records is drawn from afresh each time, never the same dead ones
        self._failed: dict[str, float] = {}
        self._reserved = asyncio.Event()
        # set when a whole pass over the candidates, begun since the last look_again(), ended
        # without a reservation (each refused or did not answer): waiting longer is waiting for
        # nothing. A pass begun before look_again() did not ask the relays it now knows of
        self._tried_all = asyncio.Event()
        self._asked = 0  # look_again() calls so far: a pass counts for _tried_all if none came during it
        self._changed = asyncio.Event()  # a reservation ended: look for another at once
        self._task = Supervised("relay reservation", self._keep)
        self._started = False

    @property
    def addresses(self) -> list[CircuitAddress]:
        """Our relayed addresses, nearest relay first."""
        return [CircuitAddress(h.relay, self.host.peer_id) for h in sorted(self.held.values(), key=lambda h: h.rtt)]

    @property
    def current(self) -> CircuitAddress | None:
        """Our relayed address on the nearest relay that holds a reservation for us, if any."""
        return next(iter(self.addresses), None)

    @property
    def reservation(self) -> Reservation | None:
        """The nearest relay's reservation (its terms, and the address it observed for us)."""
        held = sorted(self.held.values(), key=lambda h: h.rtt)
        return held[0].reservation if held else None

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
            self.held.clear()
            self._publish()

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
        current = self.current
        if current is None:
            how = "each refused or did not answer" if self._tried_all.is_set() else f"none within {timeout:g}s"
            raise RelayRefused(f"no relay of {len(self.candidates)} took a reservation: {how}")
        return current

    @property
    def ruled_out(self) -> list[PeerID]:
        """The learned relays that did not answer or refused lately: a draw of relays to try leaves
        them out, so that the next pass tries others (a flood of fake records is not drawn again)."""
        now = asyncio.get_running_loop().time()
        return [p for text, until in self._failed.items() if until > now and (p := parse_maddr(text).peer_id)]

    def look_again(self) -> None:
        """Look for relays now (more may be known: the owner has just reached the DHT); until that
        pass ends, wait_reserved() waits for it, even if every relay known before refused."""
        self._asked += 1
        self._tried_all.clear()
        self._changed.set()

    def _publish(self) -> None:
        """Announce the relayed addresses we hold now (none: nobody reaches us until one is back)."""
        addresses = self.addresses
        self.host.set_relayed_addresses(tuple(addresses))
        if addresses:
            self._reserved.set()
        else:
            self._reserved.clear()

    # --- choosing and keeping -------------------------------------------------------------

    async def _keep(self) -> None:
        wait, quick = RETRY_S, 0
        try:
            while True:
                # cleared before the pass: a reservation that ends or a look_again() during it
                # starts the next pass at once
                self._changed.clear()
                short, asked = len(self.held) < self.want, self._asked
                ruled_out = await self._fill() if short else 0
                if not self.held and asked == self._asked:
                    self._tried_all.set()
                # none held: try again every RETRY_S; short of `want`: again after twice as long
                # each time, up to LOOK_AGAIN_S; at once when a reservation ends or look_again().
                # A pass that ruled out learned relays makes the next draw a different one (dead
                # records are skipped): that one comes after RETRY_S, not after the backoff, at
                # most QUICK_PASSES times in a row.
                quick = quick + 1 if ruled_out and short and self.held else 0
                if not self.held or not short or 0 < quick <= QUICK_PASSES:
                    wait = RETRY_S
                else:
                    wait = min(2 * wait, LOOK_AGAIN_S)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), wait)
        finally:  # stopped (or a bug, and Supervised starts us again): end the renewers with us
            holds = list(self.held.values())
            self.held.clear()
            for hold in holds:
                if hold.task is not None:
                    hold.task.cancel()
            await asyncio.gather(*(h.task for h in holds if h.task is not None), return_exceptions=True)
            self._publish()

    async def _fill(self) -> int:
        """Reserve on the nearest candidates that answer until we hold `want` reservations; return
        how many learned relays this pass ruled out for a while (no answer, or a refusal)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._failed = {text: until for text, until in self._failed.items() if until > now}
        given = {a.peer_id for a in self.candidates}
        pool: dict[PeerID, TcpAddress] = {}
        for addr in [*self.candidates, *await self._learned()]:
            peer = addr.peer_id
            if peer is None or peer in self.held or peer == self.host.peer_id or peer in pool:
                continue  # the given address of a relay comes first
            if peer not in given and str(addr) in self._failed:
                continue
            pool[peer] = addr
        answered = await self._by_rtt(list(pool.values()))
        alive = {relay.peer_id for relay, _ in answered}
        failed_before = len(self._failed)
        for peer, addr in pool.items():  # a learned relay that did not answer is not asked again for a while
            if peer not in given and peer not in alive:
                self._failed[str(addr)] = now + FAILED_FOR_S
        for relay, rtt in answered:
            if len(self.held) >= self.want:
                break
            try:
                conn, reservation = await self._reserve(relay)
            except P2PError as e:
                logger.info("%s: relay %s refused a reservation: %s", self.host.peer_id, relay.peer_id, e)
                if relay.peer_id not in given:
                    self._failed[str(relay)] = now + FAILED_FOR_S
                continue
            hold = _Hold(relay, reservation, rtt)
            hold.task = loop.create_task(self._renew(hold, conn))
            self.held[relay.peer_id] = hold  # type: ignore[index]
            self._publish()
        return len(self._failed) - failed_before

    async def _learned(self) -> list[TcpAddress]:
        """Relays others announce, at most MAX_LEARNED (none without `discover`, or on its failure)."""
        if self._discover is None:
            return []
        try:
            texts = await asyncio.wait_for(self._discover(), self.call_timeout)
        except (P2PError, asyncio.TimeoutError) as e:
            logger.debug("no relays learned: %s", e)
            return []
        out = []
        for text in list(texts)[:MAX_LEARNED]:
            try:
                addr = parse_maddr(text)
            except MultiaddrError:
                continue
            if addr.peer_id is not None:
                out.append(addr)
        return out

    async def _by_rtt(self, candidates: list[TcpAddress]) -> list[tuple[TcpAddress, float]]:
        """The candidates that answer a ping, nearest first, with their RTT (one call on a connection)."""

        async def rtt(addr: TcpAddress) -> float | None:
            loop = asyncio.get_running_loop()
            try:
                await self.host.connect(addr, timeout=self.call_timeout)
                began = loop.time()
                await self.host.call(addr, PING, {"v": VERSION}, timeout=self.call_timeout)
            except P2PError as e:
                logger.debug("relay %s does not answer: %s", addr, e)
                self.rtts.pop(str(addr), None)
                return None
            self.rtts[str(addr)] = loop.time() - began
            return self.rtts[str(addr)]

        measured = await asyncio.gather(*(rtt(addr) for addr in candidates))
        alive = sorted((t, i) for i, t in enumerate(measured) if t is not None)
        return [(candidates[i], t) for t, i in alive]

    async def _reserve(self, relay: TcpAddress) -> tuple[Any, Reservation]:
        """Reserve (or renew) on `relay`: the connection the reservation is bound to, and its terms."""
        conn = await self.host.connect(relay, timeout=self.call_timeout)
        try:
            reply = await self.host.call(relay, RESERVE, {"v": VERSION}, timeout=self.call_timeout)
        except RemoteError as e:
            raise RelayRefused(f"relay {relay.peer_id} refused the reservation: {e}") from None
        return conn, decode_reservation(reply)

    async def _renew(self, hold: _Hold, conn: Any) -> None:
        """Renew `hold` until its relay fails; then drop it and wake the keeper to replace it."""
        relay = hold.relay
        try:
            while True:
                # renew at RENEW_AT of the ttl, and well within the idle timeout (a renewal is what keeps
                # the connection, and so the reservation, from idling out); at once if the connection goes
                renew_in = min(hold.reservation.ttl * RENEW_AT, self.host.config.idle_timeout / 3)
                try:
                    await asyncio.wait_for(conn.wait_closed(), renew_in)
                except asyncio.TimeoutError:
                    conn, hold.reservation = await self._reserve(relay)
                    continue
                raise P2PError(f"the connection to relay {relay.peer_id} closed")
        except P2PError as e:
            logger.info("%s: reservation on relay %s ended: %s", self.host.peer_id, relay.peer_id, e)
        finally:
            if self.held.get(relay.peer_id) is hold:  # type: ignore[arg-type]
                del self.held[relay.peer_id]  # type: ignore[arg-type]
                self._publish()
                self._changed.set()

    # --- stop: our end of a circuit ---------------------------------------------------------

    async def _on_stop(self, ctx: CallContext, args: Any) -> dict[str, Any]:
        request = decode_stop(args)
        hold = self.held.get(ctx.peer_id)
        if hold is None:
            raise BadRequest("we hold no reservation on this relay")
        if request.peer == self.host.peer_id:
            raise BadRequest("a circuit from ourselves")
        stream = await self.host.open_stream(
            ctx.peer_id, ACCEPT, {"v": VERSION, "circuit": request.circuit}, timeout=self.call_timeout
        )
        protocol = self.host.inbound_protocol(expected_peer=request.peer)
        observed = hold.reservation.observed
        CircuitTransport(stream, protocol, peername=circuit_peername(ctx.peer_id), time_limit_s=request.limits.seconds,
                         observed=observed, peer_observed=request.observed).start()  # fmt: skip
        return {"v": VERSION}
