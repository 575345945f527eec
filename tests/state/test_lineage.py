"""Which lineage a node adopts (swarm/state/lineage.py) on a table of situations, and the round
receipts' checks (swarm/state/receipts.py) as properties: forged signatures, a wrong parent,
reordered members, receipts replayed from another run or step."""

from __future__ import annotations

import contextlib
import hashlib
import time

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.dht import DHTNode, owner_subkey
from swarm.dht.run_keys import receipts_key
from swarm.p2p import P2PConfig, P2PHost
from swarm.p2p.identity import Identity
from swarm.p2p.peer_id import PeerID
from swarm.state import lineage_book
from swarm.state.holders import Holder
from swarm.state.lineage import Lineage, Link, judge, moved_over, structure_problem
from swarm.state.lineage_book import LineageBook, LineageError
from swarm.state.receipts import BadReceipt, Receipt, RoundBody, decode_receipt, sign, valid_signers
from swarm.state.trust import EARNED_ROUNDS

KEYS = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(12)]
P = [k.peer_id for k in KEYS]
A, B, C, D, E, X, Y, Z = P[0], P[1], P[2], P[3], P[4], P[9], P[10], P[11]  # X, Y, Z: attackers


def sha(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def link(step: int, parent: str, result: str, members: str, signers: str | None = None,
         weights: dict[str, float] | None = None) -> Link:  # fmt: skip
    """A link by letters: members "abc" (attackers "xyz"), signed by `signers` (default: all)."""
    ids = {"a": A, "b": B, "c": C, "d": D, "e": E, "x": X, "y": Y, "z": Z}
    weights = weights or {}
    return Link(
        step,
        sha(parent),
        sha(result),
        {ids[m]: weights.get(m, 1.0) for m in members},
        frozenset(ids[s] for s in (members if signers is None else signers)),
    )


def chain(anchor_step: int, anchor: str, *links: Link) -> Lineage:
    return Lineage(anchor_step, sha(anchor), tuple(links))


G = "genesis"
# the honest swarm a, b, c: rounds of steps 0-3 (states s1..s4)
HONEST = [link(0, G, "s1", "abc"), link(1, "s1", "s2", "abc"), link(2, "s2", "s3", "abc"), link(3, "s3", "s4", "abc")]
IN_SYNC = chain(0, G, *HONEST[:3])  # a node at step 3

# five nodes average together for steps 0-1, then split 3/2: the 2 take four steps, the 3 two
TOGETHER = [link(0, G, "t1", "abcde"), link(1, "t1", "t2", "abcde")]
SMALL_AHEAD = [link(2, "t2", "d3", "de"), link(3, "d3", "d4", "de"), link(4, "d4", "d5", "de"),
               link(5, "d5", "d6", "de")]  # fmt: skip
LARGE_BEHIND = [link(2, "t2", "l3", "abc"), link(3, "l3", "l4", "abc")]
# ... or split 2 + 2 + 1 after step 1 (sha("p3") < sha("q3"))
SPLIT = {
    "ab": chain(0, G, *TOGETHER, link(2, "t2", "p3", "ab"), link(3, "p3", "p4", "ab")),
    "cd": chain(0, G, *TOGETHER, link(2, "t2", "q3", "cd")),
    "e": chain(0, G, *TOGETHER, link(2, "t2", "e3", "e"), link(3, "e3", "e4", "e")),
}
# ... or all five in the round of step 2, which only a and b completed (c, d and e failed it)
HALF_DONE = [link(2, "t2", "h3", "abcde", "ab"), link(3, "h3", "h4", "ab"), link(4, "h4", "h5", "ab")]

CASES = [
    # (situation, own lineage, candidate, adopt?)
    ("a newcomer at genesis adopts the swarm's lineage", chain(0, G), chain(0, G, *HONEST), True),
    ("a node one step behind adopts its group's next state", IN_SYNC, chain(0, G, *HONEST), True),
    (
        "a forged state with receipts signed by 3 fresh ids is refused by a node in sync",
        IN_SYNC,
        chain(0, G, *HONEST[:3], link(3, "s3", "zero", "xyz")),
        False,
    ),
    (
        "... and by a node behind it",
        chain(0, G, *HONEST[:2]),
        chain(0, G, *HONEST[:3], link(3, "s3", "zero", "xyz")),
        False,
    ),
    (
        "forged ids listing honest members without their signatures back nothing",
        IN_SYNC,
        chain(0, G, *HONEST[:3], link(3, "s3", "zero", "abcxyz", "xyz")),
        False,
    ),
    (
        "one step ahead: a forged round on top of the honest tip is refused",
        chain(0, G, *HONEST),
        chain(0, G, *HONEST, link(4, "s4", "zero", "xyz"), link(5, "zero", "zero2", "xyz")),
        False,
    ),
    (
        "a minority member of the honest round forks alone: refused (not endorsed)",
        chain(0, G, *HONEST[:3]),
        chain(0, G, *HONEST[:3], link(3, "s3", "fork", "cxyz", "cxyz")),
        False,
    ),
    (
        "... also when it sits on the node's own fork (its own round outweighs it)",
        chain(0, G, *HONEST),
        chain(0, G, *HONEST[:3], link(3, "s3", "fork", "cxyz", "cxyz")),
        False,
    ),
    (
        "members that averaged honestly, then forked as a minority: their later rounds endorse nothing",
        chain(0, G, *HONEST[:3], link(3, "s3", "s4", "abcde")),
        chain(
            0, G, *HONEST[:3], link(3, "s3", "s4", "abcde"), link(4, "s4", "f5", "dexyz"), link(5, "f5", "f6", "dexyz")
        ),
        False,
    ),
    (
        "a node that applied its own Δ alone takes the group's result of that step",
        chain(0, G, *HONEST[:3], link(3, "s3", "solo", "c")),
        chain(0, G, *HONEST),
        True,
    ),
    (
        "the group keeps its state when the solo node advertises its own",
        chain(0, G, *HONEST),
        chain(0, G, *HONEST[:3], link(3, "s3", "solo", "c")),
        False,
    ),
    (
        "a split of three solo nodes heals onto the smallest hash (this side's is smaller)",
        chain(0, G, *HONEST[:3], link(3, "s3", "zz-a", "a")),
        chain(0, G, *HONEST[:3], link(3, "s3", "aa-b", "b")),
        sha("aa-b") < sha("zz-a"),
    ),
    (
        "... and the other side keeps its own (one of the two moves)",
        chain(0, G, *HONEST[:3], link(3, "s3", "aa-b", "b")),
        chain(0, G, *HONEST[:3], link(3, "s3", "zz-a", "a")),
        sha("zz-a") < sha("aa-b"),
    ),
    (
        "a network split 3 + 2 of a round of 5: the half of 2 takes the half of 3",
        chain(0, G, link(0, G, "t1", "abcde"), link(1, "t1", "m2", "de"), link(2, "m2", "m3", "de")),
        chain(0, G, link(0, G, "t1", "abcde"), link(1, "t1", "n2", "abc"), link(2, "n2", "n3", "abc")),
        True,
    ),
    (
        "... and the half of 3 refuses the half of 2 (2 of 5 endorse it)",
        chain(0, G, link(0, G, "t1", "abcde"), link(1, "t1", "n2", "abc"), link(2, "n2", "n3", "abc")),
        chain(0, G, link(0, G, "t1", "abcde"), link(1, "t1", "m2", "de"), link(2, "m2", "m3", "de")),
        False,
    ),
    (
        "a member that signed both histories counts for neither",
        chain(0, G, link(0, G, "t1", "abcd"), link(1, "t1", "n2", "abc")),
        chain(0, G, link(0, G, "t1", "abcd"), link(1, "t1", "m2", "cd", "cd")),
        False,
    ),
    (
        "a split inside one round of 5 (its part owner died answering d and e): the 2 take the 3's result",
        chain(0, G, link(0, G, "t1", "abcde"), link(1, "t1", "k2", "abcde", "de"), link(2, "k2", "k3", "de")),
        chain(0, G, link(0, G, "t1", "abcde"), link(1, "t1", "j2", "abcde", "abc"), link(2, "j2", "j3", "abc")),
        True,
    ),
    (
        "... also before the other signatures of our result are in",
        chain(0, G, link(0, G, "t1", "abcde"), link(1, "t1", "k2", "abcde", "d")),
        chain(0, G, link(0, G, "t1", "abcde"), link(1, "t1", "j2", "abcde", "abc"), link(2, "j2", "j3", "abc")),
        True,
    ),
    (
        "... and the 3 keep theirs",
        chain(0, G, link(0, G, "t1", "abcde"), link(1, "t1", "j2", "abcde", "abc"), link(2, "j2", "j3", "abc")),
        chain(0, G, link(0, G, "t1", "abcde"), link(1, "t1", "k2", "abcde", "de"), link(2, "k2", "k3", "de")),
        False,
    ),
    (
        "our group of 3 listed a and b, who formed a group of 2 beside it: we take theirs (2 against our 1)",
        chain(0, G, link(0, G, "t1", "abc"), link(1, "t1", "k2", "abc", "c")),
        chain(0, G, link(0, G, "t1", "abc"), link(1, "t1", "j2", "ab"), link(2, "j2", "j3", "ab")),
        True,
    ),
    (
        "... and they keep theirs",
        chain(0, G, link(0, G, "t1", "abc"), link(1, "t1", "j2", "ab"), link(2, "j2", "j3", "ab")),
        chain(0, G, link(0, G, "t1", "abc"), link(1, "t1", "k2", "abc", "c")),
        False,
    ),
    (
        "a member that signed both results of one round counts for neither (2 against 2: the smaller hash)",
        chain(0, G, link(0, G, "t1", "abcde"), link(1, "t1", "n2", "abcde", "cde"), link(2, "n2", "n3", "cde")),
        chain(0, G, link(0, G, "t1", "abcde"), link(1, "t1", "m2", "abcde", "abc"), link(2, "m2", "m3", "abc")),
        sha("m2") < sha("n2"),
    ),
    (
        "half of the members but not half of the weight: not endorsed",
        chain(0, G, link(0, G, "t1", "ab", weights={"a": 3})),
        chain(0, G, link(0, G, "t1", "ab", weights={"a": 3}), link(1, "t1", "u2", "b"), link(2, "u2", "u3", "b")),
        False,
    ),
    (
        "a round of two whose other member died: the survivor's rounds with newcomers are endorsed",
        chain(0, G, link(0, G, "t1", "ab")),
        chain(0, G, link(0, G, "t1", "ab"), link(1, "t1", "u2", "ad"), link(2, "u2", "u3", "ade")),
        True,
    ),
    (
        "a lineage that shares no state with ours is refused",
        chain(0, G, *HONEST[:2]),
        chain(3, "elsewhere", link(3, "elsewhere", "e4", "xyz")),
        False,
    ),
    ("a state of our own lineage is not adopted", IN_SYNC, chain(0, G, *HONEST[:2]), False),
    (
        "a newcomer resumed from a checkpoint adopts an endorsed continuation of it",
        chain(2, "s2"),
        chain(0, G, *HONEST),
        True,
    ),
    (
        "a split's smaller half that trained ahead takes the larger half's lineage behind it",
        chain(0, G, *TOGETHER, *SMALL_AHEAD),
        chain(0, G, *TOGETHER, *LARGE_BEHIND),
        True,
    ),
    (
        "... and the larger half never takes the smaller one's, however far ahead",
        chain(0, G, *TOGETHER, *LARGE_BEHIND),
        chain(0, G, *TOGETHER, *SMALL_AHEAD),
        False,
    ),
    # a round of 5 splits 2 + 2 + 1: no part holds a majority of it, so none is endorsed (rule 2's
    # exception): rule 4 weighs them, and all end on the pair whose first state has the smaller hash
    ("a split into minorities: the node alone takes a pair's lineage", SPLIT["e"], SPLIT["ab"], True),
    ("... a pair never takes the one alone's", SPLIT["ab"], SPLIT["e"], False),
    ("... of two pairs, the one whose first state has the larger hash moves", SPLIT["cd"], SPLIT["ab"], True),
    ("... and the other keeps its own", SPLIT["ab"], SPLIT["cd"], False),
    (
        "... but not a lineage that no member of the round signed",
        SPLIT["e"],
        chain(0, G, *TOGETHER, link(2, "t2", "x3", "xyz")),
        False,
    ),
    (
        "... nor one whose later round its own first round did not endorse",
        SPLIT["e"],
        chain(0, G, *TOGETHER, link(2, "t2", "p3", "ab"), link(3, "p3", "x4", "xyz")),
        False,
    ),
    ("... nor, for a node with no round after the split, a minority's", chain(0, G, *TOGETHER), SPLIT["ab"], False),
    (
        "a round that fewer than half of its members completed: the rounds after it are not endorsed",
        SPLIT["cd"],
        chain(0, G, *TOGETHER, *HALF_DONE),
        False,
    ),
    (
        "a part that holds a majority of the round is not weighed against a minority's",
        chain(0, G, *TOGETHER, link(2, "t2", "m3", "abc")),
        chain(0, G, *TOGETHER, link(2, "t2", "a3", "de")),
        False,
    ),
]


@pytest.mark.parametrize(("situation", "own", "candidate", "adopt"), CASES, ids=[c[0][:60] for c in CASES])
def test_adoption_rules(situation: str, own: Lineage, candidate: Lineage, adopt: bool) -> None:
    assert structure_problem(candidate, candidate.step, candidate.state) is None
    verdict = judge(own, candidate)
    assert verdict.adopt is adopt, f"{situation}: {verdict.why}"


@pytest.mark.parametrize(
    ("situation", "ours", "theirs", "moved"),
    [
        ("one round, two results: who signed theirs and not ours", [link(1, "t1", "k2", "abcde", "de")],
         [link(1, "t1", "j2", "abcde", "abc")], "abc"),
        ("one round, two results: a member that signed both stays", [link(1, "t1", "k2", "abcde", "cde")],
         [link(1, "t1", "j2", "abcde", "abc")], "ab"),
        ("our group listed a and b; they signed a group that formed beside it", [link(1, "t1", "k2", "abc", "c")],
         [link(1, "t1", "j2", "ab")], "ab"),
        ("two groups of other members: nobody of ours", [link(1, "t1", "k2", "abc")], [link(1, "t1", "j2", "de")], ""),
        ("signed our older round, then theirs: both sides", [link(1, "t1", "k2", "abc"), link(2, "k2", "k3", "c")],
         [link(1, "t1", "j2", "de"), link(2, "j2", "j3", "dea")], ""),
    ],
)  # fmt: skip
def test_the_members_of_our_rounds_that_ended_up_on_the_other_side(
    situation: str, ours: list[Link], theirs: list[Link], moved: str
) -> None:
    ids = {"a": A, "b": B, "c": C, "d": D, "e": E}
    assert moved_over(ours, theirs) == frozenset(ids[m] for m in moved), situation


FORGED = chain(0, G, *(link(i, G if i == 0 else f"z{i}", f"z{i + 1}", "xyz") for i in range(5)))  # from genesis


@pytest.mark.parametrize(
    ("situation", "own", "candidate", "pending"),
    [
        (
            "the newest round signed by one of the three before it: its other signatures are on their way",
            chain(0, G, *HONEST[:2]),
            chain(0, G, *HONEST[:3], link(3, "s3", "s4", "abc", "a")),
            True,
        ),
        (
            "... seen from a node with no round since genesis",
            chain(0, G),
            chain(0, G, *HONEST[:3], link(3, "s3", "s4", "abc", "a")),
            True,
        ),
        (
            "a newest round that no member of the round before signed is refused outright",
            chain(0, G, *HONEST[:2]),
            chain(0, G, *HONEST[:3], link(3, "s3", "zero", "xyz")),
            False,
        ),
        (
            "a fork's larger half asked at once: its round shows its holder's signature alone, the rest are coming",
            chain(0, G, link(0, G, "t1", "abcde"), link(1, "t1", "m2", "de")),
            chain(0, G, link(0, G, "t1", "abcde"), link(1, "t1", "n2", "abc", "a")),
            True,
        ),
        (
            "a fork's smaller half loses even with all its signatures in: refused outright",
            chain(0, G, link(0, G, "t1", "abcde"), link(1, "t1", "n2", "abc")),
            chain(0, G, link(0, G, "t1", "abcde"), link(1, "t1", "m2", "de", "d")),
            False,
        ),
        (
            "forged ids listing the honest members in a round only they signed: refused outright",
            chain(0, G, link(0, G, "t1", "abcde"), link(1, "t1", "m2", "de")),
            chain(0, G, link(0, G, "t1", "abcde"), link(1, "t1", "z2", "abcxyz", "xyz")),
            False,
        ),
        (
            "an older round short of endorsements is refused outright",
            chain(0, G, HONEST[0]),
            chain(0, G, HONEST[0], link(1, "s1", "s2", "abc", "a"), link(2, "s2", "s3", "a")),
            False,
        ),
    ],
)
def test_a_newest_round_still_collecting_signatures_is_pending_not_refused(
    situation: str, own: Lineage, candidate: Lineage, pending: bool
) -> None:
    """Pending: refused for now, asked again within a second (adoption.PENDING_S), never adopted
    before the round before it endorses it."""
    verdict = judge(own, candidate)
    assert not verdict.adopt and verdict.pending is pending, f"{situation}: {verdict.why}"


def test_a_lineage_fabricated_from_genesis_takes_an_unvouched_newcomer_only() -> None:
    """What a lineage cannot tell a newcomer whose anchor is genesis: identities of their own
    signing from genesis on. A node that averaged with the swarm keeps its own, even against a
    longer one, unless an initial peer holds it; a newcomer that took a lineage nobody vouched
    for (provisional) moves to a newer one, and to any its initial peers hold."""
    assert judge(chain(0, G), FORGED).adopt
    assert not judge(IN_SYNC, FORGED).adopt
    assert judge(IN_SYNC, FORGED, vouched=True).adopt
    assert judge(IN_SYNC, FORGED, provisional=True).adopt  # newer: 5 steps against 3
    assert not judge(chain(0, G, *HONEST, link(4, "s4", "s5", "abc")), FORGED, provisional=True).adopt  # as new


def test_a_node_started_from_another_state_with_no_round_takes_the_swarms_lineage() -> None:
    assert judge(chain(0, "perturbed"), chain(0, G, *HONEST)).adopt
    assert not judge(chain(0, "perturbed"), chain(0, G, link(0, G, "s1", "abc"), link(1, "s1", "s2", "x"))).adopt


def test_a_client_follows_the_servers_even_to_an_older_step() -> None:
    """Its steps alone can never be fetched (rule 6); a server keeps its own."""
    alone = chain(0, G, link(0, G, "c1", "c"), link(1, "c1", "c2", "c"), link(2, "c2", "c3", "c"))
    servers = chain(0, G, link(0, G, "s1", "ab"))
    assert judge(alone, servers, client=True).adopt
    assert not judge(alone, servers).adopt


def test_structure_problems() -> None:
    good = chain(0, G, *HONEST)
    assert structure_problem(good, 4, sha("s4")) is None
    assert "another state" in structure_problem(good, 4, sha("zero"))
    assert "no round receipts" in structure_problem(chain(4, "s4"), 4, sha("s4"))
    broken = chain(0, G, HONEST[0], link(1, "other", "s2", "abc"))
    assert "does not follow" in structure_problem(broken, 2, sha("s2"))
    unsigned = chain(0, G, link(0, G, "s1", "abc", ""))
    assert "no valid signature" in structure_problem(unsigned, 1, sha("s1"))


def test_voters_are_the_members_of_the_last_round_of_two_or_more() -> None:
    assert chain(0, G).voters() is None
    assert chain(0, G, *HONEST[:2], link(2, "s2", "solo", "a")).voters() == {A, B, C}


@pytest.mark.parametrize(
    ("links", "last", "mates"),
    [
        ((), 32, set()),  # a newcomer has averaged with nobody: nothing earned
        ((link(0, G, "s1", "a"), link(1, "s1", "s2", "a")), 32, set()),  # rounds alone earn nothing
        (HONEST, 32, {A, B, C}),
        ((link(0, G, "s1", "abd", signers="ab"), *HONEST[1:]), 32, {A, B, C}),  # d never signed: not earned
        ((link(0, G, "s1", "abd"), *HONEST[1:]), 3, {A, B, C}),  # d's one round is past the window
        ((link(0, G, "s1", "abd"), *HONEST[1:]), 4, {A, B, C, D}),
        ((link(0, G, "s1", "abd"), *HONEST[1:]), 6, {A, B, C, D}),  # a window longer than the lineage: all of it
        ((link(0, G, "s1", "abd"), *HONEST[1:]), 0, set()),
    ],
)
def test_seniority_is_earned_by_signing_recent_rounds_of_two_or_more(links: tuple, last: int, mates: set) -> None:
    assert chain(0, G, *links).round_mates(last) == mates


def test_a_pair_that_averaged_apart_for_40_rounds_still_counts_the_swarms_signers() -> None:
    """Two nodes of a 60-minute soak averaged alone for 40 rounds after a fork: the holders of
    the larger lineage behind them must still be round mates, or rule 5 never checks it."""
    together = [link(0, G, "t1", "abcde")]
    apart = [link(1 + i, "t1" if i == 0 else f"p{i}", f"p{i + 1}", "de") for i in range(40)]
    assert chain(0, G, *together, *apart).round_mates(EARNED_ROUNDS) == {A, B, C, D, E}


# --- receipts --------------------------------------------------------------------------------


def body(step: int = 3, members: tuple[PeerID, ...] = (A, B, C), run: str = "run", parent: str = "p",
         result: str = "r") -> RoundBody:  # fmt: skip
    return RoundBody(run, b"settings", step, sha("group"), members, tuple(1.0 + i for i in range(len(members))),
                     sha(parent), sha(result))  # fmt: skip


def signed(b: RoundBody) -> Receipt:
    keys = {k.peer_id: k for k in KEYS}
    return Receipt(b, {p: sign(b, keys[p]) for p in b.members})


def test_a_receipt_round_trips_and_its_signatures_hold() -> None:
    receipt = signed(body())
    again = decode_receipt(msgpack.unpackb(msgpack.packb(receipt.encode())), "run")
    assert again == receipt
    assert valid_signers(again) == {A, B, C}


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["step", "run", "parent", "result", "order", "members"]))
def test_a_signature_does_not_carry_over_to_another_body(change: str) -> None:
    """Replayed from another run or step, moved onto another parent or result, or onto the
    members in another order: no signature holds."""
    original = signed(body())
    other = {
        "step": body(step=4), "run": body(run="other"), "parent": body(parent="q"), "result": body(result="s"),
        "order": RoundBody("run", b"settings", 3, sha("group"), (B, A, C), (2.0, 1.0, 3.0), sha("p"), sha("r")),
        "members": body(members=(A, B, C, D)),
    }[change]  # fmt: skip
    assert valid_signers(Receipt(other, original.signatures)) == frozenset()


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=64, max_size=64), st.integers(0, 2))
def test_a_forged_signature_never_holds(forged: bytes, index: int) -> None:
    receipt = signed(body())
    member = receipt.body.members[index]
    assert valid_signers(receipt.with_signatures({member: forged})) == frozenset(receipt.body.members) - {member}


def test_a_non_member_signature_is_ignored() -> None:
    b = body()
    outsider = KEYS[9]
    with pytest.raises(BadReceipt):
        sign(b, outsider)
    forged = Receipt(b, {outsider.peer_id: outsider.sign(b.digest())})
    assert valid_signers(forged) == frozenset()


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.binary(max_size=40)
                    | st.text(max_size=10), lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=10), max_leaves=30))  # fmt: skip
def test_garbage_is_a_bad_receipt(item: object) -> None:
    try:
        decode_receipt(item)
    except BadReceipt:
        pass


@pytest.mark.parametrize("mutate", [
    lambda e: e.update(v=2), lambda e: e.update(step=-1), lambda e: e.update(step=True),
    lambda e: e.update(parent=b"short"), lambda e: e.update(m=[]), lambda e: e.update(m=e["m"] + e["m"][:1]),
    lambda e: e["m"][0].__setitem__(1, float("nan")), lambda e: e["m"][0].__setitem__(1, -1.0),
    lambda e: e.update(sigs=[[7, b"\0" * 64]]), lambda e: e.update(sigs=[[0, b"\0" * 63]]),
    lambda e: e.update(settings=b"x" * 65), lambda e: e.update(run=""),
])  # fmt: skip
def test_malformed_receipts_are_refused(mutate) -> None:  # type: ignore[no-untyped-def]
    encoded = msgpack.unpackb(msgpack.packb(signed(body()).encode()))
    mutate(encoded)
    with pytest.raises(BadReceipt):
        decode_receipt(encoded)


def test_a_receipt_of_another_run_is_refused() -> None:
    with pytest.raises(BadReceipt, match="of run"):
        decode_receipt(signed(body(run="other")).encode(), "run")


# --- the book: bounds --------------------------------------------------------------------------


async def test_the_book_refuses_a_lineage_too_long_to_check_and_keeps_its_own_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A state a million steps on costs a newcomer no byte of receipts; past MAX_LINKS rounds of
    its own a node keeps the newest, anchored where the oldest kept one starts."""
    async with P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))) as host:
        dht = await DHTNode(host=host).start()
        book = LineageBook(host, dht, "run", b"settings", serve=True)
        try:
            liar = Holder(P[9], 1_000_000, "a" * 64, ("/ip4/127.0.0.1/tcp/9/p2p/" + str(P[9]),), 100)
            with pytest.raises(LineageError, match="more than we check"):
                await book.fetch([liar], 0, 1_000_000)
            # receipts stuffed with members and signatures: the fetch stops at MAX_LINEAGE_BYTES
            async with P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))) as stuffer:
                stuffed = [signed(body(step, members=tuple(P[:8]), parent=G if step == 0 else f"x{step}",
                                       result=f"x{step + 1}")) for step in range(20)]  # fmt: skip
                lineage_book.serve_lineage(stuffer, "run", lambda: stuffed)
                holder = Holder(stuffer.peer_id, 20, "a" * 64, (stuffer.visible_maddrs[0],), 100)
                monkeypatch.setattr(lineage_book, "MAX_LINEAGE_BYTES", 10_000)
                with pytest.raises(LineageError, match="MiB of receipts"):
                    await book.fetch([holder], 0, 20)
            monkeypatch.setattr(lineage_book, "MAX_LINKS", 3)
            book.start(0, sha(G))
            for step in range(5):
                book.record_alone(step, 1.0, book.lineage.state, sha(f"own{step + 1}"))
            kept = book.lineage
            assert (kept.anchor_step, kept.anchor, kept.step, kept.state) == (2, sha("own2"), 5, sha("own5"))
            assert [r.body.step for r in book.receipts] == [2, 3, 4]
        finally:
            await book.close()
            await dht.close()


async def test_a_fetched_lineage_takes_the_signatures_its_holder_lacks_from_the_dht() -> None:
    """The holder's receipts carry only A's signature (it could not read the others' during a
    split), and garbage in B's place on the newest; B stored its signature of the newest round
    in the DHT as every member does, C stored one that does not hold. The fetched lineage's
    newest round is signed by A and B: B's is read from the DHT and checked, C's is not taken,
    and the older rounds, whose signatures nobody stored, stay signed by A alone."""
    config = P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))
    rounds = [body(step, parent=G if step == 0 else f"s{step}", result=f"s{step + 1}") for step in range(3)]
    receipts = [Receipt(b, {A: sign(b, KEYS[0])}) for b in rounds]
    newest = rounds[-1]
    # the holder also put a signature that does not hold in B's place (C's key over B's name):
    # it must not hide B's real one in the DHT
    receipts[-1] = receipts[-1].with_signatures({B: sign(newest, KEYS[2])})
    stored = {B: sign(newest, KEYS[1]), C: sign(rounds[0], KEYS[2])}  # C's: over another round's body
    async with contextlib.AsyncExitStack() as stack:
        entry = await stack.enter_async_context(P2PHost(config=config))
        first = await DHTNode(host=entry).start()
        stack.push_async_callback(first.close)
        bootstrap = [str(entry.visible_maddrs[0])]
        for key, signature in ((KEYS[1], stored[B]), (KEYS[2], stored[C])):
            host = await stack.enter_async_context(P2PHost(key, config=config))
            member = await DHTNode(host=host, initial_peers=bootstrap).start()
            stack.push_async_callback(member.close)
            value = {"g": newest.group_id, "r": newest.result, "s": signature}
            assert await member.store(receipts_key("run", newest.step), value, time.time() + 60,
                                      owner_subkey(key.peer_id))  # fmt: skip
        holder_host = await stack.enter_async_context(P2PHost(KEYS[0], config=config))
        lineage_book.serve_lineage(holder_host, "run", lambda: receipts)
        holder = Holder(A, 3, "a" * 64, (holder_host.visible_maddrs[0],), 100)
        host = await stack.enter_async_context(P2PHost(config=config))
        dht = await DHTNode(host=host, initial_peers=bootstrap).start()
        stack.push_async_callback(dht.close)
        book = LineageBook(host, dht, "run", b"settings", serve=False)
        stack.push_async_callback(book.close)
        chain, fetched = await book.fetch([holder], 0, 3)
    assert [link.signers for link in chain.links] == [frozenset({A}), frozenset({A}), frozenset({A, B})]
    assert set(fetched[-1].signatures) == {A, B}
