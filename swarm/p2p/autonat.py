"""Dial-back: can peers reach us on the multiaddrs we announce? (libp2p AutoNAT, simplified.)

    reachable = await check_reachability(host, helpers=initial_peer_maddrs)

The asking node calls `p2p.dialback` on a few peers with its announced multiaddrs. Each peer
dials them on a fresh connection (never the one the request came on), checks the handshake
proves the asker's PeerID, and answers which address worked. A node nobody can dial back is
behind NAT or a firewall: it should run in client mode (it asks, serves nothing) instead of
making groups wait on a member nobody can reach.

Abuse bounds: a peer only dials addresses on the IP the request came from (so it cannot be
used to scan or flood third parties), at most MAX_ADDRS of them, at most MAX_PROBES askers at a
time per host (others get `busy` and ask again), each probe within PROBE_TIMEOUT seconds.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from swarm.p2p.errors import BadRequest, P2PError
from swarm.p2p.handlers import CallContext
from swarm.p2p.maddr import TcpAddress, parse_maddr
from swarm.p2p.peer_id import PeerID

logger = logging.getLogger(__name__)

DIALBACK = "p2p.dialback"
MAX_ADDRS = 8
MAX_PROBES = 8  # askers served at once: nodes that start together through one bootstrap are not serialized
PROBE_TIMEOUT = 5.0


class _Host(Protocol):  # what the handler needs of a P2PHost (host.py imports this module)
    peer_id: PeerID

    async def probe(self, peer: TcpAddress | str, *, timeout: float | None = None) -> PeerID: ...

    async def call(self, peer: Any, method: str, args: Any = None, *, timeout: float | None = None) -> Any: ...


@dataclass(frozen=True, slots=True)
class Reachability:
    reachable: bool | None  # None: no helper answered (we cannot tell)
    confirmed_by: str | None = None  # the PeerID of the helper that dialed us back
    address: str | None = None  # the multiaddr that worked
    reason: str = ""  # why not, when not


def dialback_handler(host: _Host) -> Any:
    """The `p2p.dialback` handler of `host`: {"maddrs": [...]} -> {"ok": maddr} or {"error": why}."""
    probing = asyncio.Semaphore(MAX_PROBES)

    async def handle(ctx: CallContext, args: Any) -> dict[str, Any]:
        maddrs = args.get("maddrs") if isinstance(args, dict) else None
        if not isinstance(maddrs, list) or not 1 <= len(maddrs) <= MAX_ADDRS:
            raise BadRequest(f"dialback: 'maddrs' must be a list of 1 to {MAX_ADDRS} multiaddrs")
        addrs = []
        for text in maddrs:
            try:
                addrs.append(parse_maddr(text) if isinstance(text, str) else None)
            except ValueError:
                addrs.append(None)
        if probing.locked():
            return {"error": "busy"}
        async with probing:
            tried = 0
            for addr in addrs:
                if addr is None or not _same_ip(addr.host, ctx.remote_address[0]):
                    continue
                tried += 1
                try:
                    found = await host.probe(addr.with_peer_id(ctx.peer_id), timeout=PROBE_TIMEOUT)
                except (P2PError, OSError) as e:
                    logger.debug("dial-back to %s failed: %s", addr, e)
                    continue
                if found == ctx.peer_id:
                    return {"ok": addr.to_maddr()}
            why = "no address on the IP the request came from" if tried == 0 else f"none of {tried} answered"
            return {"error": why}

    return handle


async def check_reachability(
    host: _Host,
    maddrs: Sequence[str],
    helpers: Sequence[str],
    *,
    timeout: float = 2 * PROBE_TIMEOUT + 5,
    busy_retry: float = 0.2,
) -> Reachability:
    """Ask each helper in turn (multiaddrs) to dial us back on `maddrs`; the first answer counts.
    A helper probes a few askers at a time (MAX_PROBES), so nodes that start together through
    one bootstrap peer may get `busy`: those helpers are asked again until `timeout` has passed."""
    if not maddrs:
        return Reachability(False, reason="no announced address")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    reasons: list[str] = []
    pending = list(helpers)
    while pending:
        busy = []
        for helper in pending:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                reply = await host.call(helper, DIALBACK, {"maddrs": list(maddrs)[:MAX_ADDRS]}, timeout=left)
            except P2PError as e:
                reasons.append(f"{helper}: {e}")
                continue
            if isinstance(reply, dict) and isinstance(reply.get("ok"), str):
                return Reachability(True, confirmed_by=helper, address=reply["ok"])
            if isinstance(reply, dict) and reply.get("error") != "busy":
                return Reachability(False, reason=str(reply.get("error"))[:200])
            busy.append(helper)
        if not busy or deadline - loop.time() <= busy_retry:
            reasons += [f"{helper}: busy" for helper in busy]
            break
        await asyncio.sleep(busy_retry)
        pending = busy
    return Reachability(None, reason="; ".join(reasons)[:500] or "no helper to ask")


def _same_ip(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return False
