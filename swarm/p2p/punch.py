"""Hole punching over a relayed connection, after libp2p's DCUtR (not wire-compatible).

    async with Puncher(host):          # host built with P2PConfig(reuse_port=True)
        await host.call(relayed_maddr, ...)   # a punch starts once the relayed connection is up

When we dial a peer through a relay (the initiator, I) and both ends know the addresses the relay
observed for them (relay_wire.py: `observed`, `peer_observed`), I upgrades the connection:

    I -> P  p2p.dcutr.connect  unary, on the relayed connection. args {v, addrs}: I's observed
                               addresses. P refuses (bad_request) any address outside the IP the
                               relay observed for I, so that nobody can make P dial a third
                               party; P answers {v, addrs} with its own observed address. I
                               takes the call's round trip as the RTT.
    I -> P  p2p.dcutr.sync     unary. args {v}. P dials I's addresses at once; I dials P's RTT/2
                               after it sent sync, so that both SYNs cross at about the same
                               moment.

A host peers can dial (`reachable=True`: the dial-back check passed) needs no punch of its own:
as I it offers its listening address at the IP the relay observed and does not dial; P's dial
from its listening port reaches our listener, and the connection is as direct as a punched one.
It needs no reuse_port either. Otherwise both dial from their listening port (config.reuse_port),
whose NAT mapping is the one the relay observed: behind two cone NATs each SYN opens the way for
the other's (TCP simultaneous open).
Two peers the relay observed at one public IP sit behind one NAT, where a dial to that public
address needs hairpinning, which most routers do not do: these two also exchange their LAN
addresses (`lan`, private IPv4 addresses only, never sent to a peer behind another IP) and dial
them too, so that they meet directly on their LAN.
Both ends dialed, so neither is "the listener": the handshake's roles are fixed by PeerID order
(the smaller is the dialer), on the connect()ed socket and on one our listener accepts alike
(Dialer.expect_punch). Whichever direct connection authenticates first carries the session from
then on (the host prefers a direct connection to a relayed one); I closes the relayed one then
if it carries no call, else its idle timer does. A punch that fails is tried `attempts` times; then the pair stays
relayed, as behind a symmetric NAT (a new port per destination: the observed one is useless).
`outcomes` remembers, per peer, PUNCHED or RELAYED.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from dataclasses import dataclass
from typing import Any, Protocol

from swarm.p2p import handshake as hs
from swarm.p2p.circuit import is_relayed
from swarm.p2p.config import P2PConfig
from swarm.p2p.connection import Connection
from swarm.p2p.errors import BadRequest, MultiaddrError, P2PError
from swarm.p2p.handlers import CallContext
from swarm.p2p.maddr import TcpAddress, local_addresses, parse_maddr
from swarm.p2p.peer_id import PeerID

logger = logging.getLogger(__name__)

CONNECT = "p2p.dcutr.connect"
SYNC = "p2p.dcutr.sync"
VERSION = 1
MAX_ADDRS = 4
PUNCHED, RELAYED = "punched", "relayed"


@dataclass(frozen=True, kw_only=True, slots=True)
class PunchConfig:
    attempts: int = 3  # public measurements: 97.6% of the punches that succeed do so at the first
    dial_timeout_s: float = 5.0  # covers SYN retransmits at 1 s and 3 s
    call_timeout_s: float = 5.0  # CONNECT and SYNC, on the relayed connection

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.dial_timeout_s <= 0 or self.call_timeout_s <= 0:
            raise ValueError("PunchConfig: attempts >= 1 and positive timeouts")


class _PunchHost(Protocol):  # what the puncher needs of a P2PHost
    peer_id: PeerID
    config: P2PConfig

    def add_handler(self, method: str, fn: Any) -> None: ...
    def remove_handler(self, method: str) -> None: ...
    def watch_connections(self, watcher: Any, *, stop: bool = False) -> None: ...
    def connections_to(self, peer: PeerID) -> list[Connection]: ...
    def expect_punch(self, peer: PeerID, role: str, seconds: float) -> None: ...
    def listening_address(self) -> TcpAddress | None: ...
    async def punch_dial(self, addr: TcpAddress, role: str, *, timeout: float) -> Connection: ...


def punch_role(ours: PeerID, theirs: PeerID) -> str:
    """The handshake role of our end of a punched connection: both ends dialed, so PeerID order decides."""
    return hs.DIALER if ours < theirs else hs.LISTENER


def check_addrs(raw: Any, allowed: TcpAddress | None) -> list[TcpAddress]:
    """The addresses a peer asks us to dial, each on the IP the relay observed for it
    (BadRequest otherwise: a punch must never be turned on a third party)."""
    if allowed is None:
        raise BadRequest("punch: the relay told us no address for this peer: nothing to check against")
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_ADDRS:
        raise BadRequest(f"punch: 'addrs' must list 1 to {MAX_ADDRS} multiaddrs")
    out = []
    for text in raw:
        addr = _plain_address(text)
        if addr is None or addr.host_protocol not in ("ip4", "ip6"):
            raise BadRequest("punch: each address must be /ip4 or /ip6 HOST/tcp/PORT")
        if addr.host != allowed.host:
            raise BadRequest(f"punch: {addr} is outside the address the relay observed ({allowed.host})")
        out.append(addr)
    return out


def _plain_address(text: Any) -> TcpAddress | None:
    """A peer's /ipX/HOST/tcp/PORT with no /p2p/ part, or None when `text` is not one."""
    try:
        addr = parse_maddr(text) if isinstance(text, str) else None
    except MultiaddrError:
        return None
    return addr if addr is not None and addr.peer_id is None else None


def one_nat(ours: TcpAddress | None, theirs: TcpAddress | None) -> bool:
    """Did the relay observe both ends at one public IP (behind one NAT)?"""
    return ours is not None and theirs is not None and ours.host == theirs.host


def _lan_ip(text: str) -> bool:
    try:
        ip = ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return ip.is_private and not ip.is_loopback and not ip.is_unspecified and not ip.is_link_local


def check_lan(raw: Any, ours: TcpAddress | None, theirs: TcpAddress | None) -> list[TcpAddress]:
    """The LAN addresses a peer behind our own NAT asks us to dial: none unless the relay saw both
    ends at one public IP, and then only private IPv4 addresses (BadRequest otherwise)."""
    if raw is None or not one_nat(ours, theirs):
        return []
    if not isinstance(raw, list) or len(raw) > MAX_ADDRS:
        raise BadRequest(f"punch: 'lan' must list at most {MAX_ADDRS} multiaddrs")
    out = []
    for text in raw:
        addr = _plain_address(text)
        if addr is None or addr.host_protocol != "ip4" or not _lan_ip(addr.host):
            raise BadRequest("punch: each LAN address must be /ip4/PRIVATE-HOST/tcp/PORT")
        out.append(addr)
    return out


def _source_ip(target: str) -> str | None:
    """The local address this machine sends from towards `target`: a route lookup (a UDP socket's
    connect sends nothing). Where a host listens on 0.0.0.0, this is its address on the LAN."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return None


def _observed(conn: Connection) -> tuple[TcpAddress | None, TcpAddress | None]:
    """(ours, theirs): the addresses the relay of a relayed connection observed for its two ends."""
    transport = conn.protocol.transport
    if transport is None:
        return None, None
    return transport.get_extra_info("observed"), transport.get_extra_info("peer_observed")


class Puncher:
    """Upgrades the relayed connections `host` dials to direct ones (module docstring)."""

    def __init__(self, host: _PunchHost, config: PunchConfig | None = None, *, reachable: bool = False) -> None:
        if not host.config.reuse_port and not reachable:
            raise ValueError("hole punching dials from the listening port: use P2PConfig(reuse_port=True)")
        self.host = host
        self.reachable = reachable  # peers can dial us: we offer our listening address and let them dial
        self.config = config or PunchConfig()
        self.outcomes: dict[PeerID, str] = {}
        self._settled: dict[PeerID, asyncio.Event] = {}  # set when a peer's outcome is known
        self._offered: dict[PeerID, list[TcpAddress]] = {}  # responder: what each initiator asked us to dial
        self._tasks: dict[PeerID, asyncio.Task[None]] = {}
        self._direct_seen: dict[PeerID, asyncio.Event] = {}  # reachable initiator: set when the peer dials in
        self._started = False

    async def start(self) -> Puncher:
        if not self._started:
            self.host.add_handler(CONNECT, self._on_connect)
            self.host.add_handler(SYNC, self._on_sync)
            self.host.watch_connections(self._on_connection)
            self._started = True
        return self

    async def close(self) -> None:
        if self._started:
            self._started = False
            self.host.watch_connections(self._on_connection, stop=True)
            for method in (CONNECT, SYNC):
                self.host.remove_handler(method)
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            if tasks:  # a cancelled dial closes its socket at once: this wait is short
                await asyncio.wait(tasks, timeout=self.config.dial_timeout_s)

    async def __aenter__(self) -> Puncher:
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def outcome(self, peer: PeerID, *, timeout: float) -> str:
        """PUNCHED or RELAYED once the punch with `peer` is over (TimeoutError after `timeout`)."""
        if peer not in self.outcomes:
            await asyncio.wait_for(self._settled.setdefault(peer, asyncio.Event()).wait(), timeout)
        return self.outcomes[peer]

    def _settle(self, peer: PeerID, outcome: str) -> None:
        self.outcomes[peer] = outcome
        self._settled.setdefault(peer, asyncio.Event()).set()

    def _spawn(self, peer: PeerID, work: Any) -> None:
        if peer in self._tasks:
            work.close()
            return
        task = asyncio.get_running_loop().create_task(work)
        self._tasks[peer] = task
        task.add_done_callback(lambda done: self._done(peer, done))

    def _done(self, peer: PeerID, task: asyncio.Task[None]) -> None:
        if self._tasks.get(peer) is task:
            del self._tasks[peer]
        if not task.cancelled() and (error := task.exception()) is not None:
            logger.error("%s: hole punch with %s failed unexpectedly", self.host.peer_id, peer, exc_info=error)

    def _offer(self, ours: TcpAddress) -> TcpAddress | None:
        """Where the peer should dial us: the address the relay observed, which our NAT maps to our
        listening port; a reachable host's listening port at that IP (its dials use other ports)."""
        if not self.reachable:
            return ours
        for text in self.host.config.announce_maddrs:  # a forwarded port: what peers dial
            announced = parse_maddr(text)
            if announced.host == ours.host:
                return TcpAddress(ours.host_protocol, ours.host, announced.port)
        listening = self.host.listening_address()
        return None if listening is None else TcpAddress(ours.host_protocol, ours.host, listening.port)

    def _lan(self, public: TcpAddress) -> list[str]:
        """Our private IPv4 listening addresses: what a peer behind our own NAT (at `public`) can dial."""
        listening = self.host.listening_address()
        if listening is None:
            return []
        hosts = [listening.host]
        if listening.host == "0.0.0.0":  # the address we send from towards our NAT first, then the host's
            hosts = [h for h in dict.fromkeys([_source_ip(public.host), *local_addresses(ipv6=False)]) if h]
        return [TcpAddress("ip4", h, listening.port).to_maddr() for h in hosts if _lan_ip(h)][:MAX_ADDRS]

    def _direct(self, peer: PeerID) -> Connection | None:
        return next((c for c in self.host.connections_to(peer) if not is_relayed(c.remote_address)), None)

    def _on_connection(self, conn: Connection) -> None:
        """Every kept connection: a relayed one we dialed starts a punch; a direct one ends one."""
        if not is_relayed(conn.remote_address):
            if conn.peer_id in self._direct_seen:
                self._direct_seen[conn.peer_id].set()
            if conn.peer_id in self._offered or self.outcomes.get(conn.peer_id) == RELAYED:
                self._settle(conn.peer_id, PUNCHED)
            return
        if conn.role == hs.DIALER and self._direct(conn.peer_id) is None and all(_observed(conn)):
            self._spawn(conn.peer_id, self._initiate(conn))

    # --- the initiator ----------------------------------------------------------------------

    async def _initiate(self, relayed: Connection) -> None:
        peer, cfg = relayed.peer_id, self.config
        ours, theirs = _observed(relayed)
        assert ours is not None
        for attempt in range(1, cfg.attempts + 1):
            try:
                if await self._attempt(relayed, ours, theirs):
                    self._settle(peer, PUNCHED)
                    logger.info("%s: punched a direct connection to %s (attempt %d)", self.host.peer_id, peer, attempt)
                    if not relayed.busy:  # the relay's circuit is no longer needed
                        relayed.close()
                    return
            except P2PError as e:
                if relayed.closed:
                    break
                logger.info("%s: punch to %s, attempt %d: %s", self.host.peer_id, peer, attempt, e)
        self._settle(peer, RELAYED)
        logger.info("%s: no direct connection to %s: it stays relayed", self.host.peer_id, peer)

    async def _attempt(self, relayed: Connection, ours: TcpAddress, theirs: TcpAddress | None) -> bool:
        loop, cfg, peer = asyncio.get_running_loop(), self.config, relayed.peer_id
        offer = self._offer(ours)
        if offer is None:
            return False
        began = loop.time()
        request: dict[str, Any] = {"v": VERSION, "addrs": [offer.to_maddr()]}
        if one_nat(ours, theirs):  # our LAN addresses only to a peer behind our own NAT
            request["lan"] = self._lan(ours)
        reply = await relayed.call(CONNECT, request, cfg.call_timeout_s)
        rtt = loop.time() - began
        reply = reply if isinstance(reply, dict) else {}
        addrs = check_addrs(reply.get("addrs"), theirs) + check_lan(reply.get("lan"), ours, theirs)
        role = punch_role(self.host.peer_id, peer)
        self.host.expect_punch(peer, role, cfg.dial_timeout_s + cfg.call_timeout_s)
        sync = loop.create_task(relayed.call(SYNC, {"v": VERSION}, cfg.call_timeout_s))
        seen = self._direct_seen.setdefault(peer, asyncio.Event())
        try:
            if self.reachable:  # the peer dials our listener; we wait for it
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(seen.wait(), cfg.dial_timeout_s + rtt)
                return self._direct(peer) is not None
            await asyncio.sleep(rtt / 2)  # SYNC reaches the peer after about RTT/2: both dial now
            return await self._dial(peer, addrs, role)
        finally:
            self._direct_seen.pop(peer, None)
            if not sync.done():
                sync.cancel()
            await asyncio.gather(sync, return_exceptions=True)  # its reply or failure says nothing more

    async def _dial(self, peer: PeerID, addrs: list[TcpAddress], role: str) -> bool:
        """Dial each address from our listening port; True once a direct connection to `peer`
        exists (ours, or the one our listener accepted from the peer's own dial)."""
        cfg = self.config
        dials = [self.host.punch_dial(a.with_peer_id(peer), role, timeout=cfg.dial_timeout_s) for a in addrs]
        results = await asyncio.gather(*dials, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, (P2PError, OSError)):
                raise result
            if isinstance(result, Exception):
                logger.debug("%s: punch dial to %s: %s", self.host.peer_id, peer, result)
        return self._direct(peer) is not None

    # --- the responder ----------------------------------------------------------------------

    def _relayed_from(self, ctx: CallContext) -> Connection:
        if not is_relayed(ctx.remote_address):
            raise BadRequest("punch: only over a relayed connection")
        relayed = next((c for c in self.host.connections_to(ctx.peer_id) if is_relayed(c.remote_address)), None)
        if relayed is None:
            raise BadRequest("punch: the relayed connection is gone")
        return relayed

    async def _on_connect(self, ctx: CallContext, args: Any) -> dict[str, Any]:
        if not isinstance(args, dict) or args.get("v") != VERSION:
            raise BadRequest(f"punch: arguments must be a map with v={VERSION}")
        ours, theirs = _observed(self._relayed_from(ctx))
        addrs = check_addrs(args.get("addrs"), theirs)
        if ours is None:
            raise BadRequest("punch: the relay told us no address of ours")
        self._offered[ctx.peer_id] = addrs + check_lan(args.get("lan"), ours, theirs)
        role = punch_role(self.host.peer_id, ctx.peer_id)
        self.host.expect_punch(ctx.peer_id, role, self.config.dial_timeout_s + self.config.call_timeout_s)
        reply: dict[str, Any] = {"v": VERSION, "addrs": [ours.to_maddr()]}
        if one_nat(ours, theirs):
            reply["lan"] = self._lan(ours)
        return reply

    async def _on_sync(self, ctx: CallContext, args: Any) -> dict[str, Any]:
        self._relayed_from(ctx)
        addrs = self._offered.get(ctx.peer_id)
        if addrs is None:
            raise BadRequest("punch: sync before connect")
        role = punch_role(self.host.peer_id, ctx.peer_id)
        self._spawn(ctx.peer_id, self._respond(ctx.peer_id, addrs, role))
        return {"v": VERSION}

    async def _respond(self, peer: PeerID, addrs: list[TcpAddress], role: str) -> None:
        try:
            if await self._dial(peer, addrs, role):
                self._settle(peer, PUNCHED)
        finally:
            self._offered.pop(peer, None)
