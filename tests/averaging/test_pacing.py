"""Paced uploads (p2p/pacing.py, partition.upload_paces, bandwidth.LinkEstimate.pace): the
arithmetic by tables, the kernel's cap and acknowledged-bytes count on real sockets, and a real
round on 127.0.0.1 that caps each member's connections while it runs and lifts the caps after,
with results bit-identical to an unpaced round's."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from typing import Any

import pytest
import torch

from swarm.averaging.config import AveragingConfig
from swarm.averaging.messages import GroupInfo
from swarm.averaging.rounds import bandwidth
from swarm.averaging.rounds.bandwidth import MAX_PACED, PROBE_EVERY, LinkEstimate, busy_rate
from swarm.averaging.rounds.flat import AllReduceRound
from swarm.averaging.rounds.partition import upload_paces
from swarm.p2p import P2PHost
from swarm.p2p.handlers import CallContext
from swarm.p2p.pacing import MIN_RATE, bytes_acked, max_pacing_rate, set_max_pacing_rate
from swarm.p2p.stream import Stream
from tests.averaging.rounds import MakeGroup, averagers

MB = 1 << 20
linux = pytest.mark.skipif(sys.platform != "linux", reason="SO_MAX_PACING_RATE and TCP_INFO are Linux's")


@pytest.mark.parametrize(
    ("parts", "me", "paces"),
    [
        # equal parts: every peer gets our slice of its part and our part's average, a third each
        ([(0, 10), (10, 20), (20, 30), (30, 40)], 0, {1: 1 / 3, 2: 1 / 3, 3: 1 / 3}),
        # a slow member owning little: we send it little of its part, but still all of our average
        ([(0, 32), (32, 64), (64, 96), (96, 100)], 0, {1: 64 / 164, 2: 64 / 164, 3: 36 / 164}),
        # the slow member itself: its own small part's average to each, plus its slices of theirs
        ([(0, 32), (32, 64), (64, 96), (96, 100)], 3, {0: 36 / 108, 1: 36 / 108, 2: 36 / 108}),
        # a client (owns nothing) sends only slices; a member sends a client only its average
        ([(0, 50), (50, 100), (100, 100)], 2, {0: 0.5, 1: 0.5}),
        ([(0, 50), (50, 100), (100, 100)], 0, {1: 100 / 150, 2: 50 / 150}),
        ([(0, 0), (0, 0), (0, 100)], 0, {2: 1.0}),  # a client among clients: only the owner
    ],
)
def test_upload_paces_split_the_rate_by_what_each_peer_gets(
    parts: list[tuple[int, int]], me: int, paces: dict[int, float]
) -> None:
    got = upload_paces(parts, me, upload=1000.0, factor=1.0)
    assert got.keys() == paces.keys()
    assert all(got[j] == pytest.approx(1000.0 * share) for j, share in paces.items())
    assert sum(upload_paces(parts, me, 1000.0, 1.05).values()) == pytest.approx(1050.0)


@pytest.mark.parametrize(("upload", "factor"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (float("nan"), 1.0)])
def test_upload_paces_refuse_a_rate_that_is_not_positive(upload: float, factor: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        upload_paces([(0, 1), (1, 2)], 0, upload, factor)


@pytest.mark.parametrize(
    ("acked", "rate"),
    [
        ([], None),
        ([(0.0, 0), (0.5, MB)], None),  # shorter than MIN_BUSY_WINDOWS windows: says nothing
        ([(t / 20, t * MB // 20) for t in range(41)], MB),  # 1 MB/s throughout
        # 1 MB/s for 2 s, then a 1-s tail at a tenth of it: the tail does not count
        ([(t / 20, t * MB // 20) for t in range(41)] + [(2 + t / 20, 2 * MB + t * MB // 200) for t in range(21)], MB),
        ([(t / 20, 0) for t in range(41)], None),  # nothing acknowledged: no rate
        ([(0.0, 5 * MB), (0.5, 0), (1.0, MB), (1.5, 2 * MB), (2.0, 3 * MB)], 2 * MB),  # a count that fell: idle
    ],
)
def test_busy_rate(acked: list[tuple[float, int]], rate: float | None) -> None:
    got = busy_rate(acked)
    assert got == (None if rate is None else pytest.approx(rate, rel=0.02))


def test_the_estimate_paces_by_unpaced_rounds_and_probes_again() -> None:
    link = LinkEstimate()
    assert link.pace() is None  # nothing measured: unpaced
    link.observe(up=[(4 * MB, 0.0, 1.0)], down=[], busy=10 * MB)
    assert link.pace() == pytest.approx(10 * MB)  # the larger lower bound: busy
    link.observe(up=[(16 * MB, 0.0, 0.5)], down=[(MB, 0.0, 1.0)], busy=None)
    assert link.pace() == pytest.approx(link.up) and link.up > link.busy  # a round our link did not bind: up
    before = (link.up, link.down, link.busy)
    for _ in range(PROBE_EVERY - 1):  # a paced round measures our caps: nothing it saw changes the estimate
        assert link.pace() == pytest.approx(before[0])
        link.observe(up=[(MB, 0.0, 1.0)], down=[(MB, 0.0, 1.0)], busy=1.0, paced=True)
        assert (link.up, link.down, link.busy) == before
    assert link.pace() is None  # every PROBE_EVERY-th round is unpaced, and measures the link again
    link.observe(up=[(MB, 0.0, 1.0)], down=[(MB, 0.0, 1.0)], busy=MB, paced=False)
    assert link.busy < before[2] and link.up < before[0] and link.down is not None
    assert link.pace() == pytest.approx(max(link.up, link.busy))  # paced again from the new measures
    assert LinkEstimate(busy=2 * MAX_PACED).pace() is None  # a link faster than 1 Gbit/s: the CPU paces it
    assert LinkEstimate(up=MB, down=MB, busy=None).pace() == MB
    assert bandwidth.PACE_FACTOR >= 1.0  # a cap below our share would idle the link


@linux
def test_a_socket_takes_a_cap_lifts_it_and_counts_what_was_acknowledged() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as client:
        peer, _ = server.accept()
        with peer:
            acked = bytes_acked(client)
            assert max_pacing_rate(client) is None and acked in (0, 1)  # the SYN counts on some kernels
            assert set_max_pacing_rate(client, 1.5e6) and max_pacing_rate(client) == 1_500_000
            client.sendall(b"x" * 100_000)
            got = 0
            while got < 100_000:
                got += len(peer.recv(1 << 16))
            deadline = time.monotonic() + 5  # the last ACK may trail the data by a moment
            while bytes_acked(client) != acked + 100_000 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert bytes_acked(client) == acked + 100_000
            assert set_max_pacing_rate(client, None) and max_pacing_rate(client) is None
    for bad in (0.0, -5.0, float("nan"), 10.0):
        with pytest.raises(ValueError, match="pacing rate"):
            set_max_pacing_rate(client, bad)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        assert bytes_acked(udp) is None  # not TCP: the kernel says nothing


@linux
async def test_a_paced_round_caps_each_connection_while_it_runs_and_agrees_with_an_unpaced_one(
    make_group: MakeGroup,
) -> None:
    n, numel = 3, 1_000_000
    group, members = await make_group(n, weights=[1.0] * n, bandwidths=[100.0] * n, chunk_elements=1 << 16,
                                      measure_bandwidth=True)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    vectors = [torch.randn(numel, generator=gen) for _ in range(n)]
    upload = 400e6  # bytes/s: on 127.0.0.1 the caps must not slow the test
    caps_seen: list[int | None] = []

    def connection_caps(index: int) -> list[int | None]:
        host = members[index].host
        return [cap for peer in host.connected_peers() for cap in host.paces(peer)]

    paced = [
        AllReduceRound(m.host, m.registry, group, v, m.config, upload=upload)
        for m, v in zip(members, vectors, strict=True)
    ]
    run = asyncio.gather(*(r.run() for r in paced))
    while not run.done():  # caps appear once each round's streams run
        caps_seen += connection_caps(0)
        await asyncio.sleep(0.005)
    results = await run
    expected = upload * bandwidth.PACE_FACTOR / (n - 1)  # equal parts: half of our upload to each peer
    assert any(c is not None and c == pytest.approx(expected, rel=0.01) for c in caps_seen)
    assert paced[0].paced == {1, 2}
    assert all(cap is None for i in range(n) for cap in connection_caps(i))  # lifted when the round ended
    assert all(report.busy is None or report.busy > 0 for _, report in results)  # sampled: measure_bandwidth
    again = GroupInfo.create("run", 1, group.members)
    plain = [AllReduceRound(m.host, m.registry, again, v, m.config) for m, v in zip(members, vectors, strict=True)]
    unpaced = await asyncio.gather(*(r.run() for r in plain))
    assert all(torch.equal(a, results[0][0]) for a, _ in results)
    assert torch.equal(unpaced[0][0], results[0][0])  # pacing moves bytes later, never changes them


async def test_an_averager_that_measured_its_upload_paces_its_next_round() -> None:
    n, numel = 3, 500_000
    async with averagers(n, AveragingConfig(chunk_elements=1 << 16, measure_bandwidth=True)) as made:
        gen = torch.Generator().manual_seed(1)
        vectors = [torch.randn(numel, generator=gen) for _ in range(n)]
        for a in made:  # as if an unpaced round had measured 100 MB/s: the next one paces
            a.link = LinkEstimate(busy=100e6)
        group = GroupInfo.create("run", 0, tuple(a.member_info(1.0) for a in made))
        results = await asyncio.gather(*(a.run_round(group, [v]) for a, v in zip(made, vectors, strict=True)))
        assert all(torch.equal(r[0][0], results[0][0][0]) for r in results)
        assert [a.link.paced_rounds for a in made] == [1] * n  # paced, so it measured nothing
        assert [a.link.busy for a in made] == [100e6] * n
        hosts = [a.host for a in made]
        assert all(cap is None for h in hosts for peer in h.connected_peers() for cap in h.paces(peer))
        for a in made:  # a fixed --bandwidth never paces, whatever was measured
            a.config = AveragingConfig(chunk_elements=1 << 16)
        again = GroupInfo.create("run", 1, tuple(a.member_info(1.0) for a in made))
        await asyncio.gather(*(a.run_round(again, [v]) for a, v in zip(made, vectors, strict=True)))
        assert [a.link.paced_rounds for a in made] == [0] * n


@linux
async def test_a_share_below_the_kernel_floor_is_capped_at_the_floor_not_an_error(make_group: MakeGroup) -> None:
    # a member that announces a tiny bandwidth owns a tiny part; a client sends it only its slice
    # of it, and that share of a 1 MB/s upload is under pacing.MIN_RATE: the round takes the floor
    # as the cap instead of failing the part on a refused rate
    n, numel = 4, 300_000
    group, members = await make_group(n, clients=1, weights=[1.0] * n, bandwidths=[100.0, 100.0, 0.05, 0.0],
                                      chunk_elements=1 << 16)  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    vectors = [torch.randn(numel, generator=gen) for _ in range(n)]
    rounds = [
        AllReduceRound(m.host, m.registry, group, v, m.config, upload=1e6 if i == 3 else None)
        for i, (m, v) in enumerate(zip(members, vectors, strict=True))
    ]
    tiny = rounds[3].parts[2][1] - rounds[3].parts[2][0]
    assert 0 < tiny * 1e6 / numel < MIN_RATE  # unfloored, the client's cap for member 2 would be refused
    assert rounds[3].paces[2] == MIN_RATE
    results = await asyncio.gather(*(r.run() for r in rounds))
    assert all(torch.equal(a, results[0][0]) for a, _ in results)
    assert all(sorted(included) == [0, 1, 2, 3] for included in results[3][1].contributions.values())


def test_a_round_that_ran_out_its_part_timeout_measures_no_link() -> None:
    """A member (or its relay) died mid-round: the survivors' streams trickled for the whole wait.
    Learning that as the link paced the next rounds at the floor, starving every other use of
    those connections; a round that timed out changes no estimate, first round or not."""
    fresh = LinkEstimate()
    fresh.observe(up=[(MB, 0.0, 60.0)], down=[(MB, 0.0, 60.0)], busy=1e3, timed_out=True)
    assert (fresh.up, fresh.down, fresh.busy, fresh.pace()) == (None, None, None, None)
    known = LinkEstimate()
    known.observe(up=[(4 * MB, 0.0, 1.0)], down=[(4 * MB, 0.0, 1.0)], busy=4 * MB)
    before = (known.up, known.down, known.busy, known.paced_rounds)
    known.observe(up=[(MB, 0.0, 60.0)], down=[(MB, 0.0, 60.0)], busy=1e3, paced=True, timed_out=True)
    assert (known.up, known.down, known.busy, known.paced_rounds) == before


SINK = "test.sink"


async def sink(_ctx: CallContext, _args: Any, stream: Stream) -> None:
    while await stream.read(timeout=30.0) is not None:
        pass


async def beside(host: P2PHost, peers: list[str], stop: asyncio.Event, rate: float) -> None:
    """Traffic beside the rounds on the same connections (DHT records, states served): `rate`
    bytes/s to each of `peers` until `stop`."""
    streams = [await host.open_stream(p, SINK, timeout=10.0) for p in peers]
    chunk = b"x" * int(rate * 0.05)
    while not stop.is_set():
        await asyncio.gather(*(s.write(chunk) for s in streams))
        await asyncio.sleep(0.05)
    await asyncio.gather(*(s.end() for s in streams))


@pytest.mark.timeout(60)
async def test_a_round_that_waited_does_not_pace_the_next_by_the_traffic_beside_it() -> None:
    """Member 0 just restarted (it measured no round yet); the others' recent rounds give the
    group a 12 s part timeout. In this round member 0 waits 2 s for member 2, which starts late (a
    kill until a probe finds it gone, a paused process), while 20 KB/s a peer of other traffic
    flows beside the round: nothing runs out. Its bytes moved in a few of the round's windows, so
    its busy rate says how long it waited, not how fast its link is (0.7-0.9 MB/s here, on a link
    that moves GB/s; in a longer wait, the other traffic's rate): taken as the busy rate, it paced
    the next rounds at it (a 60-minute soak: the others waited 5 s for such a member's slices, and
    rounds took 17-42 s for 28 steps). The round measures no busy rate: the next is unpaced."""
    n, numel, late = 3, 300_000, 2.0
    async with averagers(n, AveragingConfig(chunk_elements=1 << 16, measure_bandwidth=True)) as made:
        for a in made:
            a.host.add_stream_handler(SINK, sink)
        for a in made[1:]:
            for seconds in (1.0, 4.0, 4.0, 4.0):  # 3 x 4 s: the group's part timeout is 12 s
                a.clock.observe(seconds)
        group = GroupInfo.create("run", 0, tuple(a.member_info(1.0) for a in made))
        gen = torch.Generator().manual_seed(3)
        vectors = [torch.randn(numel, generator=gen) for _ in range(n)]
        stop = asyncio.Event()
        others = [str(m.address()) for m in group.members if m.peer_id != made[0].host.peer_id]
        traffic = asyncio.ensure_future(beside(made[0].host, others, stop, 20e3))

        async def late_start() -> Any:
            await asyncio.sleep(late)
            return await made[2].run_round(group, [vectors[2]])

        try:
            await asyncio.gather(*(a.run_round(group, [v]) for a, v in zip(made[:2], vectors, strict=False)),
                                 late_start())  # fmt: skip
        finally:
            stop.set()
            await traffic
        assert made[0].link.busy is None, "a round that waited set the busy rate"
        assert made[0].link.pace() is None
        assert made[0].link.paced_rounds == 0  # an unpaced round that measured: the timeout did not run out
