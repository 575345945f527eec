"""The verdicts of an owner audit, flat or grid (audit/flat.py, audit/grid.py): what one owner's
receipt check found (`verdict_of`), and what a round's verdicts mean together (`judge`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from swarm.averaging.audit.arithmetic import SUSPECT
from swarm.averaging.errors import AuditError
from swarm.p2p.peer_id import PeerID

if TYPE_CHECKING:
    from swarm.averaging.messages import GroupInfo

logger = logging.getLogger(__name__)

OURS = "the receipt misstates our"  # check_receipt's problems that only this member can see
# an owner's answer when its own results are not final after the part timeout: a slow owner, not a
# liar (under a burst of load, honest owners said so while the round confirmed a dead owner's part).
# Its verdict is "silent", as for an owner that does not answer: nothing to convict it of
NOT_FINAL = "our results are not final"


class JudgedRound(Protocol):
    """What the verdicts read of a round, flat or grid: its group, and its tag in log lines."""

    group: GroupInfo

    def _tag(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Verdict:
    part: int
    owner: int  # the member whose receipt it is
    kind: str  # "ok" | "inconsistent" | "ours" | "seed" | "silent"
    detail: str = ""


def verdict_of(
    r: JudgedRound, part: int, owner: int, problems: list[str], failing: str = "inconsistent", unit: str = "part"
) -> Verdict:
    """The verdict on `owner` from check_receipt's problems: suspects are logged only; a
    problem of what the receipt says of us is "ours"; any other is `failing`."""
    suspect = [p for p in problems if p.startswith(SUSPECT)]
    if suspect:
        logger.warning("round %s: audit: owner %s of %s %d: %s", r._tag(), r.group.members[owner].peer_id, unit,
                       part, "; ".join(suspect))  # fmt: skip
    problems = [p for p in problems if not p.startswith(SUSPECT)]
    inconsistent = [p for p in problems if not p.startswith(OURS)]
    if inconsistent:
        return Verdict(part, owner, failing, "; ".join(inconsistent))
    if problems:
        return Verdict(part, owner, "ours", "; ".join(problems))
    return Verdict(part, owner, "ok")


def judge(r: JudgedRound, verdicts: list[Verdict], unit: str) -> list[PeerID]:
    """What a round's verdicts mean (`unit`: what Verdict.part numbers, for the log): AuditError
    naming the owners whose receipts do not hold, or without a name on a seed mismatch; else
    the owners excluded for what only we could see ("ours", and the grid's "row")."""
    members = r.group.members
    failed, mismatched, ours = [], [], []
    for v in verdicts:
        peer = members[v.owner].peer_id
        if v.kind == "silent":
            logger.info("round %s: audit: %s %d: owner %s did not answer: %s", r._tag(), unit, v.part, peer, v.detail)
        elif v.kind == "seed":
            mismatched.append(v)
        elif v.kind in ("inconsistent", "ours", "row"):
            logger.warning("round %s: audit: owner %s of %s %d: %s", r._tag(), peer, unit, v.part, v.detail)
            (failed if v.kind == "inconsistent" else ours).append(v)
    if failed:
        owners = sorted({members[v.owner].peer_id for v in failed}, key=str)
        details = "; ".join(f"owner {members[v.owner].peer_id} ({unit} {v.part}): {v.detail}" for v in failed)
        raise AuditError(f"audit: {details}", owners)
    if mismatched:
        who = ", ".join(str(members[v.owner].peer_id) for v in mismatched)
        logger.warning("round %s: audit: members %s hold other results than ours", r._tag(), who)
        raise AuditError(f"audit: members {who} hold other results than ours (somebody equivocated)", [])
    return sorted({members[v.owner].peer_id for v in ours}, key=str)
