"""Bounded self-announcements: weights within what the run allows one step, bandwidth
shares capped at a few times the median, a group id that binds every member's announced numbers.
Pure rules on tables of cases, then matchmaking over real DHT nodes on 127.0.0.1."""

from __future__ import annotations

import dataclasses

import pytest

from swarm.averaging.matchmaking.ready import announcement, decode_view, group_problem
from swarm.averaging.messages import GroupInfo, MemberInfo
from swarm.averaging.rounds.partition import BANDWIDTH_CAP, capped_bandwidths, part_bounds
from swarm.dht.records import owner_subkey
from swarm.p2p.errors import BadRequest
from swarm.p2p.identity import Identity

IDS = [Identity.generate().peer_id for _ in range(4)]
MAX_WEIGHT = 1024.0


def member(i: int, weight: float = 512.0, bandwidth: float = 100.0, client: bool = False) -> MemberInfo:
    maddrs = () if client else (f"/ip4/127.0.0.1/tcp/{4000 + i}",)
    return MemberInfo(IDS[i], maddrs, weight, 0.0 if client else bandwidth, client, bytes(32))


@pytest.mark.parametrize(
    ("announced", "counted"),
    [
        ([100.0, 100.0, 100.0], [100.0, 100.0, 100.0]),  # equal: untouched
        ([100.0, 100.0, 100.0, 1e12], [100.0, 100.0, 100.0, 400.0]),  # attack b: 4x the median
        ([100.0, 1e12], [100.0, 400.0]),  # two owners: the lower median bounds the liar
        ([20.0, 100.0, 1000.0], [20.0, 100.0, 400.0]),  # a fast honest member is capped too
        ([0.0, 100.0, 1e12], [0.0, 100.0, 400.0]),  # clients (0) stay out of the median and own nothing
        ([0.0, 0.0], [0.0, 0.0]),  # nobody owns: part_bounds refuses it, as before
        ([50.0], [50.0]),
    ],
)
def test_bandwidths_count_at_most_a_few_times_the_median(announced: list[float], counted: list[float]) -> None:
    assert capped_bandwidths(announced) == counted


def test_one_member_announcing_1e12_owns_a_bounded_share_of_the_vector() -> None:
    numel = 1 << 20
    parts = part_bounds(numel, capped_bandwidths([100.0, 100.0, 100.0, 1e12]), 64)
    share = (parts[3][1] - parts[3][0]) / numel
    assert share == pytest.approx(BANDWIDTH_CAP / (BANDWIDTH_CAP + 3), abs=1e-3)
    assert all(hi > lo for lo, hi in parts[:3])  # every honest member owns a part


@pytest.mark.parametrize(
    "rewrite",
    [
        {"weight": 1e9},
        {"weight": 1.0},
        {"bandwidth": 1e12},
        {"client": True, "bandwidth": 0.0, "maddrs": ()},
    ],
)
def test_the_group_id_binds_each_members_announced_numbers(rewrite: dict[str, object]) -> None:
    members = (member(0), member(1), member(2))
    honest = GroupInfo.create("run", 3, members)
    rewritten = (members[0], dataclasses.replace(members[1], **rewrite), members[2])  # type: ignore[arg-type]
    assert GroupInfo.make_id("run", 3, rewritten) != honest.group_id
    forged = honest.encode()
    forged["m"] = [m.encode() for m in rewritten]  # the old id with rewritten members
    with pytest.raises(BadRequest):
        GroupInfo.decode(forged)


ME = member(1)
GROUP_CASES = [
    ("an honest group", (member(0), ME, member(2)), None),
    ("our weight rewritten", (member(0), dataclasses.replace(ME, weight=1.0), member(2)), "misstates"),
    ("our bandwidth rewritten", (member(0), dataclasses.replace(ME, bandwidth=1.0), member(2)), "misstates"),
    ("we are left out", (member(0), member(2)), "not in it"),
    ("the leader's own weight is huge", (member(0, weight=1e9), ME, member(2)), "above the run's"),
    ("another member's weight at the bound", (member(0, weight=MAX_WEIGHT), ME), None),
]


@pytest.mark.parametrize(("what", "members", "problem"), GROUP_CASES, ids=[c[0] for c in GROUP_CASES])
def test_a_member_refuses_a_group_that_misstates_it_or_exceeds_the_run(
    what: str, members: tuple[MemberInfo, ...], problem: str | None
) -> None:
    found = group_problem(GroupInfo.create("run", 7, members), ME, "run", 7, MAX_WEIGHT)
    assert (found is None) if problem is None else (found is not None and problem in found), found


def test_a_group_of_another_step_is_refused() -> None:
    assert group_problem(GroupInfo.create("run", 6, (member(0), ME)), ME, "run", 7, MAX_WEIGHT) is not None


def test_announcements_above_the_runs_weight_are_ignored_with_their_owner_named() -> None:
    entries = {
        owner_subkey(IDS[0]): announcement(member(0), b""),
        owner_subkey(IDS[1]): announcement(member(1, weight=MAX_WEIGHT), b""),
        owner_subkey(IDS[2]): announcement(member(2, weight=MAX_WEIGHT * 1e6), b""),  # attack a
    }
    view, skipped = decode_view(entries, MAX_WEIGHT)
    assert set(view.ready) == {IDS[0], IDS[1]}
    assert [s.owner for s in skipped] == [IDS[2]] and "weight" in skipped[0].reason
    assert IDS[2] in view.seen()  # it showed up: nobody waits for it any longer
    unbounded, _ = decode_view(entries)  # no bound given (tests of the all-reduce alone): all kept
    assert set(unbounded.ready) == set(IDS[:3])
