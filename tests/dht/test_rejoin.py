"""A node gets back to an initial peer its routing table lost (rejoin.py): the schedule as a
table of cases, and a bootstrap that restarts under its old identity and address: the nodes
that joined through it before find it again, and a newcomer that joins through it finds what
they stored."""

from __future__ import annotations

import time

import pytest

from swarm.dht import DHTConfig, DHTNode
from swarm.dht.rejoin import RejoinSchedule
from swarm.p2p import P2PConfig
from swarm.p2p.identity import Identity
from tests.dht.conftest import LOCAL, MakeNode
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)

A, B = "/ip4/127.0.0.1/tcp/1/p2p/a", "/ip4/127.0.0.1/tcp/2/p2p/b"

APART = "two peers are scheduled apart"
# (what happened, in order: ("due", now, peers in the table) or ("tried", maddr, now, answered, kept);
#  the peers due at each "due")
CASES = [
    ("a peer in the table is never due", [("due", 0, {A}), ("due", 100, {A})], [[], []]),
    ("a lost peer waits base seconds first", [("due", 0, set()), ("due", 9, set()), ("due", 10, set())], [[], [], [A]]),
    (
        "each failure doubles the wait",
        [
            ("due", 0, set()),
            ("due", 10, set()),
            ("tried", A, 10, False, False),
            ("due", 19, set()),
            ("due", 20, set()),
            ("tried", A, 20, False, False),
            ("due", 39, set()),
            ("due", 40, set()),
        ],
        [[], [A], [], [A], [], [A]],
    ),
    (
        "the wait stops at the cap",
        [("due", 0, set()), *[("tried", A, 0, False, False)] * 8, ("due", 99, set()), ("due", 100, set())],
        [[], [], [A]],
    ),
    (
        "back in the table: the next loss waits base again",
        [
            ("due", 0, set()),
            ("tried", A, 10, False, False),
            ("tried", A, 30, False, False),
            ("due", 50, {A}),
            ("due", 50, set()),
            ("due", 60, set()),
        ],
        [[], [], [], [A]],
    ),
    (
        "answered but not kept (a full bucket): the cap",
        [("due", 0, set()), ("tried", A, 10, True, False), ("due", 109, set()), ("due", 110, set())],
        [[], [], [A]],
    ),
    (
        "answered and kept, then lost again: base",
        [("due", 0, set()), ("tried", A, 10, True, True), ("due", 19, set()), ("due", 20, set())],
        [[], [], [A]],
    ),
    (APART, [("due", 0, {B}), ("due", 5, set()), ("due", 10, set()), ("due", 15, set())], [[], [], [A], [A, B]]),
]


@pytest.mark.parametrize(("situation", "events", "expected"), CASES, ids=[c[0] for c in CASES])
def test_the_rejoin_schedule(situation: str, events: list[tuple], expected: list[list[str]]) -> None:
    schedule = RejoinSchedule(base=10.0, cap=100.0)
    seen = []
    for event in events:
        if event[0] == "due":
            _, now, in_table = event
            watched = [A, B] if situation == APART else [A]
            seen.append(schedule.due(watched, lambda m, t=in_table: m in t, now))
        else:
            _, maddr, now, answered, kept = event
            schedule.tried(maddr, now, answered=answered, kept=kept)
    assert seen == expected


@pytest.mark.parametrize(("base", "cap"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_a_schedule_needs_a_positive_base_under_its_cap(base: float, cap: float) -> None:
    with pytest.raises(ValueError, match="0 < base <= cap"):
        RejoinSchedule(base, cap)


async def test_a_restarted_bootstrap_is_found_again_and_joins_the_old_nodes_to_a_newcomer(
    make_node: MakeNode,
) -> None:
    quick = DHTConfig(rejoin_interval=0.2)
    identity = Identity.generate()
    first = await DHTNode(identity, p2p_config=LOCAL, config=quick).start()
    address = first.visible_maddrs[0]
    olds = [await make_node([address], config=quick) for _ in range(3)]
    await olds[0].store("k", "v", time.time() + 60)
    await first.close()  # the bootstrap goes down; the nodes notice on their next requests
    for node in olds:  # a lookup that asks every closest node fails on the bootstrap, which it drops
        assert await node.get("k", latest=True) is not None
    assert all(identity.peer_id not in n.table for n in olds)

    port = address.split("/tcp/")[1].split("/")[0]
    again = P2PConfig(host_maddrs=(f"/ip4/127.0.0.1/tcp/{port}",))
    restarted = await DHTNode(identity, p2p_config=again, config=quick).start()  # empty: no initial peers
    try:
        await until(lambda: len(restarted.table) >= 3, 20, "the old nodes back in the bootstrap's table", poll=0.05)
        newcomer = await make_node([address], config=quick)
        found = await newcomer.get("k")
        assert found is not None and found.value == "v"
    finally:
        await restarted.close()
