"""The node's decisions (swarm/node/plan.py) on tables of situations: pure, no I/O."""

from __future__ import annotations

import dataclasses

import pytest

from swarm.node.plan import (
    APPLY_OWN,
    AWAIT_RESULT,
    END,
    FETCH,
    JOIN_FORMING,
    RECHECK,
    RETRY,
    TRAIN,
    Facts,
    borrowed_pace,
    expected_peers,
    latest_finish,
    median_pace,
    nodes_to_start_with,
    peers_matchmaking,
    peers_still_behind,
    plan_step,
    plan_without_group,
    predicted_finish,
    recently_stale,
    result_still_coming,
    servers_behind,
    starting_together,
    steps_for_slower,
    straggler_horizon,
    swarm_together,
    unkept_markers,
)  # fmt: skip
from swarm.node.progress import PeerProgress
from swarm.p2p.identity import Identity

NOW, H = 100.0, 10
IDS = [Identity.generate().peer_id for _ in range(4)]


def peer(step: int, inner: int, *, age: float = 0.0, sec: float = 1.0, client: bool = False,
         i: int = 0) -> PeerProgress:  # fmt: skip
    return PeerProgress(IDS[i], step, inner, H, sec, NOW - age, client)


def facts(*peers: PeerProgress, step: int = 5, late: bool = False, own_sec: float = 0.0, client: bool = False) -> Facts:
    return Facts(step=step, inner_steps=H, own_sec=own_sec, client=client, peers=peers, now=NOW, fresh_for=10.0,
                 late=late)  # fmt: skip


STEP_CASES = [
    # (situation, facts, action, inner steps when TRAIN)
    ("the first node of a run", facts(), TRAIN, H),
    ("peers in step with us, none started", facts(peer(5, 0), peer(5, 0, i=1)), TRAIN, H),
    ("in step, peers a few inner steps ahead (not late): a whole step", facts(peer(5, 3)), TRAIN, H),
    ("a newcomer mid-step: just enough to finish with them", facts(peer(5, 4), late=True), TRAIN, 5),
    ("a newcomer slower than its peers: fewer steps", facts(peer(5, 4), late=True, own_sec=2.0), TRAIN, 2),
    ("the slowest peer sets the end", facts(peer(5, 4), peer(5, 8, i=1), late=True), TRAIN, 5),
    ("a newcomer while the group forms: join with weight 0", facts(peer(5, H), late=True), JOIN_FORMING, 0),
    ("peers about to finish: join with weight 0", facts(peer(5, 9, sec=0.2), late=True), JOIN_FORMING, 0),
    ("a straggler: peers at a later step", facts(peer(6, 2)), FETCH, 0),
    ("only a client is ahead: its state cannot be fetched", facts(peer(6, 2, client=True)), TRAIN, H),
    ("a peer that vanished (stale record) is ignored", facts(peer(6, 2, age=60)), TRAIN, H),
    ("peers behind us do not hold us", facts(peer(3, 4)), TRAIN, H),
    ("all peers clients, matchmaking: they wait for a server", facts(peer(5, H, client=True), late=True), TRAIN, H),
    ("no pace known yet: a whole step", facts(peer(5, 4, sec=0.0), late=True), TRAIN, H),
    # one record alone cannot redirect or stop a node
    ("one peer claims a later step while two train with us", facts(peer(6, 0), peer(5, 2, i=1), peer(5, 3, i=2)),
     TRAIN, H),
    ("one peer ahead, one with us: us and it outnumber the claim", facts(peer(6, 0), peer(5, 2, i=1)), TRAIN, H),
    ("most of the swarm is ahead", facts(peer(6, 0), peer(6, 1, i=1), peer(5, 2, i=2)), FETCH, 0),
    ("one peer claims to be done while two still train", facts(peer(5, H), peer(5, 2, i=1), peer(5, 3, i=2)),
     TRAIN, H),
]  # fmt: skip


@pytest.mark.parametrize(("what", "f", "action", "steps"), STEP_CASES, ids=[c[0] for c in STEP_CASES])
def test_plan_step(what: str, f: Facts, action: str, steps: int) -> None:
    plan = plan_step(f)
    assert plan.action == action, plan.why
    assert plan.inner_steps == steps


GROUPLESS_CASES = [
    # (situation, facts, late, other state, seconds waited, action)
    ("alone in the swarm: our step is the swarm's", facts(), False, False, 0.0, APPLY_OWN),
    ("alone, but watching only briefly", dataclasses.replace(facts(), watched_for=1.0), False, False, 0.0, RETRY),
    ("alone, watching briefly, and no peer can know of us: none can be in the run",
     dataclasses.replace(facts(), watched_for=1.0, unknown=True), False, False, 0.0, APPLY_OWN),
    ("alone, but cut off from the DHT", dataclasses.replace(facts(), sees_peers=False), False, False, 0.0, RETRY),
    ("peers' records stale, and ours too: a stalled machine, not dead peers",
     dataclasses.replace(facts(peer(5, H, age=12)), own_record_age=12.0), False, False, 5.0, RETRY),
    ("peers' records stale for longer than a window, ours fresh: they are gone",
     dataclasses.replace(facts(peer(5, H, age=21)), own_record_age=3.0), False, False, 5.0, APPLY_OWN),
    ("our record never stored", dataclasses.replace(facts(), own_record_age=float("inf")), False, False, 0.0, RETRY),
    ("late, peers vanished: the result will come", facts(peer(5, H, age=60)), True, False, 5.0, AWAIT_RESULT),
    ("late, waited it out, its holders all gone: go on alone", facts(peer(5, H, age=60)), True, False, 31.0,
     APPLY_OWN),
    ("late, waited it out, a live client of our step: average with it", facts(peer(5, H, client=True)), True, False,
     31.0, RETRY),
    ("peers only behind us", facts(peer(3, 4)), False, False, 0.0, APPLY_OWN),
    # two servers at one earlier step would not take a lone node's state (swarm_is_ahead): a fork
    ("two peers behind at one step: wait for them", facts(peer(4, H), peer(4, 0, i=1)), False, False, 1.0, RETRY),
    ("two peers behind, waited max_wait: go on", facts(peer(4, H), peer(4, 0, i=1)), False, False, 31.0, APPLY_OWN),
    ("two peers behind at two steps: each follows", facts(peer(3, 4), peer(4, 0, i=1)), False, False, 1.0,
     APPLY_OWN),
    ("two clients behind: clients follow anyone", facts(peer(4, H, client=True), peer(4, 0, client=True, i=1)),
     False, False, 1.0, APPLY_OWN),
    ("three behind, two at one step, one between: they follow the two ahead",
     facts(peer(3, 0), peer(3, 0, i=1), peer(4, 0, i=2)), False, False, 1.0, APPLY_OWN),
    ("a client with two servers behind: servers never follow a client anyway",
     facts(peer(4, H), peer(4, 0, i=1), client=True), False, False, 1.0, APPLY_OWN),
    ("our state is not the swarm's", facts(peer(5, H)), False, True, 0.0, FETCH),
    ("the step's result is out", facts(peer(6, 0)), True, False, 0.0, FETCH),
    ("late: the group formed without us", facts(peer(5, H)), True, False, 1.0, AWAIT_RESULT),
    ("peers done training, no group yet: meet them", facts(peer(5, H)), False, False, 1.0, RETRY),
    ("waited long enough: matchmake again", facts(peer(5, H)), True, False, 31.0, RETRY),
    ("peers of our step still training: wait and matchmake again", facts(peer(5, 4)), False, False, 0.0, RETRY),
    ("the peers vanished meanwhile", facts(peer(5, H, age=60)), False, False, 5.0, APPLY_OWN),
    ("a client whose peers are all clients", facts(peer(5, H, client=True), client=True), False, False, 0.0,
     APPLY_OWN),
    ("a server with a client peer training", facts(peer(5, 4, client=True)), False, False, 0.0, RETRY),
    ("one peer claims the result is out, two others are with us",
     facts(peer(6, 0), peer(5, H, i=1), peer(5, H, i=2)), False, False, 1.0, RETRY),
]  # fmt: skip


@pytest.mark.parametrize(("what", "f", "late", "other", "waited", "action"), GROUPLESS_CASES,
                         ids=[c[0] for c in GROUPLESS_CASES])  # fmt: skip
def test_plan_without_group(what: str, f: Facts, late: bool, other: bool, waited: float, action: str) -> None:
    plan = plan_without_group(f, late=late, other_state=other, waited=waited, max_wait=30.0)
    assert plan.action == action, plan.why


READY_PEER_CASES = [
    # (situation, facts, ready peers in the last matchmaking, seconds since the step's first groupless end, action)
    ("peers ready with us, their records stale (load): not alone", facts(peer(5, H, age=60)), 3, 1.0, RETRY),
    ("peers ready with us, no record of them at all", facts(), 1, 1.0, RETRY),
    ("ready peers, but max_wait since the first groupless end: go on", facts(), 3, 31.0, APPLY_OWN),
    ("nobody ready with us, no live record: alone", facts(peer(5, H, age=60)), 0, 1.0, APPLY_OWN),
    ("ready peers, yet the step's result is out: fetch it", facts(peer(6, 0), peer(6, 0, i=1)), 2, 1.0, FETCH),
]  # fmt: skip


@pytest.mark.parametrize(("what", "f", "ready", "groupless_for", "action"), READY_PEER_CASES,
                         ids=[c[0] for c in READY_PEER_CASES])  # fmt: skip
def test_a_node_that_matchmade_with_ready_peers_does_not_go_on_alone(
    what: str, f: Facts, ready: int, groupless_for: float, action: str
) -> None:
    plan = plan_without_group(f, late=False, other_state=False, waited=1.0, max_wait=30.0, ready_peers=ready,
                              groupless_for=groupless_for)  # fmt: skip
    assert plan.action == action, plan.why


LAST_STEP_CASES = [
    # (situation, facts, late, waited, last step, action); late: the group formed without us
    ("last step, late, holders gone after max_wait: does the group stand?", facts(peer(5, H, age=60)), True, 31.0,
     True, RECHECK),
    ("not the last step: the result is lost, compute it again", facts(peer(5, H, age=60)), True, 31.0, False,
     APPLY_OWN),
    ("last step, a stale record at the next step: they finished, end", facts(peer(6, 0, age=60)), False, 1.0, True,
     END),
    ("last step, nobody ever took it: ours is the run's last step", facts(peer(5, H, age=60)), False, 1.0, True,
     APPLY_OWN),
    ("last step, late, waiting for the result still", facts(peer(5, H, age=60)), True, 5.0, True, AWAIT_RESULT),
    ("last step, the finished peers still live: fetch their state", facts(peer(6, 0), peer(6, 0, i=1)), True, 31.0,
     True, FETCH),
    ("last step, late, other late ones live at our step: no second group", facts(peer(5, H), peer(5, H, i=1)), True,
     31.0, True, RECHECK),
    ("not the last step: late ones group again after max_wait", facts(peer(5, H), peer(5, H, i=1)), True, 31.0,
     False, RETRY),
]  # fmt: skip


@pytest.mark.parametrize(("what", "f", "late", "waited", "last", "action"), LAST_STEP_CASES,
                         ids=[c[0] for c in LAST_STEP_CASES])  # fmt: skip
def test_at_the_runs_last_step_a_node_never_makes_a_second_final_state(
    what: str, f: Facts, late: bool, waited: float, last: bool, action: str
) -> None:
    plan = plan_without_group(f, late=late, other_state=False, waited=waited, max_wait=30.0, last=last)
    assert plan.action == action, plan.why


CONFIRMED_CASES = [
    # (situation, facts, waited since the RECHECK's matchmaking, action): it found the group standing
    ("the group stands: wait for its result once more", facts(peer(5, H, age=60)), 1.0, AWAIT_RESULT),
    ("the group stands and its result did not come: end", facts(peer(5, H, age=60)), 31.0, END),
    ("late ones beside us, the group stands: end, no second group", facts(peer(5, H), peer(5, H, i=1)), 31.0, END),
    ("the finished peers still live: fetch", facts(peer(6, 0), peer(6, 0, i=1)), 31.0, FETCH),
]  # fmt: skip


@pytest.mark.parametrize(("what", "f", "waited", "action"), CONFIRMED_CASES, ids=[c[0] for c in CONFIRMED_CASES])
def test_at_the_last_step_a_group_that_still_stands_ends_the_wait(what: str, f: Facts, waited: float,
                                                                   action: str) -> None:  # fmt: skip
    plan = plan_without_group(f, late=True, other_state=False, waited=waited, max_wait=30.0, last=True,
                              late_confirmed=True)  # fmt: skip
    assert plan.action == action, plan.why


QUIET_PEER_CASES = [
    # (situation, facts (fresh for 10 s), action): a peer of our step whose record went stale
    # only just may be a live process with late records (a busy machine), about to average
    ("a peer of our step stale for 1 s: wait for it", facts(peer(5, H, age=11)), RETRY),
    ("a peer of our step stale for a whole window: waited for still", facts(peer(5, H, age=20)), RETRY),
    ("a peer of our step stale for longer than a window: alone", facts(peer(5, H, age=20.5)), APPLY_OWN),
    ("a peer still training our step, stale only just: wait", facts(peer(5, 3, age=12)), RETRY),
    ("stale only just, but behind us: it would follow our step", facts(peer(4, H, age=12)), APPLY_OWN),
    ("stale only just, at a later step: not one to average with", facts(peer(6, 0, age=12)), APPLY_OWN),
    ("a client waits for a quiet server", facts(peer(5, H, age=12), client=True), RETRY),
    ("a client does not wait for a quiet client", facts(peer(5, H, age=12, client=True), client=True), APPLY_OWN),
    ("a server waits for a quiet client of its step", facts(peer(5, H, age=12, client=True)), RETRY),
    ("one peer quiet only just, another long dead: wait",
     facts(peer(5, H, age=12), peer(5, H, age=60, i=1)), RETRY),
]  # fmt: skip


@pytest.mark.parametrize(("what", "f", "action"), QUIET_PEER_CASES, ids=[c[0] for c in QUIET_PEER_CASES])
def test_a_peer_of_our_step_that_went_quiet_only_just_is_waited_for_a_window_at_most(
    what: str, f: Facts, action: str
) -> None:
    plan = plan_without_group(f, late=False, other_state=False, waited=1.0, max_wait=30.0)
    assert plan.action == action, plan.why
    assert (action == RETRY) == bool(recently_stale(f)), plan.why


def test_matchmaking_expects_the_live_peers_of_our_step_that_finish_in_time() -> None:
    f = facts(peer(5, 4, i=0), peer(5, 0, sec=100.0, i=1), peer(6, 0, i=2), peer(5, 4, age=60, i=3))
    assert expected_peers(f, own_finish=NOW + 1, max_wait=30) == {IDS[0]}


def test_matchmaking_expects_the_live_peers_one_step_behind_who_catch_up_and_join() -> None:
    f = facts(peer(5, 4, i=0), peer(4, H, i=1), peer(4, 0, i=2), peer(3, H, i=3))
    assert expected_peers(f, own_finish=NOW + 1, max_wait=30) == {IDS[0], IDS[1], IDS[2]}  # not 2 behind
    assert expected_peers(facts(peer(4, H, age=60)), own_finish=NOW, max_wait=30) == frozenset()  # not stale ones


def test_latest_finish_waits_for_the_slowest_live_peer_of_the_step_bounded() -> None:
    f = facts(peer(5, 4), peer(5, 8, age=1, i=1), peer(6, 0, i=2), peer(5, 0, age=60, i=3))
    # the first peer needs 6 more seconds; the step-6 peer and the stale one do not count
    assert latest_finish(f, own_finish=NOW + 2, max_wait=30) == NOW + 6
    assert latest_finish(f, own_finish=NOW + 2, max_wait=3) == NOW + 5  # capped
    assert latest_finish(f, own_finish=NOW + 9, max_wait=30) == NOW + 9  # we are slowest
    assert latest_finish(facts(), own_finish=NOW, max_wait=30) == NOW


def test_a_member_of_our_last_round_whose_record_lags_trains_our_step() -> None:
    """Its record still says the step we averaged together (its new one has not reached us): it
    began our step when we did, at its own pace. Such records were read as one step behind: a
    node done early formed a group with a joiner while the 10 others of its last round trained
    (a 60-minute soak), and the two went on as a lineage of their own."""
    slow_mates = (peer(4, H, sec=2.0, i=1, age=5), peer(4, H, sec=1.5, i=2, age=5))
    fast = peer(5, H, sec=0.2)  # done with our step already
    alone = facts(fast, *slow_mates, step=5)
    ours = dataclasses.replace(alone, last_round=frozenset({IDS[0], IDS[1], IDS[2]}))
    # at the start of the step: one of the three training it is done, not most of them
    assert plan_step(alone).action == JOIN_FORMING
    assert plan_step(ours).action == TRAIN
    # waiting for slower peers: began when we did (own finish 100 + 5 at 0.5 s a step, so at 95),
    # they finish at 95 + 10 x 2.0 and 95 + 10 x 1.5
    own = dataclasses.replace(ours, own_sec=0.5)
    assert latest_finish(own, own_finish=NOW + 5, max_wait=30) == NOW + 15
    assert latest_finish(own, own_finish=NOW + 5, max_wait=4) == NOW + 9  # capped
    assert latest_finish(dataclasses.replace(alone, own_sec=0.5), own_finish=NOW + 5, max_wait=30) == NOW + 5
    # a peer one step behind that was not in our last round missed it: not waited for (it is
    # expected in matchmaking, as every live peer one step behind is)
    other = dataclasses.replace(own, last_round=frozenset({IDS[0]}))
    assert latest_finish(other, own_finish=NOW + 5, max_wait=30) == NOW + 5
    assert {IDS[1], IDS[2]} <= expected_peers(other, own_finish=NOW + 5, max_wait=30)


def test_a_peer_that_has_not_timed_a_step_is_expected_at_our_pace_from_its_record() -> None:
    untimed = peer(5, 2, sec=0.0, age=1)  # published 1 s ago, 8 inner steps to go, pace unknown
    assert predicted_finish(facts(untimed, own_sec=0.5), untimed) == NOW + 3  # 99 + 8 * 0.5
    assert latest_finish(facts(untimed, own_sec=0.5), own_finish=NOW, max_wait=30) == NOW + 3
    assert latest_finish(facts(untimed, own_sec=0.5), own_finish=NOW, max_wait=2) == NOW + 2  # capped
    assert latest_finish(facts(untimed), own_finish=NOW, max_wait=30) == NOW  # nobody's pace known: not waited
    done = peer(5, H, sec=0.0, age=1)
    assert predicted_finish(facts(done, own_sec=0.5), done) == NOW - 1  # done is done, whatever its pace
    assert IDS[0] in expected_peers(facts(untimed, own_sec=0.5), own_finish=NOW, max_wait=30)


OURS, OTHER = b"o" * 32, b"x" * 32
MATCHMAKING_CASES = [
    # (situation, facts, announced, peers matchmaking)
    ("nobody announced", facts(peer(5, H), peer(5, 2, i=1)), {}, 0),
    ("a peer of our step announced our state", facts(peer(5, H), peer(5, 2, i=1)), {IDS[0]: OURS}, 1),
    ("two did, one of them in a group already", facts(peer(5, H), peer(5, H, i=1)), {IDS[0]: OURS, IDS[1]: OURS}, 2),
    ("a peer of another state is not ours to join", facts(peer(5, H)), {IDS[0]: OTHER}, 0),
    ("an announcer whose record is stale is not counted", facts(peer(5, H, age=60)), {IDS[0]: OURS}, 0),
    ("an announcer whose record says another step is not counted", facts(peer(4, H)), {IDS[0]: OURS}, 0),
    ("an announcer with no record at all is not counted (a throwaway identity)", facts(peer(5, 2)),
     {IDS[3]: OURS}, 0),
]  # fmt: skip


@pytest.mark.parametrize(("what", "f", "announced", "count"), MATCHMAKING_CASES, ids=[c[0] for c in MATCHMAKING_CASES])
def test_peers_matchmaking(what: str, f: Facts, announced: dict, count: int) -> None:
    assert peers_matchmaking(f, announced, OURS) == count


FORMER, MEMBER, STRANGER = IDS[0], IDS[1], IDS[2]
MARKER_CASES = [
    # (situation, the owners that made us late, the members of the round we took, live records, distrusted)
    ("a member of the round we took kept its promise", {MEMBER}, {MEMBER}, {MEMBER}, set()),
    ("an identity with no progress record, not in the round: never a group", {STRANGER}, {MEMBER}, {MEMBER},
     {STRANGER}),
    ("a live node's group beside the one we took (a fork): kept", {FORMER}, {MEMBER}, {MEMBER, FORMER}, set()),
    ("one of each", {FORMER, STRANGER, MEMBER}, {MEMBER}, {MEMBER, FORMER}, {STRANGER}),
]  # fmt: skip


@pytest.mark.parametrize(("what", "late_by", "members", "live", "distrusted"), MARKER_CASES,
                         ids=[c[0] for c in MARKER_CASES])  # fmt: skip
def test_unkept_markers(what: str, late_by: set, members: set, live: set, distrusted: set) -> None:
    assert unkept_markers(frozenset(late_by), frozenset(members), frozenset(live)) == distrusted


def test_median_pace_ignores_peers_without_timing() -> None:
    assert median_pace([]) == 0.0
    assert median_pace([peer(5, 0, sec=0.0)]) == 0.0
    assert median_pace([peer(5, 1, sec=s) for s in (0.0, 3.0, 1.0, 2.0)]) == 2.0


def test_a_fresh_node_borrows_a_pace_only_from_two_timed_peers_or_more() -> None:
    assert borrowed_pace([peer(5, 0, sec=2.75)]) == 0.0  # one record (a liar's?) sets nothing
    assert borrowed_pace([peer(5, 0, sec=2.75), peer(5, 1, sec=0.0, i=1)]) == 0.0
    assert borrowed_pace([peer(5, 0, sec=2.75), peer(5, 1, sec=0.04, i=1)]) == 0.04  # the lower median
    assert borrowed_pace([peer(5, 1, sec=s, i=i) for i, s in enumerate((9.0, 0.05, 0.04))]) == 0.05


def test_servers_behind_only_when_every_live_server_is_at_an_earlier_step() -> None:
    def behind(*peers: PeerProgress) -> bool:
        return servers_behind(facts(*peers))

    assert behind(peer(2, 4)) and behind(peer(2, 4), peer(3, 10, i=1))
    assert not behind()  # no server at all: nobody whose state we could take
    assert not behind(peer(2, 4), peer(5, 0, i=1))  # one server is with us
    assert not behind(peer(4, 10))  # done with step 4: it publishes step 5 in a moment
    assert behind(peer(4, 9))  # still training step 4
    assert not behind(peer(2, 4, age=60))  # a stale record: that server is gone
    assert not behind(peer(2, 4, client=True))  # clients do not count
    assert behind(peer(2, 4), peer(7, 4, client=True, i=1))


def test_one_peer_claiming_a_late_finish_is_not_waited_for() -> None:
    """Attack f: a record predicting a finish just inside max_wait would hold every step that
    long. Peers predicted beyond the median finish plus one step at our pace (or the
    records' freshness window, when longer) are not waited for."""
    honest = [peer(5, 6, i=0), peer(5, 6, i=1)]  # finish at NOW + 4, 1 s per inner step
    liar = peer(5, 0, sec=2.9, i=2)  # "finishes" at NOW + 29
    f = facts(*honest, liar, own_sec=1.0)
    assert straggler_horizon(f, own_finish=NOW + 4) == NOW + 4 + H * 1.0
    assert expected_peers(f, own_finish=NOW + 4, max_wait=30) == {IDS[0], IDS[1]}
    assert latest_finish(f, own_finish=NOW + 4, max_wait=30) == NOW + 4  # not NOW + 29
    # a genuinely slower honest peer (up to a step behind the median) is still waited for
    slow = peer(5, 0, sec=1.2, i=3)  # finishes at NOW + 12
    assert IDS[3] in expected_peers(facts(*honest, slow, own_sec=1.0), own_finish=NOW + 4, max_wait=30)
    # with a fast pace, the records' freshness window (10 s here) is the least a peer is given
    quick = facts(peer(5, 6, sec=0.01, i=0), peer(5, 0, sec=0.9, i=1), own_sec=0.01)  # NOW + 0.04, NOW + 9
    assert IDS[1] in expected_peers(quick, own_finish=NOW + 0.04, max_wait=30)


@pytest.mark.parametrize(
    ("peers", "behind"),
    [
        ((), 0),  # alone: nobody to wait for
        ((peer(5, 0), peer(6, 0, i=1)), 0),  # everyone at our step or past it (step 5 is ours)
        ((peer(4, 10),), 1),  # it missed our group: it fetches our state, so we stay
        ((peer(4, 3, client=True),), 1),  # a client too
        ((peer(4, 10, age=30.0),), 0),  # a stale record: a dead node is not waited for
        ((peer(2, 0), peer(5, 0, i=1)), 1),
    ],
)
def test_peers_still_behind_the_last_step(peers: tuple[PeerProgress, ...], behind: int) -> None:
    assert len(peers_still_behind(facts(*peers))) == behind


@pytest.mark.parametrize(
    ("what", "peers", "last_group", "together"),
    [
        ("our first step: no group yet", (peer(5, 0, i=1),), 0, False),
        ("alone, our last step alone too", (), 1, False),
        ("a group of every live server", (peer(5, 3, i=1), peer(5, 9, i=2)), 3, True),
        ("a pair while two more servers are live", (peer(5, 3, i=1), peer(4, 9, i=2), peer(6, 0, i=3)), 2, False),
        ("a straggler at an earlier step counts", (peer(5, 3, i=1), peer(4, 10, i=2)), 2, False),
        ("a dead peer's stale record does not", (peer(5, 3, i=1), peer(4, 10, age=30.0, i=2)), 2, True),
        ("a client is not a server: nobody waits for it", (peer(5, 3, i=1), peer(5, 3, client=True, i=2)), 2, True),
        ("a larger group than the servers seen (clients in it)", (peer(5, 3, i=1),), 3, True),
    ],
)
def test_swarm_together(what: str, peers: tuple[PeerProgress, ...], last_group: int, together: bool) -> None:
    assert swarm_together(facts(*peers), last_group) is together, what


@pytest.mark.parametrize(
    ("what", "step", "peers", "start_with", "missing"),
    [
        ("no wait asked for", 0, (), 1, 0),
        ("alone, waiting for 3 more", 0, (), 4, 3),
        ("two of four are here", 0, (peer(0, 0, i=1),), 4, 2),
        ("every node is here", 0, (peer(0, 0, i=1), peer(0, 0, i=2), peer(0, 0, i=3)), 4, 0),
        ("more than asked for", 0, (peer(0, 0, i=1), peer(0, 0, i=2)), 2, 0),
        ("a client counts: it trains too", 0, (peer(0, 0, client=True, i=1),), 2, 0),
        ("a dead node's stale record does not count", 0, (peer(0, 0, age=30.0, i=1),), 2, 1),
        ("a peer is training: the run began without us", 0, (peer(0, 3, i=1),), 4, 0),
        ("a peer is past the first step: the run is under way", 0, (peer(2, 0, i=1),), 4, 0),
        ("we hold a later state (a resumed or fetched one)", 3, (), 4, 0),
    ],
)
def test_nodes_to_start_with(what: str, step: int, peers: tuple[PeerProgress, ...], start_with: int,
                             missing: int) -> None:  # fmt: skip
    assert nodes_to_start_with(facts(*peers, step=step), start_with) == missing, what


@pytest.mark.parametrize(
    ("what", "step", "peers", "present"),
    [
        ("alone at a new run", 0, (), 1),
        ("three of us, none training yet", 0, (peer(0, 0, i=1), peer(0, 0, i=2)), 3),
        ("a stale record is not a node", 0, (peer(0, 0, i=1), peer(0, 0, age=30.0, i=2)), 2),
        ("one is training: the run began", 0, (peer(0, 0, i=1), peer(0, 1, i=2)), 0),
        ("we hold a later step", 2, (peer(2, 0, i=1),), 0),
    ],
)
def test_starting_together(what: str, step: int, peers: tuple[PeerProgress, ...], present: int) -> None:
    assert starting_together(facts(*peers, step=step)) == present, what


@pytest.mark.parametrize(
    ("what", "peers", "own_sec", "extra_done", "max_wait", "steps"),
    [
        ("a slower peer 3 s from its end: three steps of ours fit", (peer(5, 7),), 1.0, 0, 30.0, 3),
        ("at half our pace, one fits", (peer(5, 7),), 2.0, 0, 30.0, 1),
        ("the slowest ends within our next step: start the round", (peer(5, 9, sec=0.5),), 1.0, 0, 30.0, 0),
        ("every peer is done: start the round", (peer(5, H), peer(5, H, i=1)), 1.0, 0, 30.0, 0),
        ("the slowest of several sets it", (peer(5, H), peer(5, 8, i=1)), 1.0, 0, 30.0, 2),
        ("no pace of ours yet", (peer(5, 2),), 0.0, 0, 30.0, 0),
        ("H extra steps already", (peer(5, 2),), 1.0, H, 30.0, 0),
        ("never more than H in all", (peer(5, 2),), 1.0, H - 1, 30.0, 1),
        ("a peer at the next step is not waited for", (peer(6, 2),), 1.0, 0, 30.0, 0),
        ("a peer one step behind is not either", (peer(4, 2),), 1.0, 0, 30.0, 0),
        ("a dead peer's stale record", (peer(5, 2, age=60.0),), 1.0, 0, 30.0, 0),
        ("a liar's slow pace, past the straggler horizon", (peer(5, 0, sec=100.0),), 1.0, 0, 30.0, 0),
        ("max_wait bounds the wait it could cause", (peer(5, 5),), 1.0, 0, 2.5, 2),
    ],
)
def test_steps_for_slower(what: str, peers: tuple[PeerProgress, ...], own_sec: float, extra_done: int,
                          max_wait: float, steps: int) -> None:  # fmt: skip
    assert steps_for_slower(facts(*peers, own_sec=own_sec), extra_done, max_wait) == steps, what


@pytest.mark.parametrize(
    ("what", "waited", "owners_at_step", "markers_stand", "coming"),
    [
        ("within max_wait: plan_without_group awaits it already", 10.0, True, True, False),
        ("past max_wait, its owners still say the step: their round is under way", 45.0, True, True, True),
        ("near the bound", 269.0, True, True, True),
        ("past max_wait + 4 part timeouts: given up", 271.0, True, True, False),
        ("past max_wait, its owners moved on or went quiet: matchmake again", 45.0, False, True, False),
        # the leader that had swallowed our join is at the step, but its round failed: no result comes
        ("past max_wait, its owners at the step withdrew their markers: matchmake again", 45.0, True, False, False),
    ],
)
def test_a_late_node_waits_for_a_round_still_under_way(what: str, waited: float, owners_at_step: bool,
                                                         markers_stand: bool, coming: bool) -> None:  # fmt: skip
    assert result_still_coming(waited, max_wait=30.0, part_timeout=60.0, owners_at_step=owners_at_step,
                               markers_stand=markers_stand) is coming, what  # fmt: skip
