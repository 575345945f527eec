"""Which lineage a node may adopt: pure, no I/O. A state's legitimacy comes from the signed
rounds that made it (receipts.py), never from how many identities advertise it.

A **lineage** is a chain of links, one per outer step, from an anchor: each link is one round's
receipt as the verifier sees it (parent state -> result state, the members with their weights,
the members whose signature checks out). A node's own lineage starts at the state it trusts
without a receipt: the run's genesis (the initial state every node of the run builds from the
run settings), or a checkpoint of its own written before it kept receipts.

**Endorsed links.** A link continues its parent round only when at least half of that round's
members, by count and by weight, signed it or a later link of the same chain (a member that
averages on from a state vouches for it as much as one that signed it). Identities that were not
members of a round back nothing after it, however many they are, and a minority of a round
cannot fork it. The link out of an anchor has no parent round here: any signed link is taken
(what a newcomer's anchor vouches for, and why a join names peers that hold the run's state).

**Fork choice (`judge`).** A node compares a candidate lineage with its own at the fork point F,
the newest state both hold. Each side's *support* is the set of members of the round that
produced F (the node's own round: members it saw averaging) that took part in that side after F:
on the node's own side the members of its own rounds (it was there), on the candidate's side
those whose signatures check out. A member found on both sides signed two histories and counts
for neither. A member of our rounds that signed none of them but signed the candidate's
(`moved_over`) is not on both sides: it ended up on the candidate's, and counts there only. That
happens to honest members: a round whose part owner died while answering ends with two results
(the members it had answered kept its result, the others took its backup's), and a member our
group listed can leave it for a group that formed beside ours. Counted for neither, each side saw
the other's members vanish and kept its own: a split of 20 + 7 inside one round of a 60-minute
soak stayed two lineages, and the node of a group of 3 that the other two left for a group of 2
refused their state for good ("0 ... against our 1"). Then:
1. a candidate that is not a lineage (links that do not chain, unsigned links, a result other
   than the state advertised) or does not descend from any state the node holds is refused;
2. every candidate link after F must be endorsed, except its newest one when the node holds a
   fork of its own after F: that link, signed by at least one member of its parent round, is
   still collecting the endorsements of the next round (a split of equal halves, a round of one).
   Nor need its first link be, when the node's own links after F hold fewer than half of F's
   round too and a member of that round signed it: the round split into minorities (2 + 2 + 1
   of 5), no side is endorsed, and rule 4 weighs them;
3. a node with no link after F (a newcomer, a node behind, one in sync that has not finished
   its step) adopts an endorsed candidate; so does a node that holds no round at all since its
   anchor, whether or not the candidate shares a state with it (a node started from another
   state has nothing of its own to keep);
4. otherwise the side with more support wins; on equal support, the side whose first state after
   F has the smaller hash (every node of a split takes the same one). A node in sync whose round
   held a majority of F's members is never moved: no other side can have as much support. A
   candidate that loses only because its newest round lacks signatures that its members are
   still exchanging (it would win were they all in) is pending, as in rule 2, not refused;
5. two forks of the node's anchor (genesis) have no round to weigh them by: the node keeps its
   own, unless one of its --initial-peers holds the candidate (the operator trusts them), or its
   own lineage is provisional and the candidate is newer: taken at the anchor from peers nobody
   vouched for (a newcomer that joined through a bare DHT node), or made by a node that joined a
   run and has averaged with nobody yet (a round with others ends it);
6. a client (it serves nothing) counts its own rounds of one as nothing: nobody can ever fetch
   the steps it took alone, so it follows the servers' lineage, even an older one.

What this does not stop: identities holding at least half of a round's members and weight can
fork it (and a fork of exactly half is settled by a hash); members of a round whose honest
members split into minorities by themselves weigh as much as an honest minority (rule 2's
exception), so as many of them as the largest honest part win by the hash; a lineage
fabricated from genesis by identities of their own (the link out of an anchor is taken from
anyone), which takes a newcomer none of whose initial peers holds the run's state, and keeps it
while they stay ahead. Honest nodes that split at the run's very first round and share no
initial peer that holds a state stay two lineages (nothing tells either side that the other is
honest).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from swarm.p2p.peer_id import PeerID
from swarm.state.receipts import Receipt
from swarm.utils.quorum import holds_half


@dataclass(frozen=True, slots=True)
class Link:
    """One round as a verifier sees it."""

    step: int  # the outer step the round averaged
    parent: bytes  # state_sha256 at `step`
    result: bytes  # state_sha256 at `step + 1`
    members: Mapping[PeerID, float]  # member -> the weight it announced
    signers: frozenset[PeerID]  # the members whose signature checks out

    @classmethod
    def of(cls, receipt: Receipt, signers: frozenset[PeerID]) -> Link:
        body = receipt.body
        return cls(body.step, body.parent, body.result, body.weight_of(), signers & frozenset(body.members))


@dataclass(frozen=True, slots=True)
class Lineage:
    """States from `anchor` (trusted without a receipt) through `links`, one per step."""

    anchor_step: int
    anchor: bytes  # state_sha256 at anchor_step
    links: tuple[Link, ...] = ()

    @property
    def step(self) -> int:
        return self.anchor_step + len(self.links)

    @property
    def state(self) -> bytes:
        return self.links[-1].result if self.links else self.anchor

    def state_at(self, step: int) -> bytes | None:
        if step == self.anchor_step:
            return self.anchor
        if self.anchor_step < step <= self.step:
            return self.links[step - self.anchor_step - 1].result
        return None

    def link_into(self, step: int) -> Link | None:
        """The link whose result is the state at `step` (None at the anchor or outside)."""
        return self.links[step - self.anchor_step - 1] if self.anchor_step < step <= self.step else None

    def after(self, step: int) -> tuple[Link, ...]:
        """The links from the state at `step` on."""
        return self.links[max(0, step - self.anchor_step) :]

    def round_mates(self, last: int) -> frozenset[PeerID]:
        """The signers of the last `last` rounds of two or more members: identities that averaged
        in this lineage (with this node, or with the peers whose lineage it took) and signed for
        it. Seniority is this, earned by rounds, not by how long an identity has sat in the DHT."""
        mates: set[PeerID] = set()
        for link in self.links[max(0, len(self.links) - last) :] if last > 0 else ():
            if len(link.members) >= 2:
                mates |= link.signers
        return frozenset(mates)

    def voters(self) -> frozenset[PeerID] | None:
        """The members of our last round of two or more: whose word counts in matchmaking's vote
        on the swarm's state (None: no such round here: everyone's counts)."""
        for link in reversed(self.links):
            if len(link.members) >= 2:
                return frozenset(link.members)
        return None


@dataclass(frozen=True, slots=True)
class Judgement:
    adopt: bool
    why: str
    fork_step: int | None = None
    # refused only because its newest round, signed by a member of the round before it, has not
    # collected the other members' signatures yet (seconds after the round): worth asking again soon
    pending: bool = False


def structure_problem(chain: Lineage, step: int, state: bytes) -> str | None:
    """Why `chain` is not a lineage of the state `state` at `step` (None: it is)."""
    if not chain.links:
        return "it has no round receipts"
    if chain.step != step or chain.state != state:
        return f"its receipts lead to another state (step {chain.step}) than the one advertised (step {step})"
    previous = chain.anchor
    for i, link in enumerate(chain.links):
        if link.step != chain.anchor_step + i or link.parent != previous:
            return f"its receipt of step {link.step} does not follow the one before it"
        if not link.signers:
            return f"its receipt of step {link.step} has no valid signature of a member"
        previous = link.result
    return None


def endorsed(parent_round: Link, endorsers: frozenset[PeerID]) -> bool:
    """Do `endorsers` hold at least half of `parent_round`'s members by count and by weight?"""
    return holds_half(parent_round.members, endorsers)


def fork_step(own: Lineage, candidate: Lineage) -> int | None:
    """The newest step at which both lineages hold the same state (None: none)."""
    low, high = max(own.anchor_step, candidate.anchor_step), min(own.step, candidate.step)
    for step in range(high, low - 1, -1):
        ours = own.state_at(step)
        if ours is not None and ours == candidate.state_at(step):
            return step
    return None


def judge(own: Lineage, candidate: Lineage, *, vouched: bool = False, provisional: bool = False,
          client: bool = False) -> Judgement:  # fmt: skip
    """Does the node holding `own` adopt the state at the end of `candidate` (whose structure
    `structure_problem` has passed)? The rules of the module docstring. `vouched`: one of the
    node's --initial-peers holds the candidate; `provisional`: the node's own lineage was taken
    at its anchor from peers no initial peer vouched for (rule 5); `client`: the node serves
    nothing (rule 6)."""
    fork = fork_step(own, candidate)
    if fork is None and not own.links:  # nothing computed with anyone since our anchor (rule 3)
        problem = _unendorsed(candidate.links, None, pending_ok=False)
        if problem is not None:
            return Judgement(False, problem, pending=_unendorsed(candidate.links, None, pending_ok=True) is None)
        return Judgement(True, f"an endorsed lineage (we hold no round since our state of step {own.step})")
    if fork is None:
        return Judgement(False, f"it does not descend from any state we hold (ours: step {own.step}, "
                                f"its receipts from step {candidate.anchor_step})")  # fmt: skip
    theirs, ours = candidate.after(fork), own.after(fork)
    if client and all(len(link.members) == 1 for link in ours):
        ours = ()  # rule 6: a client's rounds alone can never be fetched: they weigh nothing
    if not theirs:
        return Judgement(False, f"it is a state of our own lineage (step {candidate.step})", fork)
    fork_round = own.link_into(fork)  # None: the fork is at our anchor, whose round we do not know
    problem = _unendorsed(theirs, fork_round, pending_ok=bool(ours))
    if problem is not None and not _split_without_majority(theirs, ours, fork_round):
        return Judgement(False, problem, fork, pending=_unendorsed(theirs, fork_round, pending_ok=True) is None)
    if not ours:
        return Judgement(True, f"an endorsed continuation of our state of step {fork}", fork)
    if fork_round is None:  # two forks of an anchor (rule 5): no members to weigh them by
        if vouched:
            return Judgement(True, f"a fork of our anchor at step {fork}, held by one of our initial peers", fork)
        newer = provisional and candidate.step > own.step
        why = "newer than ours, which no initial peer vouched for" if newer else "we keep ours"
        return Judgement(newer, f"a fork of our anchor at step {fork}: {why}", fork)
    members = frozenset(fork_round.members)
    moved = moved_over(ours, theirs)
    our_side, their_side = _sides(members, ours, frozenset(p for link in theirs for p in link.signers), moved)
    told = (
        f"{len(their_side)} of the {len(members)} members of our round of step {fork - 1} against our {len(our_side)}"
    )
    if len(their_side) != len(our_side):
        adopt = len(their_side) > len(our_side)
        why = f"a fork at step {fork}: {told}"
    else:
        adopt = theirs[0].result < ours[0].result
        why = f"a fork at step {fork}: {told}, settled by the smaller hash"
    pending = not adopt and _wins_once_signed(theirs, ours, members, moved)
    return Judgement(adopt, why + (" (its newest round's signatures may still come)" if pending else ""), fork, pending)


def _wins_once_signed(
    theirs: Sequence[Link], ours: Sequence[Link], members: frozenset[PeerID], moved: frozenset[PeerID] = frozenset()
) -> bool:
    """Would the candidate's side win rule 4 once every member of its newest round has signed it?
    Its members read each other's signatures from the DHT over the seconds after the round, so a
    holder asked at once shows only its own: a fork's smaller half that asked right away counted 1
    of the larger half's 3 members, refused its state, and stayed a fork. The newest round must be
    signed by a member of the fork's round already, as rule 2's pending round must."""
    newest = theirs[-1]
    if not newest.signers & members:
        return False
    backers = frozenset(p for link in theirs[:-1] for p in link.signers) | frozenset(newest.members)
    our_side, their_side = _sides(members, ours, backers, moved)
    if len(their_side) != len(our_side):
        return len(their_side) > len(our_side)
    return theirs[0].result < ours[0].result


def _split_without_majority(theirs: Sequence[Link], ours: Sequence[Link], fork_round: Link | None) -> bool:
    """Rule 2's exception: no side holds a majority of the fork's round. Our links after the fork
    hold fewer than half of its members, the candidate's first link is signed by at least one of
    them, and its later links are endorsed. A small round whose members went separate ways (2 + 2
    + 1 of 5, seen on a loaded machine) would otherwise stay as many lineages for good, each
    refusing the others' first rounds; rule 4 weighs them instead."""
    if fork_round is None or not ours or not theirs[0].signers & frozenset(fork_round.members):
        return False
    if _unendorsed(theirs[1:], theirs[0], pending_ok=True) is not None:
        return False
    return not endorsed(fork_round, frozenset(p for link in ours for p in link.members))


def moved_over(ours: Sequence[Link], theirs: Sequence[Link]) -> frozenset[PeerID]:
    """The members of our links that signed none of them but signed a link of the candidate's:
    they ended up on its side (the module docstring, rule 4). A member that signed both sides is
    not among them: it signed two histories."""
    our_members = frozenset(p for link in ours for p in link.members)
    our_signers = frozenset(p for link in ours for p in link.signers)
    return (our_members & frozenset(p for link in theirs for p in link.signers)) - our_signers


def _sides(
    members: frozenset[PeerID], ours: Sequence[Link], theirs: frozenset[PeerID], moved: frozenset[PeerID] = frozenset()
) -> tuple[frozenset[PeerID], frozenset[PeerID]]:
    """Rule 4's support: the fork round's `members` in our links after the fork (we saw them
    average), less `moved` (moved_over: they signed none of ours and some of the candidate's),
    and those among `theirs` (the candidate's backers); one on both sides signed two histories
    and counts for neither."""
    our_side = (members & frozenset(p for link in ours for p in link.members)) - moved
    their_side = members & theirs
    twice = our_side & their_side
    return our_side - twice, their_side - twice


def _unendorsed(links: Sequence[Link], fork_round: Link | None, *, pending_ok: bool) -> str | None:
    """Why some link of `links` (from the fork on) is not endorsed by its parent round (None:
    all are). `pending_ok`: the newest may still be collecting its endorsements (judge, rule 2)."""
    later: set[PeerID] = set()
    signed_from: list[frozenset[PeerID]] = []  # signers of links[i:] for each i
    for link in reversed(links):
        later |= link.signers
        signed_from.append(frozenset(later))
    signed_from.reverse()
    for i, link in enumerate(links):
        parent_round = fork_round if i == 0 else links[i - 1]
        if parent_round is None or endorsed(parent_round, signed_from[i]):
            continue
        if pending_ok and i == len(links) - 1 and link.signers & frozenset(parent_round.members):
            continue
        count = sum(1 for p in parent_round.members if p in signed_from[i])
        return (f"its round of step {link.step} is endorsed by {count} of the {len(parent_round.members)} "
                "members of the round before it (at least half are needed)")  # fmt: skip
    return None
