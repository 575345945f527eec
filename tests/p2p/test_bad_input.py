"""Bad input from peers: each gets a clear error or a closed connection and a log line, and the
host keeps serving everyone else throughout."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.p2p import CallContext, ErrorCode, Identity, P2PHost
from swarm.p2p import host as host_module
from swarm.p2p.wire import FRAME_PREFIX, Kind, encode_head
from tests.p2p.conftest import local_config
from tests.p2p.rawpeer import RawPeer, frame


async def echo(ctx: CallContext, args: Any) -> Any:
    return args


async def still_serves(server: P2PHost) -> None:
    async with P2PHost(config=local_config()) as client:
        assert await client.call(server.visible_maddrs[0], "t.echo", "ok", timeout=5) == "ok"


@pytest.fixture
async def server(make_host) -> P2PHost:
    host = await make_host(
        max_head_bytes=64 * 1024,
        max_body_bytes=1 << 20,
        stream_window_bytes=1 << 20,
        chunk_bytes=1 << 18,
        handshake_timeout=1.0,
    )
    host.add_handler("t.echo", echo)
    return host


async def test_random_bytes_instead_of_a_handshake(server: P2PHost, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="swarm.p2p"):
        peer = await RawPeer.connect(server.visible_maddrs[0])
        peer.send(os.urandom(4096))
        assert await peer.closed_by_peer()
        await peer.close()
        await still_serves(server)
    assert "handshake" in caplog.text


async def test_silent_connection_times_out_in_the_handshake(server: P2PHost, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="swarm.p2p"):
        peer = await RawPeer.connect(server.visible_maddrs[0])
        assert await peer.closed_by_peer(timeout=5)  # handshake_timeout is 1 s
        await peer.close()
    assert "timed out" in caplog.text


async def test_forged_signature_is_refused(server: P2PHost, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="swarm.p2p"):
        peer = await RawPeer.connect(server.visible_maddrs[0])
        await peer.handshake(sign_with=Identity.generate())  # claims one key, signs with another
        assert await peer.closed_by_peer()
        await peer.close()
    assert "failed to prove" in caplog.text
    await still_serves(server)


async def test_valid_handshake_then_garbage_frames(server: P2PHost, caplog) -> None:
    bad_frames: list[Callable[[RawPeer], bytes]] = [  # each one properly encrypted unless said
        lambda p: os.urandom(64),  # garbage prefix and head (fails authentication)
        lambda p: p.seal(b"\xc1\xc1\xc1\xc1\xc1"),  # not msgpack
        lambda p: p.seal({"k": 99, "i": 2}),  # unknown kind
        lambda p: p.seal({"k": Kind.CALL, "i": 2}),  # CALL without a method (and from the wrong id range)
        lambda p: p.seal({"k": Kind.CALL, "i": 1, "m": 5, "a": None}),  # method of the wrong type
        lambda p: p.seal({"k": Kind.HELLO, "i": 0}),  # a second handshake
        lambda p: p.seal({"k": Kind.CREDIT, "i": 1, "n": -5}),  # nonsense credit
        lambda p: FRAME_PREFIX.pack(0, 0),  # empty head
        lambda p: p.seal(encode_head(["not", "a", "map"])),  # type: ignore[arg-type]
        lambda p: frame({"k": Kind.CALL, "i": 1, "m": "t.echo", "a": None, "s": False}) + bytes(16),  # clear, fake tag
    ]
    with caplog.at_level(logging.WARNING, logger="swarm.p2p"):
        for make_frame in bad_frames:
            peer = await RawPeer.connect(server.visible_maddrs[0])
            assert (await peer.handshake())["k"] == Kind.AUTH
            data = make_frame(peer)
            peer.send(data)
            assert await peer.closed_by_peer(), data
            await peer.close()
        await still_serves(server)
    assert caplog.text.count("closed connection") >= len(bad_frames) - 1


async def test_frame_over_the_size_limit_closes_the_connection(server: P2PHost, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="swarm.p2p"):
        peer = await RawPeer.connect(server.visible_maddrs[0])
        await peer.handshake()
        peer.send(FRAME_PREFIX.pack(100, 2**31))  # announces a 2 GiB body: refused before allocating
        assert await peer.closed_by_peer()
        await peer.close()
        await still_serves(server)
    assert "exceeds the limit" in caplog.text


async def test_truncated_frame_then_hang_up(server: P2PHost) -> None:
    peer = await RawPeer.connect(server.visible_maddrs[0])
    await peer.handshake()
    whole = peer.seal({"k": Kind.CALL, "i": 1, "m": "t.echo", "a": "x", "s": False})
    peer.send(whole[: len(whole) // 2])
    await peer.close()
    await still_serves(server)


async def test_data_beyond_the_window_is_a_protocol_violation(server: P2PHost, caplog) -> None:
    async def sink(ctx: CallContext, args: Any, stream: Any) -> None:
        await asyncio.sleep(5)

    server.add_stream_handler("t.sink", sink)
    with caplog.at_level(logging.WARNING, logger="swarm.p2p"):
        peer = await RawPeer.connect(server.visible_maddrs[0])
        await peer.handshake()
        peer.send_frame({"k": Kind.CALL, "i": 1, "m": "t.sink", "a": None, "s": True})
        for _ in range(2 * (1 << 20) // (1 << 18) + 1):  # the window is 1 MiB; send 2 MiB+
            peer.send_frame({"k": Kind.DATA, "i": 1}, bytes(1 << 18))
        assert await peer.closed_by_peer()
        await peer.close()
    assert "beyond the stream window" in caplog.text


async def test_wrong_payload_types_get_bad_request_not_a_crash(server: P2PHost) -> None:
    from swarm.p2p import BadRequest

    async def add(ctx: CallContext, args: Any) -> int:
        if not (isinstance(args, list) and len(args) == 2 and all(type(x) is int for x in args)):
            raise BadRequest("expected [int, int]")
        return args[0] + args[1]

    server.add_handler("t.add", add)
    peer = await RawPeer.connect(server.visible_maddrs[0])
    await peer.handshake()
    for call_id, args in enumerate([None, "ab", [1], [1, "2"], {"a": 1}, [1.5, 2]], start=0):
        peer.send_frame({"k": Kind.CALL, "i": 2 * call_id + 1, "m": "t.add", "a": args, "s": False})
        head, _ = await peer.read_frame()
        assert head["k"] == Kind.ERROR and head["c"] == ErrorCode.BAD_REQUEST, args
    peer.send_frame({"k": Kind.CALL, "i": 99, "m": "t.add", "a": [2, 3], "s": False})
    assert (await peer.read_frame())[0]["r"] == 5
    await peer.close()


async def test_hundreds_of_connections_are_bounded(make_host, caplog) -> None:
    server = await make_host(max_pending_handshakes=32, handshake_timeout=2.0)
    server.add_handler("t.echo", echo)
    with caplog.at_level(logging.WARNING, logger="swarm.p2p"):
        peers = await asyncio.gather(*(RawPeer.connect(server.visible_maddrs[0]) for _ in range(300)))
        await asyncio.sleep(0.2)
        assert len(server._handshaking) <= 32
        refused = sum(await asyncio.gather(*(p.closed_by_peer(timeout=0.5) for p in peers)))
        assert refused >= 300 - 32
        for p in peers:
            await p.close()
        await asyncio.sleep(0.1)
        await still_serves(server)
    assert "refusing connection" in caplog.text


async def test_hundreds_of_requests_from_one_peer_are_bounded(make_host) -> None:
    server = await make_host(max_concurrent_calls=16)
    release = asyncio.Event()

    async def wait(ctx: CallContext, args: Any) -> int:
        await release.wait()
        return 1

    server.add_handler("t.wait", wait)
    server.add_handler("t.echo", echo)
    peer = await RawPeer.connect(server.visible_maddrs[0])
    await peer.handshake()
    for i in range(500):
        peer.send_frame({"k": Kind.CALL, "i": 2 * i + 1, "m": "t.wait", "a": None, "s": False})
    busy = 0
    for _ in range(500 - 16):
        head, _ = await peer.read_frame()
        busy += head["k"] == Kind.ERROR and head["c"] == ErrorCode.BUSY
    assert busy == 500 - 16
    await still_serves(server)  # another peer is not starved by this one
    release.set()
    await peer.close()


frames_strategy = st.one_of(  # raw bytes are sent as they are, (head, body) pairs as frames
    st.binary(min_size=1, max_size=300),
    st.tuples(
        st.dictionaries(
            st.sampled_from(["k", "i", "m", "a", "s", "n", "c", "e", "r"]),
            st.one_of(
                st.integers(-5, 2**33),
                st.text(max_size=20),
                st.binary(max_size=20),
                st.none(),
                st.booleans(),
                st.lists(st.integers(-(2**63), 2**64 - 1), max_size=3),
            ),
            max_size=6,
        ),
        st.binary(max_size=64),
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.lists(frames_strategy, min_size=1, max_size=6), authenticate=st.booleans())
async def test_random_frames_never_break_the_server(
    server: P2PHost, data: list[bytes | tuple[dict[str, Any], bytes]], authenticate: bool
) -> None:
    peer = await RawPeer.connect(server.visible_maddrs[0])
    try:
        if authenticate:
            await peer.handshake()
        for chunk in data:
            if isinstance(chunk, bytes):
                peer.send(chunk)
            else:  # a frame, encrypted once the handshake is done: the fuzz reaches the router
                peer.send(peer.seal(*chunk) if authenticate else frame(*chunk))
        await asyncio.sleep(0.01)
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        await peer.close()
    await still_serves(server)


async def test_call_in_the_same_segment_as_auth_is_served(server: P2PHost) -> None:
    """Regression: frames right behind AUTH must be parsed as an authenticated connection's."""
    peer = await RawPeer.connect(server.visible_maddrs[0])
    call = {"k": Kind.CALL, "i": 1, "m": "t.echo", "a": "same segment", "s": False}
    assert (await peer.handshake(then=[call]))["k"] == Kind.AUTH
    head, _ = await peer.read_frame()
    assert head["k"] == Kind.REPLY and head["r"] == "same segment"
    await peer.close()


async def test_close_does_not_hang_on_a_peer_that_stops_reading(make_host, monkeypatch: pytest.MonkeyPatch) -> None:
    # close() waits the grace twice at most (flush, then abort): a shorter grace ends the same way sooner
    grace = 0.5
    monkeypatch.setattr(host_module, "CLOSE_GRACE_SECONDS", grace)
    host = await make_host()

    async def flood(ctx: CallContext, args: Any, stream: Any) -> None:
        await stream.write(bytes(256 * 2**20))

    host.add_stream_handler("t.flood", flood)
    peer = await RawPeer.connect(host.visible_maddrs[0])
    await peer.handshake(window=2**31, then=[{"k": Kind.CALL, "i": 1, "m": "t.flood", "a": None, "s": True}])
    await asyncio.sleep(0.5)  # the host fills the socket buffers and waits to drain; we never read
    loop = asyncio.get_running_loop()
    start = loop.time()
    await asyncio.wait_for(host.close(), 10)
    assert loop.time() - start < 2 * grace + 2  # 2 s of slack for a loaded machine, as with the default grace
    await peer.close()


async def test_dialing_a_server_of_another_protocol_says_so(make_host) -> None:
    """An initial peer pasted with the port of a web server: the dial fails with one error that
    says the address answered but is not a swarm node (before: only a frame size)."""

    async def http_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(4096)
        writer.write(b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/html\r\n\r\n<!DOCTYPE HTML><html></html>")
        await writer.drain()
        writer.close()

    web = await asyncio.start_server(http_server, "127.0.0.1", 0)
    try:
        port = web.sockets[0].getsockname()[1]
        client = await make_host()
        other = Identity.generate().peer_id
        with pytest.raises(Exception, match="answered, but not as a swarm node") as caught:
            await client.call(f"/ip4/127.0.0.1/tcp/{port}/p2p/{other}", "t.echo", "x", timeout=5)
        assert "check the address and port" in str(caught.value)
    finally:
        web.close()
        await web.wait_closed()
