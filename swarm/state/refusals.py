"""Refusals: the states and holders a node does not choose again, and for how long.

A manifest that did not fit the model (RefusedManifest) is never chosen again, nor is anything
its holders advertise next: a new bad manifest every step would otherwise pull honest nodes out
of every group. A holder that did not deliver a state (unreachable, gone, bad bytes) is not
chosen for that state again for UNDELIVERED_S: a killed peer's advertisement outlives it (up to
KeeperConfig.advertise_ttl), and a node chasing it would retry a dead address meanwhile instead
of taking the state the live peers hold. Each memory is bounded; past its bound it starts over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from swarm.p2p.peer_id import PeerID
from swarm.state.holders import Holder

logger = logging.getLogger("swarm.state.keeper")  # the keeper's: its log lines keep one name

MAX_REFUSED = 64  # refused manifests remembered, and peers that advertised them
UNDELIVERED_S = 60.0
MAX_UNDELIVERED = 4096


class Refusals:
    """What StateKeeper will not choose again (the module docstring)."""

    def __init__(self) -> None:
        self.manifests: set[str] = set()  # manifests that did not fit the model: never chosen again
        self._peers: set[PeerID] = set()  # peers that advertised one: nothing they advertise is considered
        self._undelivered: dict[tuple[PeerID, str], float] = {}  # (holder, manifest) -> when (monotonic)

    def refuse(self, sha: str, holders: Iterable[PeerID]) -> None:
        """Manifest `sha` did not fit the model; `holders` advertised it."""
        if len(self.manifests) >= MAX_REFUSED:
            self.manifests.clear()
        if len(self._peers) >= MAX_REFUSED:
            self._peers.clear()
        self.manifests.add(sha)
        self._peers.update(holders)

    def not_delivered(self, failed: frozenset[PeerID], sha: str) -> None:
        """The holders `failed` did not deliver state `sha`."""
        if failed:
            logger.info("not asking %d holder(s) for state %s again for %.0fs: they did not deliver it",
                        len(failed), sha[:12], UNDELIVERED_S)  # fmt: skip
        if len(self._undelivered) + len(failed) > MAX_UNDELIVERED:
            self._undelivered.clear()
        self._undelivered.update({(peer, sha): time.monotonic() for peer in failed})

    def delivered(self, holder: Holder, sha: str) -> bool:
        """Whether `holder` is not one that lately failed to deliver state `sha`."""
        return (holder.peer_id, sha) not in self._undelivered

    def keep(self, found: list[Holder], own: PeerID) -> list[Holder]:
        """The holders of `found` worth asking: not ourselves (`own`), not a refused peer, and
        not one that lately failed to deliver the state it advertises."""
        now = time.monotonic()
        self._undelivered = {key: t for key, t in self._undelivered.items() if now - t < UNDELIVERED_S}
        return [h for h in found if h.peer_id != own and h.peer_id not in self._peers
                and (h.peer_id, h.manifest) not in self._undelivered]  # fmt: skip
