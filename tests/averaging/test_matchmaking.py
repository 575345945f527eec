"""Matchmaking over real DHT nodes on 127.0.0.1: agreement, splitting, late nodes, a leader that
dies mid-matchmaking, client-mode members, liveness checks that ran out under load."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from swarm.averaging.config import AveragingConfig
from swarm.averaging.matchmaking import matchmaker
from swarm.averaging.matchmaking.liveness import Liveness
from swarm.averaging.matchmaking.matchmaker import Matchmade, Matchmaker
from swarm.averaging.matchmaking.ready import ReadyView, group_order
from swarm.averaging.messages import GroupInfo, MemberInfo
from swarm.dht import DHTNode
from swarm.p2p import P2PConfig, P2PHost
from swarm.p2p.handlers import CallContext
from swarm.p2p.peer_id import PeerID
from tests.waiting import until

LOCAL = P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))
FAST = {"matchmaking_time": 1.5, "request_timeout": 2.0}


@dataclass
class Peer:
    host: P2PHost
    dht: DHTNode
    matchmaker: Matchmaker
    client: bool

    def me(self) -> MemberInfo:
        maddrs = () if self.client else tuple(self.host.visible_maddrs)
        return MemberInfo(self.host.peer_id, maddrs, 1.0, 0.0 if self.client else 100.0, self.client)

    async def close(self) -> None:
        self.matchmaker.close()
        await self.dht.close()
        await self.host.close()


MakePeers = Callable[..., Awaitable[list[Peer]]]


@pytest.fixture
async def make_peers() -> AsyncIterator[MakePeers]:
    peers: list[Peer] = []

    async def make(count: int, *, clients: int = 0, **overrides: object) -> list[Peer]:
        made = []
        for i in range(count + clients):
            client = i >= count
            host = await P2PHost(config=LOCAL).start()
            initial = peers[0].host.visible_maddrs[:1] if peers else []
            dht = await DHTNode(initial_peers=initial, host=host, client_mode=client).start()
            config = AveragingConfig(client_mode=client, **{**FAST, **overrides})  # type: ignore[arg-type]
            peer = Peer(host, dht, Matchmaker(dht, host, "run", config), client)
            peers.append(peer)
            made.append(peer)
        return made

    yield make
    await asyncio.gather(*(peer.close() for peer in peers), return_exceptions=True)


def check_agreement(groups: list[GroupInfo | None], peers: list[Peer]) -> list[GroupInfo]:
    """Every member of a group got the very same group; nobody is in two groups."""
    distinct = {g.group_id: g for g in groups if g is not None}
    seen: set[object] = set()
    for group in distinct.values():
        for member in group.members:
            assert member.peer_id not in seen, "a node is in two groups"
            seen.add(member.peer_id)
            index = [p.host.peer_id for p in peers].index(member.peer_id)
            assert groups[index] == group, "members disagree about their group"
    return list(distinct.values())


async def form(peers: list[Peer], step: int, **kwargs: object) -> list[Matchmade]:
    return list(await asyncio.gather(*(p.matchmaker.form_group(step, p.me(), **kwargs) for p in peers)))


async def board_shows(reader: Peer, step: int, owners: list[Peer], kind: str) -> ReadyView:
    """The ready set of `step` as `reader` reads it from the DHT, once it shows each of `owners`
    as `kind` ("ready": announced, so gathering; "done": its DONE marker, stored in the background)."""
    wanted = {p.host.peer_id for p in owners}

    async def look() -> ReadyView | None:
        view = await reader.matchmaker.board.read(step)
        return view if wanted <= set(getattr(view, kind)) else None

    return await until(look, 10, f"{len(wanted)} peers {kind} at step {step}")


async def test_eight_nodes_form_one_group_and_stop_gathering_once_everyone_is_in(make_peers: MakePeers) -> None:
    peers = await make_peers(8, matchmaking_time=20.0)
    everyone = frozenset(p.host.peer_id for p in peers)
    started = asyncio.get_running_loop().time()
    found = await form(peers, 0, expected=everyone)
    took = asyncio.get_running_loop().time() - started
    formed = check_agreement([f.group for f in found], peers)
    assert len(formed) == 1 and len(formed[0].members) == 8
    assert took < 5.0, f"waited {took:.1f}s though everyone was in (window 20 s)"
    found = await form(peers, 1, expected=everyone)  # the leader changes from step to step
    assert len(check_agreement([f.group for f in found], peers)) == 1


async def test_a_late_node_takes_no_part_and_knows_it(make_peers: MakePeers) -> None:
    peers = await make_peers(4)
    three = frozenset(p.host.peer_id for p in peers[:3])  # their gathering ends once the three are in
    on_time = [asyncio.ensure_future(p.matchmaker.form_group(5, p.me(), expected=three)) for p in peers[:3]]
    groups = await asyncio.gather(*on_time)
    late = await peers[3].matchmaker.form_group(5, peers[3].me(), expected=frozenset())
    formed = check_agreement([*(g.group for g in groups), late.group], peers)
    assert len(formed) == 1 and len(formed[0].members) == 3
    assert late.group is None and late.late


async def test_late_nodes_never_form_a_second_group_of_the_same_state(make_peers: MakePeers) -> None:
    """Two nodes arriving after the group formed must not average with each other: a second
    group of the same state would apply another update and fork the model."""
    peers = await make_peers(5)
    groups = await form(peers[:3], 7, expected=frozenset(p.host.peer_id for p in peers[:3]))  # ends once all are in
    assert len(check_agreement([g.group for g in groups], peers[:3])) == 1
    late = await form(peers[3:], 7)
    assert all(f.group is None and f.late for f in late)


async def test_members_of_another_state_are_not_mixed_in(make_peers: MakePeers) -> None:
    peers = await make_peers(4)
    ours, theirs = bytes(32), b"\x01" * 32
    states = [ours, ours, ours, theirs]
    found = await asyncio.gather(
        *(p.matchmaker.form_group(2, dataclasses.replace(p.me(), state=s)) for p, s in zip(peers, states, strict=True))
    )
    formed = check_agreement([f.group for f in found[:3]], peers[:3])
    assert len(formed) == 1 and {m.peer_id for m in formed[0].members} == {p.host.peer_id for p in peers[:3]}
    assert found[3].group is None and found[3].swarm_state == ours


async def test_a_node_that_arrives_while_the_others_gather_joins_their_group(make_peers: MakePeers) -> None:
    peers = await make_peers(4)
    on_time = [asyncio.ensure_future(p.matchmaker.form_group(6, p.me())) for p in peers[:3]]
    await board_shows(peers[3], 6, peers[:3], "ready")  # they announced: they gather for 1.5 s, it arrives now
    as_client = dataclasses.replace(peers[3].me(), maddrs=(), bandwidth=0.0, client=True)  # as swarm-node joins
    late = await peers[3].matchmaker.form_group(6, as_client, gather=0.2)
    groups = await asyncio.gather(*on_time)
    formed = check_agreement([*(g.group for g in groups), late.group], peers)
    assert len(formed) == 1 and len(formed[0].members) == 4


async def test_a_leader_that_dies_mid_matchmaking_is_replaced(make_peers: MakePeers) -> None:
    peers = await make_peers(4)
    tasks = [asyncio.ensure_future(p.matchmaker.form_group(3, p.me())) for p in peers]
    view = await board_shows(peers[0], 3, peers, "ready")  # all announced; nobody decides before 1.5 s
    leader = group_order(list(view.ready), 3)[0]
    dying = next(p for p in peers if p.host.peer_id == leader)
    tasks[peers.index(dying)].cancel()
    await dying.close()
    survivors = [p for p in peers if p is not dying]
    groups = await asyncio.gather(*(tasks[peers.index(p)] for p in survivors))
    formed = check_agreement([g.group for g in groups], survivors)
    assert len(formed) == 1 and {m.peer_id for m in formed[0].members} == {p.host.peer_id for p in survivors}


async def test_client_mode_nodes_join_but_never_lead(make_peers: MakePeers) -> None:
    peers = await make_peers(2, clients=2)
    # everyone expected, as a node expects its last group: the gathering ends once all are in
    found = await form(peers, 0, expected=frozenset(p.host.peer_id for p in peers))
    formed = check_agreement([f.group for f in found], peers)
    assert len(formed) == 1 and len(formed[0].members) == 4
    assert sum(m.client for m in formed[0].members) == 2


async def test_a_failed_round_lets_the_step_be_matchmade_again(make_peers: MakePeers) -> None:
    peers = await make_peers(3)
    everyone = frozenset(p.host.peer_id for p in peers)  # the gatherings end once all are in
    assert len(check_agreement([f.group for f in await form(peers, 4, expected=everyone)], peers)) == 1
    for p in peers:
        p.matchmaker.round_failed(4)
    await board_shows(peers[0], 4, peers, "done")  # the DONE markers (stored in the background) replaced FORMED
    again = await form(peers, 4, expected=everyone)
    assert len(check_agreement([f.group for f in again], peers)) == 1


async def test_nodes_that_retry_apart_still_meet_though_each_sees_the_others_done_marker(
    make_peers: MakePeers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each found no group (DONE markers stored), then matchmakes again, expecting the other: the
    second only once the first, gathering, has read the second's DONE marker. A DONE marker must
    not end the gathering at once (it did, and 3 nodes stayed apart for minutes, each deciding
    "alone" on the others' DONE)."""
    peers = await make_peers(2, matchmaking_time=4.0)
    for p in peers:  # each alone in turn: both leave DONE for step 7
        assert (await p.matchmaker.form_group(7, p.me(), gather=0.2, expected=frozenset())).group is None
    await board_shows(peers[0], 7, peers, "done")  # the DONE markers are stored in the background
    saw_done = asyncio.Event()
    board, read = peers[0].matchmaker.board, peers[0].matchmaker.board.read

    async def spied_read(step: int) -> ReadyView:  # the first's reads while it gathers
        view = await read(step)
        if peers[0].host.peer_id in view.ready and peers[1].host.peer_id in view.done:
            saw_done.set()
        return view

    monkeypatch.setattr(board, "read", spied_read)
    expect = [frozenset({peers[1].host.peer_id}), frozenset({peers[0].host.peer_id})]
    first = asyncio.ensure_future(peers[0].matchmaker.form_group(7, peers[0].me(), expected=expect[0]))
    await asyncio.wait_for(saw_done.wait(), 10)  # the first has read the second's DONE since it announced
    second = await peers[1].matchmaker.form_group(7, peers[1].me(), expected=expect[1])
    formed = check_agreement([(await first).group, second.group], peers)
    assert len(formed) == 1 and len(formed[0].members) == 2


async def test_a_leader_that_rewrites_a_members_weight_loses_that_member(
    make_peers: MakePeers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack c: the leader sends a self-consistent group in which one member's weight
    is not what it announced. That member refuses it; the others, whose entries are right, keep it."""
    peers = await make_peers(3)
    order = group_order([p.host.peer_id for p in peers], 4)
    victim = order[-1]

    class Rewriting(GroupInfo):
        """The leader's GroupInfo.create (decoding a forged group again forges nothing new)."""

        @classmethod
        def create(cls, run_id: str, step: int, members: tuple[MemberInfo, ...]) -> GroupInfo:
            forged = tuple(dataclasses.replace(m, weight=1000.0) if m.peer_id == victim else m for m in members)
            return super().create(run_id, step, forged)

    monkeypatch.setattr(matchmaker, "GroupInfo", Rewriting)
    everyone = frozenset(p.host.peer_id for p in peers)
    found = {p.host.peer_id: f for p, f in zip(peers, await form(peers, 4, expected=everyone), strict=True)}
    mine = found[victim].group
    assert mine is None or mine.members[mine.index_of(victim)].weight == 1.0, "accepted a misstated announcement"
    kept = [f.group for peer, f in found.items() if peer != victim]
    assert all(g is not None and len(g.members) == 3 for g in kept)  # the others were stated right


async def test_a_leader_that_sees_a_better_leader_announce_after_it_decided_steps_down(make_peers: MakePeers) -> None:
    """Views differ by a moment: a node that decided before the first-ranked node announced leads
    a group whose other members join that node. It steps down and joins it too: one group of
    everyone (both leaders used to wait request_timeout, then a group formed without it)."""
    peers = await make_peers(3)
    step = 9
    ranked = group_order([p.host.peer_id for p in peers], step)
    first, second, third = (next(p for p in peers if p.host.peer_id == pid) for pid in ranked)
    ids = {p.host.peer_id for p in peers}
    joiner = asyncio.ensure_future(third.matchmaker.form_group(step, third.me(), gather=10.0,
                                                               expected=frozenset(ids)))  # fmt: skip
    await board_shows(second, step, [third], "ready")
    # the second decides on {second, third}: the first has not announced, so the second leads
    early = asyncio.ensure_future(second.matchmaker.form_group(step, second.me(), gather=0.0,
                                                               expected=frozenset({third.host.peer_id})))  # fmt: skip
    await until(lambda: (s := second.matchmaker._steps.get(step)) is not None and s.leading, 10, "the second leads")
    started = asyncio.get_running_loop().time()
    last = await first.matchmaker.form_group(step, first.me(), expected=frozenset(ids))
    found = [last, await early, await joiner]
    took = asyncio.get_running_loop().time() - started
    formed = check_agreement([f.group for f in found], [first, second, third])
    assert len(formed) == 1 and {m.peer_id for m in formed[0].members} == ids
    assert took < FAST["request_timeout"], f"took {took:.1f}s: someone waited out a leader's wait"


async def test_checks_that_ran_out_across_two_halves_never_make_two_groups(
    make_peers: MakePeers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six nodes of one state in two halves; a node's first check of a node of the other half
    runs out (its answer comes after request_timeout), later ones are answered at once. Each half
    then sees only itself alive, and each half's leader counted 3 of the 3 it had verified: two
    groups of 3. A leader now asks the peers of its state again before it finalizes: it counts
    all 6, and a group of 3 is no majority. Matchmaking again, the six form one group."""
    half: dict[PeerID, int] = {}  # filled once the peers exist (their handlers are bound at start)
    answered: set[tuple[PeerID, PeerID]] = set()
    original = Liveness._rpc_alive

    async def stalled_once(self: Liveness, ctx: CallContext, args: Any) -> dict[str, str]:
        pair = (ctx.peer_id, self.host.peer_id)
        if half.get(ctx.peer_id) != half[self.host.peer_id] and pair not in answered:
            answered.add(pair)
            await asyncio.sleep(1.5 * float(FAST["request_timeout"]))  # the caller gave up by now
        return await original(self, ctx, args)

    monkeypatch.setattr(Liveness, "_rpc_alive", stalled_once)
    peers = await make_peers(6)
    half.update({p.host.peer_id: i % 2 for i, p in enumerate(peers)})
    found = await form(peers, 0)
    groups = check_agreement([f.group for f in found], peers)
    assert len(groups) <= 1, f"two groups of one state: {[len(g.members) for g in groups]}"
    if not groups:  # both leaders stood down: the step is matchmade again, as the node does
        found = await form(peers, 0)
        groups = check_agreement([f.group for f in found], peers)
    assert [len(g.members) for g in groups] == [6]


async def test_a_member_whose_join_the_leader_did_not_answer_is_late_for_its_group(
    make_peers: MakePeers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three nodes; the leader takes one member's join, but the answer does not reach it in time
    (a loaded machine: 13 s). The leader's group holds that member, so a group of its own at the
    step would fork the model: the member is late for the leader's group, never in another one."""
    from swarm.averaging.matchmaking import joining
    from swarm.p2p.errors import RPCTimeout

    peers = await make_peers(3)
    step = 11
    ranked = group_order([p.host.peer_id for p in peers], step)
    leader, stalled = ranked[0], ranked[1]
    delivered: list[asyncio.Future[Any]] = []
    call = P2PHost.call

    async def join_unanswered(self: P2PHost, peer: Any, method: str, args: Any = None, *,
                              timeout: float | None = None) -> Any:  # fmt: skip
        if method != joining.JOIN or self.peer_id != stalled:
            return await call(self, peer, method, args, timeout=timeout)
        # the join reaches the leader, which makes us a member of its group; its answer is lost
        delivered.append(asyncio.ensure_future(call(self, peer, method, args, timeout=30.0)))
        await asyncio.wait_for(asyncio.shield(delivered[-1]), 30.0)
        raise RPCTimeout(f"{method} timed out")

    monkeypatch.setattr(P2PHost, "call", join_unanswered)
    everyone = frozenset(p.host.peer_id for p in peers)  # the gatherings end once all are in
    found = dict(zip([p.host.peer_id for p in peers], await form(peers, step, expected=everyone), strict=True))
    groups = {f.group.group_id: f.group for f in found.values() if f.group is not None}
    assert len(groups) == 1, f"{len(groups)} groups of one state at one step"
    [group] = groups.values()
    assert stalled in {m.peer_id for m in group.members}  # the leader went on with it as a member
    assert found[stalled].group is None and found[stalled].late and found[stalled].late_by == {leader}
    assert delivered, "the stalled member never called the leader"
    # a leader whose result did not come in max_wait is distrusted (the node's step end): one
    # that swallows joins at every step it leads gets the benefit of the doubt only once
    member = next(p for p in peers if p.host.peer_id == stalled)
    member.matchmaker.board.distrust_formed({leader})
    ids = [p.host.peer_id for p in peers]
    again = next(s for s in range(step + 1, step + 1000) if group_order(ids, s)[:2] == [leader, stalled])
    later = dict(zip(ids, await form(peers, again, expected=everyone), strict=True))
    assert leader not in later[stalled].late_by  # left out as a leader that failed


async def test_a_group_never_leaves_behind_most_of_the_round_that_made_its_state_while_they_live(
    make_peers: MakePeers,
) -> None:
    """A soak node paused past its leader's join timeout led again with the two nodes that had
    just fetched its state, while two of the three other members of the round that made that
    state were live (waiting for its result). Their round would hold 1 of that round's 4 members:
    a lineage the other members never take, and a fork. No group forms until they are in."""
    peers = await make_peers(6)
    survivor, fetched_a, fetched_b, waiting_a, waiting_b, dead = peers
    parent_round = {p.host.peer_id: 1.0 for p in (survivor, waiting_a, waiting_b, dead)}
    live = frozenset(p.host.peer_id for p in peers[:5])  # the dead one has no fresh record
    first = [survivor, fetched_a, fetched_b]
    kwargs = {"parent_round": parent_round, "live": live}
    found = await form(first, 3, expected=frozenset(p.host.peer_id for p in first), **kwargs)
    assert all(f.group is None and not f.late for f in found), found
    assert max(f.peers for f in found) == 2  # they were ready together: none will go on alone
    # the two come to matchmake: one group of five, holding 3 of the round's 4 members
    together = peers[:5]
    found = await form(together, 3, expected=live, **kwargs)
    [group] = check_agreement([f.group for f in found], together)
    assert {m.peer_id for m in group.members} == live
