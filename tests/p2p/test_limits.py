"""Connection-level limits an attacker cannot exhaust for everyone: the attacks run
for real from many source addresses across 127.0.0.0/8 (tests/p2p/attacks.py) while an honest
peer calls, plus the tables of the pure decisions (admission.py, budget.py)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from swarm.p2p import CallContext, ErrorCode, RemoteError, Stream
from swarm.p2p.admission import (
    Admission,
    HandshakeVerdict,
    PeerFacts,
    admit_handshake,
    choose_victim,
    plan_admission,
    source_of,
)
from swarm.p2p.budget import credit_to_grant, may_open_stream
from tests.p2p.attacks import Flood, buffered_on, connections_of, echo, honest_pings, sources, stream_flood
from tests.p2p.rawpeer import RawPeer
from tests.waiting import until

KiB, MiB = 1024, 1024 * 1024
PINGS = 25
MIN_ANSWERED = 24  # >= 95% of PINGS


class Sampler:
    """Records the largest value of `measure` while the `async with` runs."""

    def __init__(self, measure: Callable[[], Any]) -> None:
        self.measure, self.peak, self._task = measure, None, None

    async def _run(self) -> None:
        while True:
            value = self.measure()
            self.peak = value if self.peak is None else max(self.peak, value)
            await asyncio.sleep(0.01)

    async def __aenter__(self) -> Sampler:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


# --- attack 1: sockets that connect and never handshake -------------------------------------


async def test_silent_sockets_from_many_addresses_do_not_lock_out_honest_peers(make_host) -> None:
    server = await make_host(handshake_timeout=3.0)  # default caps: 64 pending, 8 per source
    server.add_handler("t.echo", echo)
    maddr = server.visible_maddrs[0]
    # 64 silent sockets, each back at once when the host drops it
    async with Flood(maddr, sources(1, 8), 8, handshake=False, pause=0.001) as flood:

        async def all_slots_held() -> None:  # so that every honest handshake has to take one
            await until(lambda: len(server._handshaking) >= 64, 10, "64 handshakes pending", poll=0.02)

        async with Sampler(lambda: len(server._gate.pending)) as pending:  # a dropped one is gone at once
            answered = await honest_pings(maddr, PINGS, before_each=all_slots_held)
    assert answered >= MIN_ANSWERED, f"{answered}/{PINGS} honest calls answered during the attack"
    assert pending.peak <= 64
    assert flood.stats.connected >= 64 + answered - 1  # each honest call took an attacker's slot


# --- attack 2: authenticated connections from throwaway identities ---------------------------


async def test_throwaway_identities_do_not_lock_out_honest_peers_nor_evict_useful_ones(make_host) -> None:
    server = await make_host(max_connections=48, handshake_timeout=3.0)  # 16 per source by default
    server.add_handler("t.echo", echo)
    maddr = server.visible_maddrs[0]
    known = await make_host()  # a peer that dials the server, which then calls it: useful
    known.add_handler("t.echo", echo)
    assert await known.call(maddr, "t.echo", 0, timeout=5) == 0
    assert await server.call(known.peer_id, "t.echo", 1, timeout=5) == 1
    known_conn = server._pool.best(known.peer_id)

    def per_source() -> int:
        return max(Counter(c.remote_address[0] for c in connections_of(server)).values())

    # 4 sources x 20 identities: each source is capped at 16, all together at 48
    async with Flood(maddr, sources(1, 4), 20, handshake=True) as flood:

        async def full() -> None:  # so that every honest connection has to take a slot
            await until(lambda: len(connections_of(server)) >= 48, 20, "48 connections", poll=0.02)

        async with Sampler(lambda: len(connections_of(server))) as open_conns, Sampler(per_source) as biggest:
            answered = await honest_pings(maddr, PINGS, before_each=full)
    assert answered >= MIN_ANSWERED, f"{answered}/{PINGS} honest calls answered during the attack"
    assert not known_conn.closed and server._pool.best(known.peer_id) is known_conn
    assert open_conns.peak <= 48 and biggest.peak <= 16
    assert flood.stats.connected > 48  # the flood kept coming back, and kept being let in


async def test_per_source_cap_makes_room_from_the_same_source_and_spares_exempt_ones(make_host) -> None:
    server = await make_host(max_connections_per_ip=2)  # 127.0.0.1 is exempt by default
    server.add_handler("t.echo", echo)
    maddr = server.visible_maddrs[0]
    capped = [await RawPeer.connect(maddr, source="127.0.9.1") for _ in range(3)]
    local = [await RawPeer.connect(maddr) for _ in range(3)]
    try:
        # The server sends its AUTH before it has checked ours, so a handshake that returned here
        # may be admitted there after the next one: wait for each admission, so that capped[0] is
        # the oldest (and idlest) of its source when capped[2] arrives.
        for peer in [*capped, *local]:
            await peer.handshake()
            held = peer.identity.peer_id
            await until(lambda: server._pool.to(held), 5, "the server holds the connection")  # noqa: B023
        assert await capped[0].closed_by_peer(timeout=5)  # the idlest of its source made room
        by_source = Counter(c.remote_address[0] for c in connections_of(server))
        assert by_source == {"127.0.9.1": 2, "127.0.0.1": 3}
    finally:
        for peer in [*capped, *local]:
            await peer.close()


# --- attack 3: streams whose handler does not read -------------------------------------------


async def test_streams_nobody_reads_pin_only_their_initial_window(make_host) -> None:
    limits = {"stream_window_bytes": 1 * MiB, "chunk_bytes": 256 * KiB}
    server, attacker = await make_host(**limits), await make_host(**limits)
    release, received = asyncio.Event(), Counter[int]()

    async def later(ctx: CallContext, args: Any, stream: Stream) -> None:  # as avg.part for an unknown group
        await release.wait()
        async for chunk in stream:
            received[id(stream)] += len(chunk)

    server.add_stream_handler("t.later", later)
    server.add_handler("t.echo", echo)
    maddr = server.visible_maddrs[0]
    flood = await stream_flood(attacker, maddr, "t.later", streams=64, nbytes=1 * MiB)
    bound = 64 * 256 * KiB  # streams x the default initial window: 16 MiB, not 64 x 1 MiB
    await until(
        lambda: buffered_on(server) >= bound or all(w.done() for _, w in flood), 10, "the buffers to fill", poll=0.02
    )
    async with Sampler(lambda: buffered_on(server)) as buffered:
        answered = await honest_pings(maddr, PINGS)
    assert buffered.peak <= bound, f"{buffered.peak / MiB:.1f} MiB buffered by handlers that do not read"
    assert answered >= MIN_ANSWERED
    release.set()  # the handlers read now: the windows grow and every write completes
    await asyncio.wait_for(asyncio.gather(*(w for _, w in flood)), 20)
    for stream, _ in flood:
        await stream.end()
        assert await stream.read(timeout=10) is None
    assert sorted(received.values()) == [1 * MiB] * 64
    (conn,) = connections_of(server)
    assert conn.budget.committed == 0  # every stream gave back what it held


async def test_reading_streams_share_one_budget_per_connection(make_host) -> None:
    limits = {"stream_window_bytes": 1 * MiB, "chunk_bytes": 128 * KiB, "stream_initial_window_bytes": 64 * KiB}
    server = await make_host(connection_buffer_bytes=1 * MiB, **limits)
    client = await make_host(**limits)
    received = Counter[int]()

    async def slow(ctx: CallContext, args: Any, stream: Stream) -> None:
        async for chunk in stream:
            received[id(stream)] += len(chunk)
            await asyncio.sleep(0.002)  # a reader slower than the wire: data waits in the budget

    server.add_stream_handler("t.slow", slow)
    flood = await stream_flood(client, server.visible_maddrs[0], "t.slow", streams=8, nbytes=4 * MiB)
    (conn,) = connections_of(server)
    async with Sampler(lambda: conn.budget.committed) as committed, Sampler(lambda: buffered_on(server)) as held:
        await asyncio.wait_for(asyncio.gather(*(w for _, w in flood)), 20)
    for stream, _ in flood:
        await stream.end()
        assert await stream.read(timeout=10) is None
    assert sorted(received.values()) == [4 * MiB] * 8  # nobody starved
    assert committed.peak <= 1 * MiB + 8 * 64 * KiB  # the budget plus the initial windows
    assert held.peak <= committed.peak
    assert conn.budget.committed == 0


async def test_stream_calls_beyond_the_limit_are_busy(make_host) -> None:
    server, client = await make_host(max_concurrent_streams=4), await make_host()
    release = asyncio.Event()

    async def wait(ctx: CallContext, args: Any, stream: Stream) -> None:
        await release.wait()

    server.add_stream_handler("t.wait", wait)
    server.add_handler("t.echo", echo)
    maddr = server.visible_maddrs[0]
    held = [await client.open_stream(maddr, "t.wait") for _ in range(4)]
    async with await client.open_stream(maddr, "t.wait") as extra:
        await extra.write(bytes(100 * KiB))  # dropped by the server: no stream to take it
        with pytest.raises(RemoteError) as info:
            await extra.read(timeout=5)
    assert info.value.code == ErrorCode.BUSY
    assert await client.call(maddr, "t.echo", "unary calls still run", timeout=5) == "unary calls still run"
    release.set()
    for stream in held:
        await stream.end()
        assert await stream.read(timeout=5) is None


async def test_past_the_host_stream_limit_a_flooder_is_busy_and_others_get_their_share(make_host) -> None:
    server, flooder, honest = await make_host(max_host_streams=8), await make_host(), await make_host()
    release = asyncio.Event()

    async def wait(ctx: CallContext, args: Any, stream: Stream) -> None:
        await release.wait()

    server.add_stream_handler("t.wait", wait)
    maddr = server.visible_maddrs[0]
    held = [await flooder.open_stream(maddr, "t.wait") for _ in range(8)]  # the host's whole limit
    await until(lambda: server._host_streams.open == 8, 5, "8 streams open", poll=0.02)
    async with await flooder.open_stream(maddr, "t.wait") as extra:
        with pytest.raises(RemoteError) as info:
            await extra.read(timeout=5)
    assert info.value.code == ErrorCode.BUSY  # it holds more than its share
    async with await honest.open_stream(maddr, "t.wait") as mine:  # below its share: served
        release.set()
        await mine.end()
        assert await mine.read(timeout=5) is None
    for stream in held:
        await stream.end()
        assert await stream.read(timeout=5) is None
    await until(lambda: server._host_streams.open == 0, 5, "every stream closed", poll=0.02)


# --- the pure decisions, as tables ------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "source"),
    [
        ("127.0.0.5", "127.0.0.5"),
        ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),  # one machine may own a whole /64
        ("2001:db8:1:2::9", "2001:db8:1:2::/64"),
        ("::ffff:10.1.2.3", "10.1.2.3"),  # an IPv4 peer on a dual-stack socket
        ("fe80::1%eth0", "fe80::/64"),
        ("not an ip", "not an ip"),
    ],
)
def test_source_of(address: str, source: str) -> None:
    assert source_of(address) == source


@pytest.mark.parametrize(
    ("pending", "newcomer", "verdict"),
    [
        ([], "a", HandshakeVerdict(admit=True)),
        ([("a", 0), ("a", 1)], "a", HandshakeVerdict(admit=False)),  # its source is at its cap
        ([("a", 0), ("b", 1), ("c", 2)], "d", HandshakeVerdict(admit=True)),  # room left
        ([("b", 0), ("a", 1), ("a", 2), ("c", 3)], "d", HandshakeVerdict(admit=True, drop_oldest_of="a")),
        ([("a", 1), ("b", 0.5), ("c", 2), ("d", 3)], "e", HandshakeVerdict(admit=True, drop_oldest_of="b")),
        ([("a", 0), ("a", 1), ("b", 2), ("c", 3)], "b", HandshakeVerdict(admit=True, drop_oldest_of="a")),
        ([("a", 0), ("b", 1), ("c", 2), ("d", 3)], "a", HandshakeVerdict(admit=False)),  # all hold as few
        ([("a", 0), ("a", 1), ("b", 2), ("b", 3)], "b", HandshakeVerdict(admit=False)),
    ],
    ids=["empty", "source-cap", "room", "biggest-yields", "tie-oldest", "fairer", "all-equal", "cap-at-full"],
)
def test_admit_handshake(pending: list[tuple[str, float]], newcomer: str, verdict: HandshakeVerdict) -> None:
    assert admit_handshake(pending, newcomer, per_source=2, total=4) == verdict


def facts(key: int, source: str = "s", **kw: Any) -> PeerFacts:
    defaults = {"inbound": True, "useful": False, "ours_in_flight": False, "theirs_in_flight": False, "idle_s": 1.0}
    return PeerFacts(key=key, source=source, **{**defaults, **kw})


@pytest.mark.parametrize(
    ("candidates", "for_useful", "victim"),
    [
        ([], False, None),
        ([facts(0, useful=True)], False, None),  # we called it: kept
        ([facts(0, inbound=False)], False, None),  # we dialed it: kept
        ([facts(0, ours_in_flight=True)], True, None),  # our call runs on it: kept
        ([facts(0, theirs_in_flight=True)], False, None),  # serving it: kept for an unknown newcomer
        ([facts(0, theirs_in_flight=True)], True, 0),  # ... but not for a useful one
        ([facts(0, idle_s=5), facts(1, idle_s=1)], False, 0),  # the idlest
        ([facts(0, "x", idle_s=1), facts(1, "x", idle_s=0.5), facts(2, "y", idle_s=100)], False, 0),  # biggest source
        ([facts(0, theirs_in_flight=True, idle_s=9), facts(1, idle_s=0)], True, 1),  # idle before serving
        ([facts(0, useful=True, idle_s=99), facts(1, "y", idle_s=0)], False, 1),  # useful kept over a fresh one
    ],
)
def test_choose_victim(candidates: list[PeerFacts], for_useful: bool, victim: int | None) -> None:
    chosen = choose_victim(candidates, for_useful=for_useful)
    assert (None if chosen is None else chosen.key) == victim


@pytest.mark.parametrize(
    ("connections", "newcomer", "admit", "evict"),
    [
        ([facts(0, "a"), facts(1, "b")], facts(9, "c"), True, None),  # under both caps
        ([facts(0, "a", idle_s=3), facts(1, "a")], facts(9, "a"), True, 0),  # source cap: its idlest goes
        ([facts(0, "a", useful=True), facts(1, "a", useful=True)], facts(9, "a"), False, None),
        ([facts(0, "a", inbound=False), facts(1, "a", inbound=False)], facts(9, "a"), True, None),  # ours
        ([facts(0, "a"), facts(1, "a", inbound=False), facts(2, "b")], facts(9, "c"), True, 0),  # total cap
        ([facts(0, "a", useful=True), facts(1, "b", ours_in_flight=True), facts(2, "c", inbound=False)],
         facts(9, "d"), False, None),  # all kept: the newcomer is refused
        ([facts(0, "a", theirs_in_flight=True), facts(1, "b", useful=True), facts(2, "c", useful=True)],
         facts(9, "d", useful=True), True, 0),  # a useful newcomer displaces a busy unknown peer
    ],
)  # fmt: skip
def test_plan_admission(connections: list[PeerFacts], newcomer: PeerFacts, admit: bool, evict: int | None) -> None:
    plan = plan_admission(connections, newcomer, per_source=2, total=3)
    assert isinstance(plan, Admission) and plan.admit == admit
    assert (None if plan.evict is None else plan.evict.key) == evict
    assert plan.admit or plan.reason


@pytest.mark.parametrize(
    ("open_streams", "mine", "holders", "allowed"),
    [
        (3, 3, 1, True),  # below the limit
        (8, 8, 1, False),  # at the limit, holding all of it
        (8, 0, 1, True),  # a newcomer's share is 8 / 2
        (9, 1, 2, True),
        (12, 4, 2, False),  # its share is used up
        (16, 0, 16, True),  # everyone may hold one
        (16, 1, 16, False),
    ],
)
def test_may_open_stream(open_streams: int, mine: int, holders: int, allowed: bool) -> None:
    assert may_open_stream(open_streams=open_streams, mine=mine, holders=holders, limit=8) == allowed


@pytest.mark.parametrize(
    ("outstanding", "budget_free", "grant"),
    [
        (1000, 5000, 0),  # the window is full
        (0, 5000, 1000),  # a reader with nothing: the whole window
        (0, 0, 100),  # no budget left: the initial window still
        (40, -500, 60),  # over budget: topped up to the initial window, no more
        (80, 0, 0),  # 20 bytes would be a CREDIT frame for nothing: wait until it runs low
        (700, 5000, 300),  # a quarter window or more: granted
        (800, 5000, 0),  # less: batched
        (500, 100, 0),  # the budget allows only a sliver: wait for more
        (500, 400, 400),
    ],
)
def test_credit_to_grant(outstanding: int, budget_free: int, grant: int) -> None:
    assert credit_to_grant(outstanding=outstanding, window=1000, floor=100, budget_free=budget_free) == grant


def test_a_flood_logs_a_few_lines_and_says_how_many_it_held_back(caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import time

    from swarm.utils.log_once import RateLimitedLog

    log = RateLimitedLog(logging.getLogger("flood-test"), burst=3, period=3600)
    with caplog.at_level(logging.WARNING, logger="flood-test"):
        logged = [log.log("refused", "refusing %d", i) for i in range(1000)]
    assert sum(logged) == 3 and len(caplog.records) == 3
    # the period is over (monotonic time counts from boot: a fresh machine is < 3600 s in)
    log._windows["refused"] = (time.monotonic() - 3601, 3, 997)  # the next line says what was held back
    with caplog.at_level(logging.WARNING, logger="flood-test"):
        assert log.log("refused", "refusing %d", 1000)
    assert "997 more like it held back" in caplog.records[-1].getMessage()
