"""ConnectionPool: a host's authenticated connections, by peer, and the choice among them.

Most peers have one connection. A peer may briefly have two when both sides dial each other at
once; then both sides prefer the one dialed by the smaller PeerID (the other idles out), and a
relayed connection only when no direct one is open. The pool also tells its watchers of each
connection it keeps, and gives the sockets of a peer's connections to the pacing calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from swarm.p2p import handshake as hs
from swarm.p2p.circuit import is_relayed
from swarm.p2p.connection import Connection
from swarm.p2p.peer_id import PeerID


class ConnectionPool:
    """The connections one host keeps (`peer_id` is the host's own: it decides which of two
    connections to one peer both sides use)."""

    def __init__(self, peer_id: PeerID) -> None:
        self.peer_id = peer_id
        self.by_peer: dict[PeerID, list[Connection]] = {}
        self._watchers: list[Callable[[Connection], None]] = []  # told of each connection kept

    def adopt(self, conn: Connection) -> None:
        """Keep an authenticated connection (not one closed meanwhile) until it closes."""
        if conn.closed:
            return
        self.by_peer.setdefault(conn.peer_id, []).append(conn)
        conn.on_closed = self.forget
        for watcher in list(self._watchers):
            watcher(conn)

    def forget(self, conn: Connection) -> None:
        group = self.by_peer.get(conn.peer_id)
        if group and conn in group:
            group.remove(conn)
            if not group:
                del self.by_peer[conn.peer_id]

    def watch(self, watcher: Callable[[Connection], None], *, stop: bool = False) -> None:
        """Call `watcher` with every connection kept from now on (stop=True: no more)."""
        if stop:
            self._watchers = [w for w in self._watchers if w != watcher]
        elif watcher not in self._watchers:
            self._watchers.append(watcher)

    def all(self) -> list[Connection]:
        """Every connection kept, open or closing."""
        return [c for group in self.by_peer.values() for c in group]

    def open(self) -> list[Connection]:
        return [c for c in self.all() if not c.protocol.closed]

    def peers(self) -> list[PeerID]:
        return [peer for peer, conns in self.by_peer.items() if conns]

    def to(self, peer: PeerID) -> list[Connection]:
        """The open connections to `peer`, direct and relayed."""
        return [c for c in self.by_peer.get(peer, ()) if not c.protocol.closed]

    def best(self, peer: PeerID) -> Connection | None:
        """The connection to use for `peer` (the module docstring), or None."""
        group = self.by_peer.get(peer)
        if not group:
            return None
        if len(group) == 1:  # the common case, on every call
            return None if group[0].protocol.closed else group[0]
        group = [c for c in group if not c.protocol.closed]
        group = [c for c in group if not is_relayed(c.remote_address)] or group  # a relay only when nothing else
        if not group:
            return None
        preferred_role = hs.DIALER if self.peer_id < peer else hs.LISTENER
        return next((c for c in group if c.role == preferred_role), group[0])

    def sockets(self, peer: PeerID) -> list[Any]:
        """The sockets of the open direct connections to `peer` (a relayed one has none of its own)."""
        found = []
        for conn in self.by_peer.get(peer, ()):
            transport = conn.protocol.transport
            sock = transport.get_extra_info("socket") if transport is not None and not conn.protocol.closed else None
            if sock is not None:
                found.append(sock)
        return found

    def clear(self) -> None:
        self.by_peer.clear()

    def __len__(self) -> int:
        return len(self.by_peer)
