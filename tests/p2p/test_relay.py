"""Circuit relays in one event loop on 127.0.0.1: a relayed peer is called and streamed to like a
direct one, and a relay that refuses, floods, runs out of limits, alters bytes or lies about who
is at the other end is caught with a typed error (relay.py, relay_client.py, circuit.py)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.p2p import CallContext, P2PHost, PeerID, RemoteError, Stream
from swarm.p2p.errors import (
    BadRequest,
    CircuitClosed,
    ConnectionLost,
    HandshakeError,
    NoReservation,
    PeerIDMismatch,
    ProtocolError,
    RelayRefused,
)
from swarm.p2p.maddr import CircuitAddress, parse_maddr
from swarm.p2p.relay import RelayConfig, RelayService, Reservations
from swarm.p2p.relay_client import RelayKeeper
from swarm.p2p.relay_wire import RESERVE, VERSION, decode_opening, decode_reservation, decode_stop
from swarm.p2p.wire import Kind
from tests.p2p.rawpeer import RawPeer
from tests.waiting import until

Factory = Callable[..., Any]


async def echo(ctx: CallContext, args: Any) -> Any:
    return {"echo": args, "from": str(ctx.peer_id), "via": ctx.remote_address[0]}


async def stream_echo(ctx: CallContext, args: Any, stream: Stream) -> None:
    async for chunk in stream:
        await stream.write(bytes(chunk))


class Trio:
    """A relay, a target that holds a reservation on it, and a dialer."""

    def __init__(self, relay: P2PHost, service: RelayService, target: P2PHost, keeper: RelayKeeper, dialer: P2PHost):
        self.relay, self.service, self.target, self.keeper, self.dialer = relay, service, target, keeper, dialer

    @property
    def relayed(self) -> str:
        assert self.keeper.current is not None
        return self.keeper.current.to_maddr()


@pytest.fixture
async def trio(make_host: Factory) -> AsyncIterator[Callable[..., Any]]:
    closers: list[Any] = []

    async def build(config: RelayConfig | None = None, service_class: type[RelayService] = RelayService) -> Trio:
        relay, target, dialer = await make_host(), await make_host(), await make_host()
        service = await service_class(relay, config).start()
        keeper = await RelayKeeper(target, [relay.visible_maddrs[0]]).start()
        closers.extend([keeper, service])
        target.add_handler("demo.echo", echo)
        target.add_stream_handler("demo.stream", stream_echo)
        await keeper.wait_reserved(timeout=10)
        return Trio(relay, service, target, keeper, dialer)

    yield build
    for closer in closers:
        await closer.close()


@pytest.mark.timeout(30)
async def test_a_relayed_peer_answers_calls_and_streams_like_a_direct_one(trio: Callable[..., Any]) -> None:
    t = await trio()
    relayed = t.relayed
    assert relayed in t.target.visible_maddrs
    assert relayed.endswith(f"/p2p/{t.relay.peer_id}/p2p-circuit/p2p/{t.target.peer_id}")
    reply = await t.dialer.call(relayed, "demo.echo", {"x": 1}, timeout=10)
    # the target authenticated the dialer end to end, and knows the call came through the relay
    assert reply == {"echo": {"x": 1}, "from": str(t.dialer.peer_id), "via": f"{t.relay.peer_id}/p2p-circuit"}
    # the same connection serves the next call, by PeerID too
    assert (await t.dialer.call(t.target.peer_id, "demo.echo", 2, timeout=10))["echo"] == 2
    payload = os.urandom(3 * 1024 * 1024 + 17)
    async with await t.dialer.open_stream(relayed, "demo.stream", timeout=10) as stream:
        await stream.write(payload)
        await stream.end()
        got = await stream.read_all(max_bytes=len(payload) + 1)
    assert bytes(got) == payload
    assert t.service.relayed_bytes > 2 * len(payload)  # it went through the relay, both ways
    assert t.service.circuits == 1


@pytest.mark.timeout(30)
async def test_a_relayed_byte_counts_once_in_its_ends_traffic(trio: Callable[..., Any]) -> None:
    """host.traffic is what the host's sockets carried: a relayed connection's sealed frames reach
    the socket inside the relay stream's frames, so they count there once, and apart in
    host.relayed_traffic (a benchmark's relay share is read from these)."""
    t = await trio()
    payload = os.urandom(4 * 1024 * 1024)
    await t.dialer.call(t.relayed, "demo.echo", 0, timeout=10)
    sent, received = t.dialer.traffic.sent, t.target.traffic.received
    async with await t.dialer.open_stream(t.relayed, "demo.stream", timeout=10) as stream:
        await stream.write(payload)
        await stream.end()
        got = await stream.read_all(max_bytes=len(payload) + 1)
    assert len(got) == len(payload)
    for counted in (t.dialer.traffic.sent - sent, t.target.traffic.received - received):
        assert len(payload) <= counted <= 1.1 * len(payload), counted  # twice, before: 8.4 MB
    for inner in (t.dialer.relayed_traffic.sent, t.target.relayed_traffic.received):
        assert len(payload) <= inner <= 1.1 * len(payload), inner
    assert t.relay.relayed_traffic.sent == t.relay.relayed_traffic.received == 0  # it relays; none is its own


@pytest.mark.timeout(30)
async def test_a_circuit_to_a_peer_without_reservation_is_refused(trio: Callable[..., Any], make_host: Factory) -> None:
    t = await trio()
    stranger = await make_host()
    address = CircuitAddress(parse_maddr(t.relay.visible_maddrs[0]), stranger.peer_id)
    with pytest.raises(NoReservation, match="holds no reservation"):
        await t.dialer.call(address.to_maddr(), "demo.echo", 1, timeout=10)
    assert t.service.circuits == 0


@pytest.mark.timeout(60)
async def test_a_reservation_flood_stays_within_the_caps(trio: Callable[..., Any], make_host: Factory) -> None:
    """Fresh identities from one source (127.0.0.2) get at most the per-source cap; more from two
    other sources (127.0.1.1-2) fill the total cap and then take the biggest source's newest slot,
    never the honest source's only one; an honest newcomer still gets in, taking a flooder's slot.
    (An attacker with as many addresses as slots fills them all: admission.py admits the same.)"""
    t = await trio(RelayConfig(max_reservations=8, max_reservations_per_ip=3))
    relay_maddr = t.relay.visible_maddrs[0]

    async def reserve(source: str) -> bool:
        peer = await RawPeer.connect(relay_maddr, source=source)
        try:
            await peer.handshake()
            peer.send_frame({"k": Kind.CALL, "i": 1, "m": RESERVE, "a": {"v": VERSION}, "s": False})
            head, _ = await peer.read_frame()
            return head["k"] == Kind.REPLY
        finally:
            held.append(peer)  # a reservation lives as long as its connection

    held: list[RawPeer] = []
    try:
        for _ in range(12):
            await reserve("127.0.0.2")
            assert t.service.reservations.by_source()["127.0.0.2"] <= 3  # the per-source cap
        assert t.service.reservations.by_source()["127.0.0.2"] == 3
        for i in range(30):
            await reserve(f"127.0.1.{i % 2 + 1}")
            counts = t.service.reservations.by_source()
            assert len(t.service.reservations) <= 8 and max(counts.values()) <= 3
            assert counts["127.0.0.1"] == 1, "the honest target's reservation was taken"
        honest = await make_host()
        keeper = await RelayKeeper(honest, [relay_maddr]).start()
        try:
            await keeper.wait_reserved(timeout=10)  # from 127.0.0.1, which holds 1
        finally:
            await keeper.close()
        assert (await t.dialer.call(t.relayed, "demo.echo", 1, timeout=10))["echo"] == 1
    finally:
        for peer in held:
            await peer.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("limit", ["bytes", "seconds"])
async def test_a_circuit_at_its_limit_is_closed_at_both_ends(trio: Callable[..., Any], limit: str) -> None:
    config = RelayConfig(circuit_bytes=256 * 1024) if limit == "bytes" else RelayConfig(circuit_seconds=1.5)
    t = await trio(config)
    assert (await t.dialer.call(t.relayed, "demo.echo", 1, timeout=10))["echo"] == 1
    target_side = await until(lambda: t.target._pool.best(t.dialer.peer_id), 5, "the target's end")
    stream = await t.dialer.open_stream(t.relayed, "demo.stream", timeout=10)
    with pytest.raises(CircuitClosed, match="limit of 262144 bytes" if limit == "bytes" else "time limit of 1.5s"):
        while True:  # the echo keeps both directions busy until the relay cuts the circuit
            await stream.write(os.urandom(32 * 1024))
            await stream.read(timeout=5)
    await asyncio.wait_for(target_side.wait_closed(), 5)
    assert isinstance(target_side.lost_reason, CircuitClosed) and "limit" in str(target_side.lost_reason)
    # the next call opens a fresh circuit
    assert (await t.dialer.call(t.relayed, "demo.echo", 2, timeout=10))["echo"] == 2


class FlippingRelay(RelayService):
    """Flips one bit of every chunk it passes after the handshake's two frames."""

    async def _splice(self, ours: Stream, theirs: Stream, limits: Any) -> None:
        await super()._splice(_Flipping(ours), _Flipping(theirs), limits)  # type: ignore[arg-type]


class _Flipping:
    def __init__(self, stream: Stream) -> None:
        self._stream, self._seen = stream, 0

    async def read(self, *, timeout: float | None = None) -> Any:
        chunk = await self._stream.read(timeout=timeout)
        if chunk is not None:
            self._seen += len(chunk)
            if self._seen > 1024:  # past HELLO and AUTH: sealed frames
                chunk = bytearray(chunk)
                chunk[-1] ^= 0x01
        return chunk

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@pytest.mark.timeout(30)
async def test_a_relay_that_alters_bytes_breaks_the_session_never_the_data(
    trio: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    t = await trio(service_class=FlippingRelay)
    with pytest.raises((ConnectionLost, HandshakeError)):
        for i in range(20):  # the first altered frame fails to open; nothing altered is delivered
            reply = await t.dialer.call(t.relayed, "demo.echo", {"i": i, "pad": "x" * 2000}, timeout=5)
            assert reply["echo"] == {"i": i, "pad": "x" * 2000}
    assert any("frame failed authentication" in r.getMessage() for r in caplog.records)


class LyingRelay(RelayService):
    """Routes every circuit to the peer of its choice, whatever the dialer asked for."""

    liar_target: PeerID | None = None

    def _pick_target(self, wanted: PeerID) -> PeerID:
        assert self.liar_target is not None
        return self.liar_target


@pytest.mark.timeout(30)
async def test_a_relay_lying_about_the_far_end_fails_the_peer_id_check(
    trio: Callable[..., Any], make_host: Factory
) -> None:
    t = await trio(service_class=LyingRelay)
    assert isinstance(t.service, LyingRelay)
    t.service.liar_target = t.target.peer_id
    victim = await make_host()  # the dialer wants this peer, the relay brings it the target
    address = CircuitAddress(parse_maddr(t.relay.visible_maddrs[0]), victim.peer_id)
    with pytest.raises(PeerIDMismatch, match=f"dialed {victim.peer_id}"):
        await t.dialer.call(address.to_maddr(), "demo.echo", 1, timeout=10)
    assert not t.target.connected_peers() or t.dialer.peer_id not in t.target.connected_peers()


class NamingRelay(RelayService):
    """Tells every target that the circuit comes from a peer of its choice."""

    claimed: PeerID | None = None

    async def _stop(self, circuit_id: bytes, dialer: PeerID, dialer_at: Any, pending: Any) -> Stream:
        assert self.claimed is not None
        return await super()._stop(circuit_id, self.claimed, dialer_at, pending)


@pytest.mark.timeout(30)
async def test_a_relay_lying_to_the_target_about_the_dialer_fails_the_targets_check(
    trio: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    t = await trio(service_class=NamingRelay)
    assert isinstance(t.service, NamingRelay)
    t.service.claimed = PeerID.from_public_key(bytes([7]) * 32)  # someone the target might trust more
    with pytest.raises((HandshakeError, ConnectionLost)):
        await t.dialer.call(t.relayed, "demo.echo", 1, timeout=10)
    assert t.dialer.peer_id not in t.target.connected_peers()
    assert any(f"the relay announced {t.service.claimed}" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(30)
async def test_the_reservation_moves_to_another_relay_when_its_relay_dies(make_host: Factory) -> None:
    first, second, target, dialer = await make_host(), await make_host(), await make_host(), await make_host()
    services = [await RelayService(first).start(), await RelayService(second).start()]
    target.add_handler("demo.echo", echo)
    keeper = await RelayKeeper(target, [first.visible_maddrs[0], second.visible_maddrs[0]]).start()
    try:
        now = await keeper.wait_reserved(timeout=10)
        assert set(keeper.rtts) == {first.visible_maddrs[0], second.visible_maddrs[0]}
        dead, alive = (first, second) if now.relay.peer_id == first.peer_id else (second, first)
        await dead.close()
        moved = await until(
            lambda: keeper.current if keeper.current and keeper.current.relay.peer_id == alive.peer_id else None,
            15,
            "a reservation on the other relay",
        )
        assert moved.to_maddr() in target.visible_maddrs and now.to_maddr() not in target.visible_maddrs
        assert (await dialer.call(moved.to_maddr(), "demo.echo", 3, timeout=10))["echo"] == 3
    finally:
        await keeper.close()
        for service in services:
            await service.close()


@pytest.mark.timeout(30)
async def test_reserving_is_refused_when_the_relay_serves_none(make_host: Factory) -> None:
    plain, target = await make_host(), await make_host()
    keeper = await RelayKeeper(target, [plain.visible_maddrs[0]]).start()
    try:
        began = asyncio.get_running_loop().time()
        with pytest.raises(RelayRefused, match="no relay of 1 took a reservation: each refused"):
            await keeper.wait_reserved(timeout=20.0)
        # a refusal ends the wait at once: a node behind NAT with no relay falls back to client
        # mode in a second, not after the whole wait (its peers may have finished by then)
        assert asyncio.get_running_loop().time() - began < 5.0
    finally:
        await keeper.close()


A, B, C = (PeerID.from_public_key(bytes([i]) * 32) for i in (1, 2, 3))


def test_the_reservation_table_caps_per_source_and_in_all_and_renews_in_place() -> None:
    table = Reservations(per_source=2, total=3)
    assert table.reserve(A, "10.0.0.1", now=0, ttl=10) and table.reserve(B, "10.0.0.1", now=1, ttl=10)
    assert not table.reserve(C, "10.0.0.1", now=2, ttl=10)  # the per-source cap
    assert table.reserve(A, "10.0.0.1", now=5, ttl=10) and len(table) == 2  # a renewal keeps its slot
    assert table.reserve(C, "10.0.0.2", now=6, ttl=10) and len(table) == 3
    newcomer = PeerID.from_public_key(bytes([4]) * 32)
    # at the total cap a newcomer from a source holding less takes the newest slot of the biggest source
    assert table.reserve(newcomer, "10.0.0.3", now=7, ttl=10)
    assert (
        not table.holds(B, now=7)
        and table.holds(A, now=7)
        and table.by_source()
        == {
            "10.0.0.1": 1,
            "10.0.0.2": 1,
            "10.0.0.3": 1,
        }
    )
    fifth = PeerID.from_public_key(bytes([5]) * 32)
    assert not table.reserve(fifth, "10.0.0.3", now=8, ttl=10)  # its source holds as many as any: nobody yields
    assert not table.holds(C, now=16.5)  # expired
    table.purge(now=16.5, live={A, newcomer})
    assert table.by_source() == {"10.0.0.3": 1}  # A expired at 15; C expired and is gone
    exempt = Reservations(per_source=1, total=3, exempt=("127.0.0.1",))
    assert all(exempt.reserve(p, "127.0.0.1", now=0, ttl=10) for p in (A, B, C))


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"max_reservations": 0}, "max_reservations must be positive"),
        ({"circuit_bytes": -1}, "circuit_bytes must be positive"),
        ({"circuit_seconds": 10**9}, "circuit limits out of range"),
        ({"stop_timeout_s": 0}, "stop_timeout_s must be positive"),
    ],
)
def test_a_bad_relay_config_is_refused(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        RelayConfig(**fields)


@pytest.mark.timeout(30)
async def test_a_reservation_is_renewed_before_it_expires(trio: Callable[..., Any]) -> None:
    t = await trio(RelayConfig(reservation_ttl_s=1.0))
    assert t.keeper.reservation is not None and t.keeper.reservation.ttl == 1.0
    await asyncio.sleep(2.5)  # two and a half lives: only renewals keep it
    assert t.service.reservations.holds(t.target.peer_id, asyncio.get_running_loop().time())
    assert (await t.dialer.call(t.relayed, "demo.echo", 1, timeout=10))["echo"] == 1


@pytest.mark.timeout(30)
async def test_a_relay_that_dies_ends_its_circuits_at_once_with_a_typed_error(trio: Callable[..., Any]) -> None:
    t = await trio()
    stream = await t.dialer.open_stream(t.relayed, "demo.stream", timeout=10)
    await stream.write(b"x")
    assert await stream.read(timeout=5) == b"x"
    began = asyncio.get_running_loop().time()
    await t.relay.close()
    with pytest.raises(ConnectionLost):  # not a timeout: the circuit's end is seen as it happens
        await stream.read(timeout=20)
    assert asyncio.get_running_loop().time() - began < 5
    await until(lambda: t.keeper.current is None, 10, "the keeper to drop the dead relay's address")
    assert not any("/p2p-circuit/" in m for m in t.target.visible_maddrs)


@pytest.mark.timeout(30)
async def test_circuits_to_oneself_or_over_a_circuit_are_refused(trio: Callable[..., Any]) -> None:
    t = await trio()
    to_itself = CircuitAddress(parse_maddr(t.relay.visible_maddrs[0]), t.target.peer_id)
    with pytest.raises(RelayRefused, match="a circuit to oneself"):
        await t.target.call(to_itself.to_maddr(), "demo.echo", 1, timeout=10)
    # the target reaches the dialer's relay services only through its circuit: no relay over a relay
    second = await RelayService(t.target).start()
    try:
        assert (await t.dialer.call(t.relayed, "demo.echo", 1, timeout=10))["echo"] == 1
        (relayed,) = t.dialer.connections_to(t.target.peer_id)
        with pytest.raises(RemoteError, match="must come on a direct connection"):
            await relayed.call(RESERVE, {"v": VERSION}, 5)
    finally:
        await second.close()


@pytest.mark.timeout(30)
async def test_circuits_past_the_relays_caps_are_refused_and_the_open_ones_carry_on(
    trio: Callable[..., Any], make_host: Factory
) -> None:
    t = await trio(RelayConfig(max_circuits_per_peer=1))
    assert (await t.dialer.call(t.relayed, "demo.echo", 1, timeout=10))["echo"] == 1
    second = await make_host()  # one circuit to the target is open: its cap
    with pytest.raises(RelayRefused, match="circuits open for this pair's peers"):
        await second.call(t.relayed, "demo.echo", 2, timeout=10)
    assert (await t.dialer.call(t.relayed, "demo.echo", 3, timeout=10))["echo"] == 3
    assert t.service.circuits == 1


_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=40),
    st.binary(max_size=40),
    st.sampled_from(["/ip4/10.0.0.1/tcp/5", "/ip4/1.2.3/tcp/5", "/dns4/x/tcp/1", "/ip6/::1/tcp/70000"]),
    st.just(bytes(16)),
    st.just(A.to_bytes()),
)
_messages = st.one_of(
    _values,
    st.dictionaries(
        st.sampled_from(["v", "ttl", "limit_bytes", "limit_s", "observed", "peer_observed", "circuit", "peer"]),
        st.one_of(_values, st.just(1)),
        max_size=8,
    ),
)


@settings(max_examples=300, deadline=None)
@given(_messages)
def test_relay_messages_from_a_peer_decode_or_fail_with_a_typed_error(message: Any) -> None:
    """What a relay or a dialer sends is checked field by field: it decodes, or it raises the
    protocol's own errors (BadRequest on the serving side, ProtocolError on the asking side)."""
    for decode, errors in (
        (decode_stop, (BadRequest,)),
        (decode_opening, (ProtocolError,)),
        (decode_reservation, (ProtocolError,)),
    ):
        try:
            decoded = decode(message)
        except errors:
            continue
        assert decoded.limits.bytes > 0 and decoded.limits.seconds > 0
