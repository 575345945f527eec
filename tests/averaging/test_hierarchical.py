"""Hierarchical (grid) butterfly all-reduce in one process over real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
import torch

from swarm.averaging.averager import Averager
from swarm.averaging.messages import GroupInfo
from swarm.averaging.rounds import grid
from swarm.averaging.rounds.flat import AllReduceRound
from swarm.averaging.rounds.grid import GridRound
from swarm.averaging.rounds.grid_shape import grid_shape, make_grid
from swarm.dht import DHTNode
from swarm.p2p.errors import RemoteError
from swarm.p2p.wire import ErrorCode
from swarm_kernels import get_codec
from tests.averaging.faults import garbage_codec
from tests.averaging.rounds import EXACT, MakeGroup, Member, exact_mean, inputs

SMALL = {"max_group_size": 4, "block_size": 1024, "chunk_elements": 4096, **EXACT}


def grid_rounds(group: GroupInfo, members: list[Member], vectors: list[torch.Tensor]) -> list[GridRound]:
    return [GridRound(m.host, m.registry, group, v, m.config) for m, v in zip(members, vectors, strict=True)]


def two_stage_int8_bound(vectors: list[torch.Tensor], mean: torch.Tensor) -> float:
    """With V = max |input| and M = max |mean|: a sender's codes are off by at most half a scale,
    V/254, and so is a row partial's (a weighted mean of dequantized values, each at most its
    block's absmax <= V); the final average, within M + 2V/254 of zero, is off by half of its
    scale once more. The flat round has one V/254 less; fp32 rounding gets a relative 1e-6."""
    big, mean_max = max(v.abs().max().item() for v in vectors), mean.abs().max().item()
    return 2 * big / 254 + (mean_max + 2 * big / 254) / 254 + 1e-6 * big


def assert_agree_within_bound(
    rounds: list[GridRound], outcomes: list[Any], vectors: list[torch.Tensor], group: GroupInfo
) -> None:
    """Every member holds the same bits, and every sub-part is within the bound of the exact
    mean of the members its header says it includes."""
    results = [o[0] for o in outcomes]
    for result in results[1:]:
        assert torch.equal(result, results[0]), "members hold different averages"
    grid = rounds[0].grid
    reports = [o[1] for o in outcomes]
    assert all(r.contributions == reports[0].contributions for r in reports)
    for key, included in reports[0].contributions.items():
        lo, hi = grid.subs[key // grid.rows][key % grid.rows]
        mean = exact_mean([v[lo:hi] for v in vectors], group, included)
        error = (results[0][lo:hi].double() - mean).abs().max().item()
        assert error <= two_stage_int8_bound([vectors[i][lo:hi] for i in included], mean)


def test_grid_shape() -> None:
    assert grid_shape(16, 0, 4) == (4, 4)
    assert grid_shape(12, 0, 4) == (3, 4)
    assert grid_shape(9, 3, 4) == (3, 3)  # one client rides in each row: rows of 4
    assert grid_shape(13, 0, 4) == (4, 3)  # one owner left over rides as a passenger
    assert grid_shape(100, 0, 64) == (10, 10)
    grid = make_grid([1.0] * 9 + [0.0] * 3, 100_000, 4, 1024)
    assert grid.owners == ((0, 1, 2), (3, 4, 5), (6, 7, 8)) and grid.row_members[0] == (0, 1, 2, 9)
    bounds = [b for column in grid.subs for b in column]
    assert bounds[0][0] == 0 and bounds[-1][1] == 100_000
    assert all(hi == lo2 for (_, hi), (lo2, _) in itertools.pairwise(bounds))
    assert all(lo % 1024 == 0 for lo, _ in bounds)


@pytest.mark.parametrize("n", [12, 16])
async def test_grid_rounds_agree_bit_for_bit_within_the_two_stage_bound(make_group: MakeGroup, n: int) -> None:
    group, members = await make_group(n, **SMALL)
    vectors = inputs(n, 50_003)  # not a multiple of the block or the chunk
    rounds = grid_rounds(group, members, vectors)
    outcomes = await asyncio.gather(*(r.run() for r in rounds))
    assert_agree_within_bound(rounds, outcomes, vectors, group)
    grid = rounds[0].grid
    assert grid.rows * grid.cols == n and max(len(r) for r in grid.row_members) <= 4
    for _, report in outcomes:
        assert len(report.contributions) == n and all(inc == list(range(n)) for inc in report.contributions.values())


async def test_the_averager_takes_the_grid_only_beyond_max_group_size(
    make_group: MakeGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    used: list[str] = []
    for kind in (AllReduceRound, GridRound):
        original = kind.run

        async def spy(self: Any, _original: Any = original) -> Any:
            used.append(type(self).__name__)
            return await _original(self)

        monkeypatch.setattr(kind, "run", spy)
    group, members = await make_group(5, **SMALL)
    dhts = [await DHTNode(initial_peers=[], host=m.host).start() for m in members]
    averagers = []
    for dht, member in zip(dhts, members, strict=True):
        member.registry.close()  # the averager's own registry serves this host now
        averagers.append(Averager(dht, member.host, "run", member.config))
        member.registry = averagers[-1].registry
    try:
        for size in (4, 5):
            sub = GroupInfo.create("run", size, group.members[:size])
            tensors = inputs(size, 3000)
            outcomes = await asyncio.gather(*(a.run_round(sub, [t]) for a, t in zip(averagers, tensors, strict=False)))
            assert all(torch.equal(o[0][0], outcomes[0][0][0]) for o in outcomes)
            assert all(o[1].group_id == sub.group_id.hex() and o[1].bytes_sent > 0 for o in outcomes)
    finally:
        for averager in averagers:
            averager.matchmaker.close()
        for dht in dhts:
            await dht.close()
    assert used == ["AllReduceRound"] * 4 + ["GridRound"] * 5


async def test_wire_bytes_per_member_are_those_of_the_flat_butterfly(make_group: MakeGroup) -> None:
    n, numel = 16, 1 << 20
    group, members = await make_group(n, max_group_size=4, bandwidths=[100.0] * n)  # default int8, block 64
    vectors = inputs(n, numel)
    rounds = grid_rounds(group, members, vectors)
    outcomes = await asyncio.gather(*(r.run() for r in rounds))
    # E = the whole vector encoded (int8 codes + one fp32 scale per block; every part boundary is
    # on a block). A bandwidth-optimal all-reduce moves, per member and per direction, the other
    # members' share of its own part in and its own results out: 2 (n-1)/n E, the flat path's.
    encoded = get_codec("int8", block_size=64).encoded_nbytes(numel)
    ideal = 2 * (n - 1) / n * encoded
    for _, report in outcomes:
        assert ideal <= report.bytes_sent <= 1.05 * ideal
        assert ideal <= report.bytes_received <= 1.05 * ideal


async def test_a_member_killed_mid_round_leaves_the_survivors_in_agreement(make_group: MakeGroup) -> None:
    group, members = await make_group(12, part_timeout=2.0, **SMALL)
    vectors = inputs(12, 50_003)
    rounds = grid_rounds(group, members, vectors)
    victim = 5  # the owner of (1, 1): its row, its column and its sub-part must do without it
    assert rounds[victim].grid.col_of[victim] >= 0
    started = asyncio.Event()
    loop = asyncio.get_running_loop()
    honest = rounds[victim].codec

    class Tripwire:  # the victim's first encode: its first stage has started
        encoded_nbytes = staticmethod(honest.encoded_nbytes)
        decode, decode_accumulate = staticmethod(honest.decode), staticmethod(honest.decode_accumulate)

        @staticmethod
        def encode(x: torch.Tensor) -> torch.Tensor:
            loop.call_soon_threadsafe(started.set)
            return honest.encode(x)

    rounds[victim].codec = Tripwire()
    tasks = [asyncio.ensure_future(r.run()) for r in rounds]
    await asyncio.wait_for(started.wait(), 10)
    await members[victim].host.close()
    tasks[victim].cancel()
    survivors = [i for i in range(12) if i != victim]
    outcomes = await asyncio.gather(*(tasks[i] for i in survivors))
    await asyncio.gather(tasks[victim], return_exceptions=True)
    assert_agree_within_bound([rounds[i] for i in survivors], list(outcomes), vectors, group)
    # Whether the victim's slices reached the other owners of its row before it died is a race;
    # everything else is not: every sub-part is there, the members outside the victim's row are in
    # each of them, and its own sub-part (taken over by another row) is without it.
    contributions, grid = outcomes[0][1].contributions, rounds[0].grid
    assert len(contributions) == 12
    outside = [i for i in survivors if grid.row_of[i] != grid.row_of[victim]]
    assert all(set(outside) <= set(inc) for inc in contributions.values())
    assert victim not in contributions[grid.col_of[victim] * grid.rows + grid.row_of[victim]]


async def test_a_sender_of_garbage_is_left_out_and_the_rest_agree(make_group: MakeGroup) -> None:
    group, members = await make_group(12, **SMALL)
    vectors = inputs(12, 50_003)
    rounds = grid_rounds(group, members, vectors)
    liar = 2  # owner (0, 2): garbage in its slices for the other columns and in its final sub-part
    rounds[liar].codec = garbage_codec(rounds[liar].codec)
    outcomes = await asyncio.gather(*(r.run() for r in rounds), return_exceptions=True)
    honest = [i for i in range(12) if i != liar]
    assert_agree_within_bound([rounds[i] for i in honest], [outcomes[i] for i in honest], vectors, group)
    grid = rounds[0].grid
    for key, inc in outcomes[0][1].contributions.items():  # type: ignore[index]
        column, row = divmod(key, grid.rows)
        if column != grid.col_of[liar]:
            assert inc == [i for i in range(12) if i != liar]
        elif row == grid.row_of[liar]:  # taken over by (1, 2): the liar's row partial is lost with it
            assert inc == [i for i in range(12) if grid.row_of[i] != grid.row_of[liar]]


async def test_client_members_ride_in_rows_and_own_nothing(make_group: MakeGroup) -> None:
    group, members = await make_group(12, clients=3, **SMALL)
    vectors = inputs(12, 50_003)
    rounds = grid_rounds(group, members, vectors)
    outcomes = await asyncio.gather(*(r.run() for r in rounds))
    assert_agree_within_bound(rounds, outcomes, vectors, group)
    grid = rounds[0].grid
    assert (grid.rows, grid.cols) == (3, 3) and all(grid.col_of[i] == -1 for i in (9, 10, 11))
    assert all(inc == list(range(12)) for inc in outcomes[0][1].contributions.values())


async def test_bad_requests_on_the_grid_methods_get_bad_request(make_group: MakeGroup) -> None:
    group, members = await make_group(12, request_timeout=0.3, **SMALL)
    rounds = grid_rounds(group, members, inputs(12, 50_003))
    for m, r in zip(members, rounds, strict=True):
        m.registry.add(r)  # serving, not running: the requests below never get that far
    caller = members[1]  # (0, 1), asking (0, 0)
    g, address = group.group_id, group.members[0].address()
    cases = [
        (grid.ROW, {"g": g, "i": 2, "p": 0}),  # an index that is not the caller's
        (grid.ROW, {"g": g, "i": 1, "p": 1}),  # a part (0, 0) does not own
        (grid.ROW, {"g": b"x" * 32, "i": 1, "p": 0}),  # no such group
        (grid.ROW, {"g": g, "i": 1, "p": "0"}),
        (grid.COL, {"g": g, "i": 1, "p": 0, "s": 0, "inc": [1]}),  # not of column 0
        (grid.DOWN, {"g": g, "p": 0, "s": 99}),
        (grid.DOWN, {"g": g, "p": 3, "s": 0}),
        ("avg.part", {"g": g, "i": 1, "p": 0}),  # a flat method on a grid round
    ]
    col_caller = members[4]  # (1, 0): its partial must list members of its own row
    col_cases = [
        {"g": g, "i": 4, "p": 0, "s": 4, "inc": [4]},
        {"g": g, "i": 4, "p": 0, "s": 0, "inc": [0, 4]},
        {"g": g, "i": 4, "p": 0, "s": 0, "inc": [5, 4]},
        {"g": g, "i": 4, "p": 0, "s": 0, "inc": "all"},
    ]
    calls = [(caller, method, args) for method, args in cases] + [(col_caller, grid.COL, a) for a in col_cases]
    for who, method, args in calls:
        async with await who.host.open_stream(address, method, args, timeout=5.0) as stream:
            await stream.end()
            with pytest.raises(RemoteError) as info:
                await stream.read()
            assert info.value.code == ErrorCode.BAD_REQUEST, (method, args)
