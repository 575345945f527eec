"""The errors a round raises (rounds/flat.py re-exports AllReduceError)."""

from __future__ import annotations

from swarm.p2p.peer_id import PeerID


class AllReduceError(Exception):
    """The round cannot complete: too few contributions to a part, or a part nobody could reduce."""


class AuditError(AllReduceError):
    """The owner audit failed the round (audit/flat.py): `owners` broadcast something other
    than the reduction their receipts describe (empty: members hold different results, and the
    audit cannot say who equivocated)."""

    def __init__(self, message: str, owners: list[PeerID]) -> None:
        super().__init__(message)
        self.owners = owners
