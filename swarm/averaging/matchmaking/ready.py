"""Who is ready for an outer step, and what one node does about it: pure, no I/O.

Matchmaking (matchmaking/matchmaker.py) reads `<run>/ready/<N>` into a ReadyView and hands it to `decide`,
which every node evaluates on its own view. The rules, in order:

1. **Late.** Someone already formed a group from our state at this step (a FORMED marker that
   names our state): this step's average is being computed without us. We take no part; the
   node fetches the result (one swarm, one state: a second group of the same state would apply
   a different update).
2. **The swarm's state.** Among the members in view (ready or formed), the state held by the
   most of them is the swarm's (ties: the smaller hash, so every node picks the same one). A
   member of another state does not average: it fetches the swarm's state first. Only members
   count: a node that averaged in a round of two or more counts the members of that round (its
   `voters`, from its lineage: state/lineage.py) and itself, so identities that never averaged
   with it cannot make another state the swarm's, however many they are; a node with no such
   round yet (a newcomer) counts everyone in view. Whatever the vote, a node adopts another state
   only when its lineage allows (state/lineage.py): the vote says whom to try, not whom to believe.
3. **One group.** Every ready member of the swarm's state is in the one group, in an order
   fixed by a hash of (step, PeerID); its leader is the first member that accepts inbound
   connections (a client cannot lead). No server in view: no group. Nor when every member
   contributes nothing (all weights 0: nodes that only joined to take the average): such a
   group would apply a null step and, by rule 1, make the node that trained wait for it. A
   leader finalizes its group only when it holds at least half of the round that made its
   state, or that round's other members are not around (`left_behind`): a lineage takes no
   round that fewer than half of the round before it sign, so its other members would go on
   apart.
4. **One lineage.** Should two groups still form at one step (a fork), the one with the most
   FORMED markers that count is the swarm's lineage (`outvoted`): a member of another checks
   its last rounds' steps before each matchmaking and fetches the swarm's state instead.

Announcements are bounded, so that cheap identities cannot outvote the run: one per identity
(its owner's subkey), and one whose weight exceeds what the run allows one step is skipped
(`decode_view`), so it is neither counted nor waited for nor grouped. A member refuses a group
that misstates its own announcement or lists an out-of-range weight (`group_problem`).

Identities are priced: an announcement or FORMED marker counts only with its owner's proof of a
costly DHT id (dht/id_proof.py: the nonce its DHT node proves itself with, 2^id_bits hashes to
find, two to check). Without it, a flood of throwaway identities announcing another state would
outvote the swarm (rule 2: every honest node would look for a state nobody serves), and fake
members would take the leader's place or hold the majority a leader needs (may_finalize).

Identities must also be alive (matchmaking/liveness.py): the matchmaker marks the owners that have not
answered it `unverified`, and those neither vote for the swarm's state (rule 2), nor lead (rule
3), nor count as announced for a leader's majority (`may_finalize`), nor make anyone late (rule
1). They may still join a group: a leader groups whoever actually joins it.

    ready value:   {"member": MemberInfo.encode(), "proof": nonce, "settings": digest}  ("I am ready")
    FORMED marker: {"formed": state, "group": id, "proof": nonce, "settings": digest,
                    "member": MemberInfo.encode()}  (done: in a group of that state; "member"
                   says where to ask whether its owner is alive)
    DONE marker:   "done"   (done without a group: do not count me)

A record counts only for nodes of the same run settings (`settings`: model/run_settings.py's
digest of H, schedule, model, ...): nodes of other settings never group, and their states are
not "the swarm's" (a node does not try to fetch them).
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Mapping, Set
from dataclasses import dataclass, field, replace
from typing import Any

from swarm.averaging.messages import GroupInfo, MemberInfo
from swarm.dht.errors import RecordError
from swarm.dht.id_proof import BadIdProof, verify
from swarm.dht.records import owner_of
from swarm.p2p.errors import BadRequest
from swarm.p2p.peer_id import PeerID
from swarm.utils.quorum import holds_half

DONE = "done"


def announcement(member: MemberInfo, proof: bytes, settings: bytes = b"") -> dict[str, Any]:
    return {"member": member.encode(), "proof": proof, "settings": settings}


def formed_marker(
    state: bytes, group_id: bytes, proof: bytes, settings: bytes = b"", member: MemberInfo | None = None
) -> dict[str, Any]:
    marker: dict[str, Any] = {"formed": state, "group": group_id, "proof": proof, "settings": settings}
    if member is not None:
        marker["member"] = member.encode()
    return marker


@dataclass(frozen=True, slots=True)
class ReadyView:
    """What one read of `<run>/ready/<N>` showed."""

    ready: dict[PeerID, MemberInfo] = field(default_factory=dict)  # announced, not yet done
    formed: dict[PeerID, bytes] = field(default_factory=dict)  # done, in a group: the state it averaged
    done: frozenset[PeerID] = frozenset()  # done without a group
    refused: frozenset[PeerID] = frozenset()  # announced something we do not accept (decode_view)
    formers: dict[PeerID, MemberInfo] = field(default_factory=dict)  # where a FORMED marker's owner is
    groups: dict[PeerID, bytes] = field(default_factory=dict)  # the group id a FORMED marker names
    # owners (ready or formed) that have not proven they are alive (matchmaking/liveness.py): not counted
    unverified: frozenset[PeerID] = frozenset()

    def seen(self) -> set[PeerID]:
        """Who has shown up: nobody waits any longer for these (a refused announcement too)."""
        return set(self.ready) | set(self.formed) | set(self.done) | set(self.refused)

    def with_member(self, me: MemberInfo) -> ReadyView:
        return replace(self, ready={**self.ready, me.peer_id: me}, unverified=self.unverified - {me.peer_id})

    def counted_ready(self) -> dict[PeerID, MemberInfo]:
        """The ready members that count (alive, when liveness is checked)."""
        return {p: m for p, m in self.ready.items() if p not in self.unverified}

    def counted_formed(self) -> dict[PeerID, bytes]:
        """The FORMED markers that count (of owners alive, when liveness is checked)."""
        return {p: s for p, s in self.formed.items() if p not in self.unverified}


def decode_view(
    entries: dict[Any, Any], max_weight: float = math.inf, id_bits: int | None = None, settings: bytes = b""
) -> tuple[ReadyView, list[Skipped]]:
    """A view from the raw subkey -> value map; also each entry skipped, with its owner when
    known (peers' records are untrusted: a malformed one is skipped, never raised on). An
    announcement of a weight above `max_weight` (what the run allows one step) is skipped: that
    member is not counted, not waited for and not grouped with. With `id_bits`, so is an
    announcement or FORMED marker whose owner's proof of a costly id does not check out (None:
    proofs are not checked, for tests of the rules alone). With `settings` (the digest of our run
    settings), so is a record of other settings: a node of another schedule, H or model is not
    of this swarm, whatever state it holds (b"": not checked)."""
    ready: dict[PeerID, MemberInfo] = {}
    formed: dict[PeerID, bytes] = {}
    formers: dict[PeerID, MemberInfo] = {}
    groups: dict[PeerID, bytes] = {}
    done: set[PeerID] = set()
    skipped = []
    for subkey, value in entries.items():
        try:
            owner = owner_of(subkey)
        except RecordError:
            owner = None
        if owner is None:
            skipped.append(Skipped(None, "an announcement not under an owner's subkey"))
            continue
        if value == DONE:
            done.add(owner)
            continue
        if not isinstance(value, dict):
            skipped.append(Skipped(owner, "a malformed ready record"))
            continue
        if id_bits is not None:
            try:
                verify(owner, value.get("proof"), id_bits)
            except BadIdProof as e:
                skipped.append(Skipped(owner, f"a ready record without a proof of a costly id ({e})"))
                continue
        if settings and value.get("settings") != settings:
            skipped.append(Skipped(owner, "a ready record of other run settings"))
            continue
        if "formed" in value:
            state = value.get("formed")
            if not isinstance(state, bytes) or len(state) not in (0, 32):
                skipped.append(Skipped(owner, "a malformed FORMED marker"))
                continue
            formed[owner] = state
            group_id = value.get("group")
            if isinstance(group_id, bytes) and len(group_id) == 32:  # GroupInfo.make_id: a sha256
                groups[owner] = group_id
            if "member" in value:
                try:
                    former = MemberInfo.decode(value["member"])
                except (BadRequest, ValueError):
                    former = None
                if former is not None and former.peer_id == owner:
                    formers[owner] = former
            continue
        try:
            member = MemberInfo.decode(value.get("member"))
        except (BadRequest, ValueError) as e:
            skipped.append(Skipped(owner, f"a bad announcement: {e}"))
            continue
        if member.peer_id != owner:
            skipped.append(Skipped(owner, "an announcement not under its owner's subkey"))
            continue
        if member.weight > max_weight:
            why = f"an announced weight of {member.weight:.4g} above the run's {max_weight:.4g}"
            skipped.append(Skipped(owner, why))
            continue
        ready[owner] = member
    refused = frozenset(item.owner for item in skipped if item.owner is not None) - set(ready)
    return ReadyView(ready, formed, frozenset(done), refused, formers, groups), skipped


@dataclass(frozen=True, slots=True)
class Skipped:
    """An entry of the ready set that was not used, and why."""

    owner: PeerID | None  # None: no owner could be read from its subkey
    reason: str


@dataclass(frozen=True, slots=True)
class Decision:
    """What `decide` tells one node. kind: "lead" | "join" | "alone" | "other_state" | "late"."""

    kind: str
    members: tuple[MemberInfo, ...] = ()  # the group as this node sees it (lead, join)
    leader: MemberInfo | None = None  # join
    swarm_state: bytes = b""  # the state of the swarm at this step (always set)


def swarm_state(view: ReadyView, voters: frozenset[PeerID] | None = None) -> bytes | None:
    """The state most members in view start from (ties: the smaller hash); None: nobody.
    Unverified owners do not vote; with `voters`, only they do (rule 2)."""
    votes = Counter(m.state for p, m in view.counted_ready().items() if voters is None or p in voters)
    votes.update(s for p, s in view.counted_formed().items() if voters is None or p in voters)
    if not votes:
        return None
    return min(votes, key=lambda s: (-votes[s], s))


def formed_by(view: ReadyView, state: bytes) -> frozenset[PeerID]:
    """The owners of the counted FORMED markers that name `state`."""
    return frozenset(p for p, s in view.counted_formed().items() if s == state)


def group_order(peers: list[PeerID], step: int) -> list[PeerID]:
    """A hash of (step, PeerID) orders the group: the leader changes from step to step."""
    return sorted(set(peers), key=lambda p: hashlib.sha256(step.to_bytes(8, "big") + p.to_bytes()).digest())


def decide(view: ReadyView, me: MemberInfo, step: int, voters: frozenset[PeerID] | None = None) -> Decision:
    """This node's part in step `step`, by the rules in the module docstring. `view` need not
    contain `me`: it is added. `voters`: the members of our last round (rule 2), None: all."""
    view = view.with_member(me)
    if me.state in view.counted_formed().values():
        return Decision("late", swarm_state=me.state)
    chosen = swarm_state(view, None if voters is None else voters | {me.peer_id})
    assert chosen is not None  # we are in the view
    if chosen != me.state:
        return Decision("other_state", swarm_state=chosen)
    order = group_order([p for p, m in view.ready.items() if m.state == chosen], step)
    members = tuple(view.ready[p] for p in order)
    leader = next((m for m in members if not m.client and m.peer_id not in view.unverified), None)
    if leader is None or not any(m.weight > 0 for m in members):
        return Decision("alone", members, swarm_state=chosen)
    if leader.peer_id == me.peer_id:
        return Decision("lead", members, swarm_state=chosen)
    return Decision("join", members, leader, swarm_state=chosen)


def other_groups(view: ReadyView, group_id: bytes) -> bool:
    """Does any FORMED marker in view name a group of this step other than `group_id`? (Cheap:
    only then are its owners' liveness checks worth asking for `outvoted`.)"""
    return any(g != group_id for p, g in view.groups.items() if p in view.formed)


def outvoted(
    view: ReadyView, group_id: bytes, me: PeerID, state: bytes, voters: frozenset[PeerID] | None = None
) -> bytes | None:
    """The group of this step that outvotes ours (`group_id`, which `me` was in, from `state`),
    or None. Two groups formed at one step go on as two lineages, and the smaller one, when
    faster, decides each later step before the larger one's announcements are in: it never sees
    that it is outvoted (rule 2). The FORMED markers of the step remain; they say which state
    each group started from:
    - a group of **another state** is another lineage (a network split, a fork some steps back):
      the one with more markers that count (alive, proven: as rule 2's votes; ties: the smaller
      id) is the one to try, and the lineage (state/lineage.py) decides whether its state is
      taken, by the members of the round where the two forked;
    - a group of **our state** is a second group of one step (two leaders that each counted a
      majority under load or on the views of a DHT just healed from a split, or a late node that
      computed the step again after its group's members had left). It is weighed as the lineage
      weighs it: by `voters`, the members of the round that made our state (a group of three
      newcomers that fetched the state is outweighed by the pair whose round made it). On a tie
      among voters every tied group counts as outvoted: each side asks for the other's state,
      and the lineage's rule (the smaller hash) settles which side takes it. Without voters (no
      round of two before ours) or none of them in view, every marker that counts counts, and a
      tie goes to the smaller id."""
    counted = view.counted_formed()  # owner -> the state its group started from
    owners = {p: g for p, g in view.groups.items() if p in counted and p != me} | {me: group_id}
    sizes = Counter(owners.values())
    others = {g for p, g in owners.items() if p != me and counted[p] != state}
    rival = min(others, key=lambda g: (-sizes[g], g), default=None)
    if rival is not None and (sizes[rival], group_id) > (sizes[group_id], rival):
        return rival
    same = {p: g for p, g in owners.items() if p == me or counted[p] == state}
    weighed = by_voters(same, me, voters)
    if weighed:
        assert voters is not None
        same = {p: g for p, g in same.items() if p in voters}
    votes = Counter(same.values())
    votes[group_id] += 0
    best = max(votes.values())
    top = sorted(g for g, n in votes.items() if n == best)
    if weighed and group_id in top and len(top) > 1:
        return next(g for g in top if g != group_id)  # a tie: the lineage's rule settles it
    return None if top[0] == group_id else top[0]


def by_voters(owners: dict[PeerID, bytes], me: PeerID, voters: frozenset[PeerID] | None) -> bool:
    """Are these FORMED markers' owners (of our state) counted by `voters` only (outvoted)?
    When `me` is a voter or some other voter's marker counts."""
    return voters is not None and any(p in voters for p in owners)


def group_sizes(view: ReadyView, group_id: bytes, me: PeerID) -> Counter[bytes]:
    """group id -> the FORMED markers that count naming it; `me` counts in ours (`group_id`)
    whether or not its marker is in view."""
    counted = view.counted_formed()
    sizes = Counter(g for p, g in view.groups.items() if p in counted and p != me)
    sizes[group_id] += 1
    return sizes


def may_finalize(group_size: int, final_view: ReadyView, state: bytes) -> bool:
    """May a leader finalize a group of `group_size` (itself included) of `state`? Not when a
    group of this state has formed meanwhile elsewhere (a second group would fork the model),
    and not with fewer than half of the members of this state still announced: then the
    leader is the late one, seeing announcements the others have not withdrawn yet."""
    if state in final_view.counted_formed().values():
        return False
    announced = sum(1 for m in final_view.counted_ready().values() if m.state == state)
    return 2 * group_size > announced


def left_behind(members: Set[PeerID], parent_round: Mapping[PeerID, float] | None,
                around: Set[PeerID]) -> frozenset[PeerID]:  # fmt: skip
    """The members of the round that made our state (`parent_round`, member -> weight; None: not
    known) that a group of `members` would leave behind although they are `around` (live, or in
    the step's ready set), when the group holds less than half of that round by count or by
    weight. Such a group makes a round that those members never take (its lineage is not
    endorsed), and they go on from the state apart: a fork. Empty: the group may form. A soak
    node paused past its leader's join timeout came back, led again with the two peers that had
    just fetched the state, and made a round of 3 that held 1 of the 4 members of the round
    before it; the other three, live and late for the first try, refused it and averaged the
    step as a pair. Members of that round that are not around (died, stalled) do not hold a
    group back: waiting for a majority that died would stop the run for good, and their rounds
    are not endorsed either way."""
    if parent_round is None or holds_half(parent_round, members):
        return frozenset()
    return frozenset(set(parent_round) - set(members)) & frozenset(around)


def group_problem(group: GroupInfo, me: MemberInfo, run_id: str, step: int, max_weight: float) -> str | None:
    """Why a member refuses the group its leader sent (None: it takes it). The id already binds
    every member's announced numbers (messages.py); a member checks its own entry against what it
    announced, so a leader that rewrites a member's weight, bandwidth or client flag loses that
    member, and every member checks that no weight exceeds what the run allows one step."""
    if group.run_id != run_id or group.step != step:
        return f"of run {group.run_id!r} step {group.step}, not {run_id!r} step {step}"
    try:
        mine = group.members[group.index_of(me.peer_id)]
    except KeyError:
        return "we are not in it"
    if mine != me:
        return "it misstates our own announcement"
    heavy = [m for m in group.members if m.weight > max_weight]
    if heavy:
        return f"it lists a weight of {heavy[0].weight:.4g}, above the run's {max_weight:.4g}"
    return None
