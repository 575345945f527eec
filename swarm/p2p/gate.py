"""Gate: a host's admission state, fed to the pure rules of admission.py.

It holds the inbound connections still handshaking (with their source and start time) and the
peers we called (the last CALLED_PEERS_PER_SLOT * max_connections of them), and turns each
decision into what the host does: refuse, drop a pending handshake, close an idle connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence

from swarm.p2p import handshake as hs
from swarm.p2p.admission import PeerFacts, admit_handshake, plan_admission, source_of
from swarm.p2p.config import P2PConfig
from swarm.p2p.connection import Connection
from swarm.p2p.errors import HandshakeError
from swarm.p2p.peer_id import PeerID
from swarm.utils.log_once import RateLimitedLog

logger = logging.getLogger(__name__)

CALLED_PEERS_PER_SLOT = 4  # how many peers we called are remembered, per connection slot


class Gate:
    """Which inbound connections a host keeps (see admission.py for the rules)."""

    def __init__(self, peer_id: PeerID, config: P2PConfig) -> None:
        self.peer_id = peer_id  # ours, for log lines
        self.config = config
        self.pending: dict[Connection, tuple[str, float]] = {}  # (source, since), oldest first
        self._called: OrderedDict[PeerID, None] = OrderedDict()  # most recent last
        self._exempt = {source_of(ip) for ip in config.exempt_ips}  # no per-source caps for these
        self._flood_log = RateLimitedLog(logger)  # throwaway identities must not flood the log

    def may_handshake(self, ip: str) -> bool:
        """Whether a new inbound TCP connection from `ip` may handshake; drops the biggest
        source's oldest pending handshake when that makes room."""
        cfg, source = self.config, source_of(ip)
        verdict = admit_handshake(
            list(self.pending.values()),
            source,
            per_source=cfg.max_pending_handshakes if source in self._exempt else cfg.max_pending_handshakes_per_ip,
            total=cfg.max_pending_handshakes,
        )
        if verdict.drop_oldest_of is not None:
            oldest = next(c for c, (s, _) in self.pending.items() if s == verdict.drop_oldest_of)
            del self.pending[oldest]
            oldest.protocol.abort(HandshakeError(f"dropped: {cfg.max_pending_handshakes} handshakes pending"))
        return verdict.admit

    def handshaking(self, conn: Connection) -> None:
        self.pending[conn] = (source_of(conn.remote_address[0]), asyncio.get_running_loop().time())

    def handshake_over(self, conn: Connection) -> None:
        self.pending.pop(conn, None)

    def admit(self, conn: Connection, open_conns: Sequence[Connection]) -> tuple[bool, Connection | None]:
        """For an authenticated inbound connection: whether to keep it (refused, it is closed
        here), and the open connection to close to make room for it, if any."""
        cfg, newcomer = self.config, self._facts(len(open_conns), conn)
        plan = plan_admission(
            [self._facts(i, c) for i, c in enumerate(open_conns)],
            newcomer,
            per_source=cfg.max_connections if newcomer.source in self._exempt else cfg.max_connections_per_ip,
            total=cfg.max_connections,
        )
        if not plan.admit:
            where = conn.remote_address[0]
            message = "%s: refusing connection from %s (%s): %s"
            self._flood_log.log("refused", message, self.peer_id, conn.peer_id, where, plan.reason)
            conn.close()
            return False, None
        if plan.evict is None:
            return True, None
        victim = open_conns[plan.evict.key]
        where = victim.remote_address[0]
        logger.info("%s: closing idle connection to %s (%s): %s", self.peer_id, victim.peer_id, where, plan.reason)
        return True, victim

    def called(self, peer: PeerID) -> None:
        """We called this peer: from now on it is useful, and kept when room must be made."""
        self._called[peer] = None
        self._called.move_to_end(peer)
        if len(self._called) > CALLED_PEERS_PER_SLOT * self.config.max_connections:
            self._called.popitem(last=False)

    def _facts(self, key: int, conn: Connection) -> PeerFacts:
        return PeerFacts(
            key=key,
            source=source_of(conn.remote_address[0]),
            inbound=conn.role == hs.LISTENER,
            useful=conn.peer_id in self._called,
            ours_in_flight=conn.ours_in_flight,
            theirs_in_flight=conn.theirs_in_flight,
            idle_s=conn.idle_seconds,
        )
