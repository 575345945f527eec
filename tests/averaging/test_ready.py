"""The matchmaking decision (swarm/averaging/matchmaking/ready.py) on a table of views: pure, no I/O."""

from __future__ import annotations

import pytest

from swarm.averaging.matchmaking.ready import (
    DONE,
    Decision,
    ReadyView,
    announcement,
    decide,
    decode_view,
    formed_marker,
    group_order,
    left_behind,
    may_finalize,
    other_groups,
    outvoted,
)
from swarm.averaging.messages import MemberInfo
from swarm.dht.id_proof import BadIdProof, solve, verify
from swarm.dht.records import owner_subkey
from swarm.p2p.identity import Identity
from swarm.p2p.peer_id import PeerID

IDS = [Identity.generate().peer_id for _ in range(6)]
A, B = bytes(32), b"\x01" * 32  # two states


def member(i: int, state: bytes = A, client: bool = False, weight: float = 1.0) -> MemberInfo:
    maddrs = () if client else (f"/ip4/127.0.0.1/tcp/{4000 + i}",)
    return MemberInfo(IDS[i], maddrs, weight, 0.0 if client else 100.0, client, state)


def view(
    *members: MemberInfo, formed: dict[int, bytes] | None = None, done: tuple[int, ...] = (), dead: tuple[int, ...] = ()
) -> ReadyView:
    """`dead`: owners that did not prove they are alive (matchmaking/liveness.py)."""
    return ReadyView({m.peer_id: m for m in members}, {IDS[i]: s for i, s in (formed or {}).items()},
                     frozenset(IDS[i] for i in done), unverified=frozenset(IDS[i] for i in dead))  # fmt: skip


def leader_of(ids: list[int], step: int = 0) -> int:
    return IDS.index(group_order([IDS[i] for i in ids], step)[0])


CASES = [
    # (what, view, me, expected kind)
    ("alone in the swarm", view(), member(0), "lead"),
    ("everyone of one state: one group", view(*(member(i) for i in range(1, 6))), member(0), None),
    ("a group of our state formed: late", view(member(1), formed={2: A}), member(0), "late"),
    ("the majority holds another state", view(member(1, B), member(2, B)), member(0), "other_state"),
    ("a tie between states: the smaller hash", view(member(1, B)), member(0, A), None),
    ("a tie, from the larger hash", view(member(1, A)), member(0, B), "other_state"),
    ("formed members vote for their state", view(member(1), formed={2: B, 3: B, 4: B}), member(0), "other_state"),
    ("only clients: nobody can lead", view(member(1, client=True)), member(0, client=True), "alone"),
    ("nobody contributes: no null step", view(member(1, weight=0.0)), member(0, weight=0.0), "alone"),
    ("alone with nothing to contribute", view(), member(0, weight=0.0), "alone"),
    ("one contributor is enough", view(member(1, weight=0.0)), member(0), None),
    ("done markers are not counted", view(member(1, B), done=(2, 3)), member(0, A), None),
    # owners that did not answer a liveness check neither vote, nor lead, nor make anyone late
    (
        "a dead majority of another state does not vote",
        view(member(1, B), member(2, B), dead=(1, 2)),
        member(0),
        "lead",
    ),
    ("a dead owner's FORMED marker of our state: not late", view(member(1), formed={2: A}, dead=(2,)), member(0), None),
    ("a live owner's FORMED marker of our state: late", view(member(1), formed={2: A}, dead=(1,)), member(0), "late"),
    (
        "dead servers cannot lead",
        view(*(member(i) for i in range(1, 6)), dead=(1, 2, 3, 4, 5)),
        member(0, client=True),
        "alone",
    ),
]


@pytest.mark.parametrize(("what", "seen", "me", "kind"), CASES, ids=[c[0] for c in CASES])
def test_decide(what: str, seen: ReadyView, me: MemberInfo, kind: str | None) -> None:
    decision = decide(seen, me, 0)
    if kind is None:  # lead or join: the one group of everyone of the swarm's state
        everyone = [i for i in range(6) if IDS[i] in {*seen.ready, me.peer_id}]
        state = min(m.state for m in [*seen.ready.values(), me])
        everyone = [i for i in everyone if (seen.ready.get(IDS[i]) or me).state == state]
        leader = leader_of([i for i in everyone if IDS[i] not in seen.unverified])
        assert decision.kind == ("lead" if IDS[leader] == me.peer_id else "join")
        assert {m.peer_id for m in decision.members} == {IDS[i] for i in everyone}
        assert decision.kind == "lead" or (decision.leader is not None and decision.leader.peer_id == IDS[leader])
    else:
        assert decision.kind == kind


def test_every_node_of_a_state_sees_the_same_group_and_leader() -> None:
    members = [member(i) for i in range(6)]
    decisions = [decide(view(*members), m, 3) for m in members]
    assert len({d.members for d in decisions}) == 1
    assert sum(d.kind == "lead" for d in decisions) == 1
    leaders = {d.leader for d in decisions if d.kind == "join"}
    assert leaders == {next(d for d in decisions if d.kind == "lead").members[0]} or len(leaders) == 1


def test_a_client_never_leads() -> None:
    members = [member(i, client=i != 5) for i in range(6)]
    decisions = [decide(view(*members), m, 0) for m in members]
    assert [d.kind for d in decisions] == ["join"] * 5 + ["lead"]


@pytest.mark.parametrize(
    ("size", "final", "ok"),
    [
        (3, view(member(0), member(1), member(2)), True),
        (3, view(member(0), member(1), member(2), member(3)), True),  # one died after announcing
        (2, view(member(0), member(1), member(2), member(3)), False),  # half: we may be the late ones
        (3, view(member(0), member(1), member(2), formed={4: A}), False),  # a group of our state formed
        (3, view(member(0), member(1), member(2), formed={4: B}), True),
        # announced members that never answered do not count: 16 fakes cannot block every leader
        (2, view(member(0), member(1), member(2), member(3), member(4), dead=(2, 3, 4)), True),
        (3, view(member(0), member(1), member(2), formed={4: A}, dead=(4,)), True),  # a dead owner's marker
    ],
)
def test_a_leader_finalizes_only_a_majority_and_only_one_group(size: int, final: ReadyView, ok: bool) -> None:
    assert may_finalize(size, final, A) is ok


def ids(*indices: int) -> frozenset[PeerID]:
    return frozenset(IDS[i] for i in indices)


ROUND_OF_4 = {IDS[i]: 1.0 for i in (0, 1, 2, 3)}  # the round that made our state


@pytest.mark.parametrize(
    ("what", "members", "parent_round", "around", "behind"),
    [
        ("the whole round", ids(0, 1, 2, 3), ROUND_OF_4, ids(0, 1, 2, 3), ()),
        ("half of it, the rest live", ids(0, 1, 4, 5), ROUND_OF_4, ids(2, 3), ()),
        # a paused leader came back and led the two that had just fetched the state while three
        # members of the round before were live: their round would never be taken by those three
        ("one of four and two newcomers", ids(0, 4, 5), ROUND_OF_4, ids(1, 2, 3, 4, 5), (1, 2, 3)),
        ("one of four, one other live", ids(0, 4, 5), ROUND_OF_4, ids(3), (3,)),
        ("one of four, the others dead or stalled", ids(0, 4, 5), ROUND_OF_4, ids(4, 5), ()),
        ("no round known (a state taken without its receipts)", ids(0, 4), None, ids(1, 2, 3), ()),
        ("a round of one: its member is in", ids(0, 4), {IDS[0]: 1.0}, ids(1), ()),
        ("half the members, not half the weight", ids(0, 1), {**ROUND_OF_4, IDS[3]: 5.0}, ids(2, 3), (2, 3)),
        ("half the weight, not half the members", ids(3), {**ROUND_OF_4, IDS[3]: 5.0}, ids(0, 1, 2), (0, 1, 2)),
    ],
)
def test_a_leader_never_leaves_behind_most_of_the_round_that_made_its_state(
    what: str, members: frozenset[PeerID], parent_round: dict[PeerID, float] | None, around: frozenset[PeerID],
    behind: tuple[int, ...],
) -> None:  # fmt: skip
    assert left_behind(members, parent_round, around) == ids(*behind), what


G1, G2, G3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32  # group ids, in id order


def formed_groups(
    groups: dict[int, bytes], state: dict[int, bytes] | None = None, dead: tuple[int, ...] = ()
) -> ReadyView:
    """FORMED markers naming these groups (owner index -> group id), of state A unless `state` says."""
    state = state or {}
    return ReadyView(formed={IDS[i]: state.get(i, A) for i in groups}, groups={IDS[i]: g for i, g in groups.items()},
                     unverified=frozenset(IDS[i] for i in dead))  # fmt: skip


@pytest.mark.parametrize(
    ("what", "seen", "me", "ours", "winner", "voters"),
    [
        ("one group: nothing to heal", formed_groups({0: G2, 1: G2, 2: G2}), 0, G2, None, None),
        ("ours larger", formed_groups({0: G2, 1: G2, 2: G2, 3: G1, 4: G1}), 0, G2, None, None),
        ("ours smaller", formed_groups({0: G2, 1: G2, 2: G2, 3: G1, 4: G1}), 3, G1, G2, None),
        ("two states: the lineage of the other state", formed_groups({0: G1, 1: G2, 2: G2}, {0: B}), 0, G1, G2, None),
        ("a tie: the smaller id is the swarm's", formed_groups({0: G1, 1: G1, 2: G2, 3: G2}), 2, G2, G1, None),
        ("a tie seen from the smaller id", formed_groups({0: G1, 1: G1, 2: G2, 3: G2}), 0, G1, None, None),
        # owners that did not prove they are alive do not count: the lone survivor of a group of
        # 4 (three killed) takes the state of the 2 that computed the step again
        ("dead members", formed_groups({0: G1, 1: G1, 2: G1, 3: G1, 4: G2, 5: G2}, dead=(1, 2, 3)), 0, G1, G2, None),
        ("a larger group, dead", formed_groups({0: G1, 1: G2, 2: G2, 3: G2}, dead=(1, 2, 3)), 0, G1, None, None),
        ("our marker not stored yet: we count", formed_groups({1: G1, 2: G2}), 0, G1, None, None),
        ("three groups", formed_groups({0: G3, 1: G1, 2: G2, 3: G2}), 0, G3, G2, None),
        # counted by the members of the round before (voters), as the lineage weighs a fork: a
        # group of 3 that fetched the state, beside the pair whose round made it, is outvoted
        ("voters: the pair that made the state", formed_groups({0: G1, 1: G1, 2: G2, 3: G2, 4: G2}), 2, G2, G1, (0, 1)),
        ("voters: seen from the pair", formed_groups({0: G1, 1: G1, 2: G2, 3: G2, 4: G2}), 0, G1, None, (0, 1)),
        ("voters: a dead voter does not count", formed_groups({0: G1, 1: G2, 2: G2}, dead=(0,)), 1, G2, None, (0, 1)),
        ("voters: none in view, everyone counts", formed_groups({2: G1, 3: G2, 4: G2}), 2, G1, G2, (0, 1)),
        ("voters: a tie, each side asks for the other's", formed_groups({0: G1, 1: G2, 2: G1}), 1, G2, G1, (0, 1)),
        ("voters: a tie, from the smaller id too", formed_groups({0: G1, 1: G2, 2: G2}), 0, G1, G2, (0, 1)),
        (
            "voters: another state's larger group is tried, voters or not",
            formed_groups({0: G1, 1: G1, 2: G2, 3: G2, 4: G2}, {2: B, 3: B, 4: B}),
            0,
            G1,
            G2,
            (0, 1),
        ),
        ("voters: another state's smaller group is not", formed_groups({0: G1, 1: G1, 2: G2}, {2: B}), 2, G2, G1, (2,)),
        ("voters: we are one, alone against two", formed_groups({0: G1, 1: G2, 2: G2}), 0, G1, G2, (0, 1, 2)),
    ],
)
def test_a_fork_s_smaller_lineage_is_outvoted(
    what: str, seen: ReadyView, me: int, ours: bytes, winner: bytes | None, voters: tuple[int, ...] | None
) -> None:
    counted_by = None if voters is None else frozenset(IDS[i] for i in voters)
    state = seen.formed.get(IDS[me], A)  # the state our group started from
    assert outvoted(seen, ours, IDS[me], state, counted_by) == winner, what
    assert other_groups(seen, ours) is (len(set(seen.groups.values()) - {ours}) > 0)


def test_decode_view_skips_bad_records() -> None:
    entries = {
        owner_subkey(IDS[0]): announcement(member(0), b""),
        owner_subkey(IDS[1]): announcement(member(2), b""),  # under another's subkey
        owner_subkey(IDS[2]): formed_marker(A, G1, b"", member=member(2)),  # where to ask if it is alive
        owner_subkey(IDS[3]): DONE,
        owner_subkey(IDS[4]): {"formed": b"short"},
        "not an owner": announcement(member(5), b""),
        owner_subkey(IDS[5]): [1, 2, 3],
    }
    seen, skipped = decode_view(entries)
    assert set(seen.ready) == {IDS[0]} and seen.formed == {IDS[2]: A} and seen.done == {IDS[3]}
    assert seen.formers == {IDS[2]: member(2)} and seen.groups == {IDS[2]: G1}
    odd, _ = decode_view({owner_subkey(IDS[0]): formed_marker(A, b"not an id", b"")})
    assert odd.formed == {IDS[0]: A} and odd.groups == {}  # still late-making, never a lineage
    assert len(skipped) == 4
    assert isinstance(decide(seen, member(0), 0), Decision)


def failing_nonce(peer: PeerID, bits: int) -> bytes:
    """A nonce that does not prove a costly id for `peer` (a fixed one would, 1 time in 2^bits)."""
    return next(n for n in (i.to_bytes(8, "big") for i in range(1000)) if not proves(peer, n, bits))


def proves(peer: PeerID, nonce: bytes, bits: int) -> bool:
    try:
        verify(peer, nonce, bits)
    except BadIdProof:
        return False
    return True


def test_only_records_with_a_proof_of_a_costly_id_count() -> None:
    """A flood of throwaway identities announcing another state (or claiming a group formed)
    without paying for their ids is seen but never counted: the honest nodes group as before."""
    bits = 6
    honest = [solve(IDS[i], bits) for i in range(2)]
    entries = {owner_subkey(IDS[i]): announcement(member(i), honest[i]) for i in range(2)}
    for i in range(2, 6):  # more fakes than honest members, of another state, or a fake FORMED marker
        unproven = failing_nonce(IDS[i], bits)
        fake = announcement(member(i, B), unproven) if i < 5 else formed_marker(A, b"g", unproven)
        entries[owner_subkey(IDS[i])] = fake
    entries[owner_subkey(IDS[4])] = announcement(member(4, B), b"short")  # a malformed proof
    view, skipped = decode_view(entries, id_bits=bits)
    assert set(view.ready) == set(IDS[:2]) and not view.formed
    assert {s.owner for s in skipped} == set(IDS[2:6]) and all("costly id" in s.reason for s in skipped)
    assert set(IDS[2:6]) <= view.seen()  # nobody waits for them
    assert decide(view, member(0), 0).kind in ("lead", "join")
    unchecked, _ = decode_view(entries)  # the attack, were proofs not checked: no group of the honest
    assert decide(unchecked, member(0), 0).kind == "late"
    del unchecked.formed[IDS[5]]
    assert decide(unchecked, member(0), 0).kind == "other_state"
