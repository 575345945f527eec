"""Measured bandwidth (rounds/bandwidth.py): the arithmetic by tables, then real rounds on 127.0.0.1
that time their streams, and an Averager that announces what it measured."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from swarm.averaging.messages import GroupInfo
from swarm.averaging.rounds import bandwidth
from swarm.averaging.rounds.bandwidth import MIN_ROUND_BYTES, MIN_STREAM_BYTES, LinkEstimate, round_rate, upload_span
from swarm.averaging.rounds.flat import AllReduceRound
from swarm.averaging.rounds.grid import GridRound
from tests.averaging.rounds import MakeGroup

MB = 1 << 20


@pytest.mark.parametrize(
    ("samples", "rate"),
    [
        ([], None),
        ([(MB, 0.0, 1.0)], MB / 1.0),  # one stream: its rate
        ([(MB, 0.0, 1.0), (MB, 0.0, 2.0)], MB + MB / 2),  # at once they share the link: rates add
        ([(MB, 0.0, 1.0), (MB, 1.0, 2.0)], MB / 1.0),  # one after the other: each had the link alone
        ([(MB, 0.0, 1.0), (MB // 4, 0.0, 10.0)], MB + MB / 40),  # a stream slowed by its peer ran beside
        ([(MIN_STREAM_BYTES - 1, 0.0, 0.001)] * 100, None),  # small streams are latency, not bandwidth
        ([(MB // 2, 0.0, 1.0)], None),  # too little moved in the round
        ([(MB, 1.0, 1.0)], None),  # untimed
        ([(MB, 0.0, math.inf)], None),
        ([(MB, 0.0, 1.0), (1000, 0.0, 1e-9)], MB / 1.0),  # a tiny stream does not count, however fast
        ([(MB, 0.0, 1.0), (MB, 0.99, 1.01)], MB / 1.0),  # 50 MB/s for 2% of the round is not held
        # fast slices for 0.15 s beside a slow peer's for 3.4 s: held 50 ms, they count
        ([(MB, 0.0, 0.15), (MB, 0.0, 0.16), (MB, 0.0, 3.4)], MB / 0.15 + MB / 0.16 + MB / 3.4),
    ],
)
def test_round_rate(samples: list[tuple[int, float, float]], rate: float | None) -> None:
    assert round_rate(samples) == (pytest.approx(rate) if rate is not None else None)


@pytest.mark.parametrize(
    ("sent", "local_s", "reported", "end"),
    [
        (MB, 0.5, MB / 2.0, 12.0),  # the receiver saw it take 2 s: our writes finished early (buffers)
        (MB, 0.5, 1e15, 10.5),  # a receiver claiming it came faster than we wrote it: our clock wins
        (MB, 0.5, None, None),  # no rate in the header
        (MB, 0.5, "fast", None),
        (MB, 0.5, True, None),
        (MB, 0.5, -1.0, None),
        (MB, 0.5, math.nan, None),
        (MB, 0.5, math.inf, None),
        (0, 0.5, 1.0, None),
    ],
)
def test_upload_span(sent: int, local_s: float, reported: object, end: float | None) -> None:
    span = upload_span(sent, 10.0, local_s, reported)
    assert span == (None if end is None else (sent, 10.0, end))


def test_the_estimate_smooths_rounds_and_announces_the_slower_direction() -> None:
    link = LinkEstimate()
    assert link.announced_mb_s(100.0) == 100.0  # nothing measured yet: the configured value
    link.observe(up=[(10 * MB, 0.0, 1.0)], down=[])  # only the upload known
    assert link.announced_mb_s(100.0) == pytest.approx(10 * MB / 1e6)
    link.observe(up=[], down=[(2 * MB, 0.0, 1.0)])  # a round without upload samples keeps the old one
    assert link.up == pytest.approx(10 * MB) and link.down == pytest.approx(2 * MB)
    assert link.announced_mb_s(100.0) == pytest.approx(2 * MB / 1e6)  # the slower direction
    link.observe(up=[], down=[(4 * MB, 0.0, 1.0)])
    assert link.down == pytest.approx((1 - bandwidth.SMOOTHING) * 2 * MB + bandwidth.SMOOTHING * 4 * MB)
    slow = LinkEstimate(up=1.0, down=1.0)  # 1 byte/s: clamped to what a member may announce
    assert slow.announced_mb_s(100.0) == bandwidth.MIN_MB_S
    assert LinkEstimate(up=1e30, down=1e30).announced_mb_s(100.0) == bandwidth.MAX_MB_S


def _vectors(n: int, numel: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(numel, generator=gen) for _ in range(n)]


async def test_a_flat_round_times_what_each_member_sent_and_received(make_group: MakeGroup) -> None:
    n, numel = 4, 2_000_000  # ~0.5 MB of int8 per stream: above MIN_STREAM_BYTES
    group, members = await make_group(n, weights=[1.0] * n, bandwidths=[100.0] * n, chunk_elements=1 << 16)
    rounds = [
        AllReduceRound(m.host, m.registry, group, v, m.config) for m, v in zip(members, _vectors(n, numel), strict=True)
    ]
    outcomes = await asyncio.gather(*(r.run() for r in rounds))
    for _, report in outcomes:
        assert len(report.up) == n - 1 and len(report.down) == n - 1  # a stream to and from every other owner
        assert all(b >= MIN_STREAM_BYTES and t1 > t0 for b, t0, t1 in report.up + report.down)
        assert sum(b for b, _, _ in report.down) >= MIN_ROUND_BYTES
        assert round_rate(report.up) is not None and round_rate(report.down) is not None


async def test_a_grid_round_times_its_streams_too(make_group: MakeGroup) -> None:
    n, numel = 12, 4_000_000
    group, members = await make_group(n, weights=[1.0] * n, bandwidths=[100.0] * n, max_group_size=4,
                                      chunk_elements=1 << 16)  # fmt: skip
    rounds = [
        GridRound(m.host, m.registry, group, v, m.config) for m, v in zip(members, _vectors(n, numel), strict=True)
    ]
    outcomes = await asyncio.gather(*(r.run() for r in rounds))
    assert all(report.up and report.down for _, report in outcomes)


async def test_an_averager_announces_what_its_rounds_measured() -> None:
    from swarm.averaging.config import AveragingConfig
    from tests.averaging.rounds import averagers

    n, numel = 3, 2_000_000
    config = AveragingConfig(chunk_elements=1 << 16, measure_bandwidth=True)
    async with averagers(n, config) as made:
        assert [a.bandwidth() for a in made] == [config.bandwidth] * n  # nothing measured yet
        vectors = _vectors(n, numel)
        group = GroupInfo.create("run", 0, tuple(a.member_info(1.0) for a in made))
        await asyncio.gather(*(a.run_round(group, [v]) for a, v in zip(made, vectors, strict=True)))
        measured = [a.bandwidth() for a in made]
        assert all(m != config.bandwidth and bandwidth.MIN_MB_S <= m <= bandwidth.MAX_MB_S for m in measured)
        assert made[0].member_info(1.0).bandwidth == measured[0]
        # the next group splits by what was measured; every member still computes the same split
        again = GroupInfo.create("run", 1, tuple(a.member_info(1.0) for a in made))
        results = await asyncio.gather(*(a.run_round(again, [v]) for a, v in zip(made, vectors, strict=True)))
        assert all(torch.equal(r[0][0], results[0][0][0]) for r in results)
        made[0].config = AveragingConfig(bandwidth=7.0)  # measuring off: the configured value
        assert made[0].bandwidth() == 7.0


def test_a_node_measures_its_bandwidth_unless_told_a_number() -> None:
    from swarm.node.config import NodeConfig

    measured = NodeConfig().averaging_config(client_mode=False)
    assert measured.measure_bandwidth and measured.bandwidth == 100.0  # 100 until a round measured
    fixed = NodeConfig(bandwidth=12.5).averaging_config(client_mode=False)
    assert not fixed.measure_bandwidth and fixed.bandwidth == 12.5
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="bandwidth"):
            NodeConfig(bandwidth=bad)
