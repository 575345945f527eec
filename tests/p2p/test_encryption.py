"""Encrypted sessions on real sockets (wire.py, "Handshake and keys", "Encryption"): data of every
record size arrives intact; a man in the middle (tests/p2p/relay.py) who flips a bit, drops,
repeats or reorders a frame gets the connection closed, and no corrupted or out-of-order byte
reaches a handler; a passive one sees no plaintext; a changed handshake field fails the
handshake; both ends must agree to encrypt."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
from typing import Any

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from swarm.p2p import CallContext, ConnectionLost, HandshakeError, P2PError, Stream, framing, outbox, secure
from swarm.p2p.wire import FRAME_PREFIX, PREFIX_BYTES, TAG_BYTES
from tests.p2p.relay import DOWN, UP, FrameRelay

KiB, MiB = 1024, 1024 * 1024
AUTH_FAILED = "failed authentication"
MITM_KEY = X25519PrivateKey.from_private_bytes(bytes(range(32)))


async def echo(ctx: CallContext, args: Any) -> Any:
    return args


async def echo_chunks(ctx: CallContext, args: Any, stream: Stream) -> None:
    async for chunk in stream:
        await stream.write(bytes(chunk))  # a copy: the received buffer is reused once released


async def test_every_record_size_round_trips_and_none_is_in_the_clear(make_host) -> None:
    """Sizes around each path: scratch buffer, own buffer opened inline, worker-thread records."""
    server = await make_host(chunk_bytes=16 * MiB, encryption=True)
    client = await make_host(chunk_bytes=16 * MiB, encryption=True)
    server.add_stream_handler("t.echo", echo_chunks)
    sizes = [1, 1000, 64 * KiB - 1, 64 * KiB, 256 * KiB - 1, 256 * KiB, 4 * MiB + 3, 16 * MiB]
    samples = []
    async with FrameRelay(server) as relay, await client.open_stream(relay.maddr, "t.echo") as stream:
        for size in sizes:
            data = os.urandom(size)
            samples.append(data[-16:])
            await stream.write(data)
            got = bytearray()
            while len(got) < size:
                got += await stream.read()
            assert got == data, size
        await stream.end()
        assert await stream.read() is None
    wire = bytes(relay.captured[UP] + relay.captured[DOWN])
    assert not [sample for sample in samples[2:] if sample in wire]  # (1 and 1000 bytes: too short to tell)


async def test_big_streams_both_ways_with_calls_in_between(make_host) -> None:
    """Frames sealed in worker threads and small ones sealed inline keep their order."""
    server, client = await make_host(encryption=True), await make_host(encryption=True)
    payload = os.urandom(8 * MiB) * 8  # 64 MiB
    digest = hashlib.sha256(payload).digest()

    async def upload(ctx: CallContext, args: Any, stream: Stream) -> None:
        h = hashlib.sha256()
        async for chunk in stream:
            h.update(chunk)
        await stream.write(h.digest())

    async def download(ctx: CallContext, args: Any, stream: Stream) -> None:
        await stream.write(payload)

    for host in (server, client):
        host.add_handler("t.echo", echo)
    server.add_stream_handler("t.upload", upload)
    server.add_stream_handler("t.download", download)
    addr = server.visible_maddrs[0]

    async def send_up() -> bytes:
        async with await client.open_stream(addr, "t.upload") as stream:
            await stream.write(payload)
            await stream.end()
            return bytes(await stream.read_all(max_bytes=32))

    async def fetch_down() -> bytes:
        async with await client.open_stream(addr, "t.download") as stream:
            h = hashlib.sha256()
            async for chunk in stream:
                h.update(chunk)
            return h.digest()

    async def calls() -> None:
        await client.connect(addr)
        big = os.urandom(900 * KiB)  # a head of its own buffer, no body
        for i in range(40):
            assert await client.call(addr, "t.echo", [i, big if i % 10 == 0 else b""]) == [
                i,
                big if i % 10 == 0 else b"",
            ]
            assert await server.call(client.peer_id, "t.echo", i) == i  # back over the same connection
            await asyncio.sleep(0.005)

    up, down, _ = await asyncio.wait_for(asyncio.gather(send_up(), fetch_down(), calls()), 60)
    assert up == digest and down == digest
    assert len(client.connected_peers()) == 1


def _flip(frame: bytes, at: int) -> list[bytes]:
    changed = bytearray(frame)
    changed[at] ^= 0x01
    return [bytes(changed)]


def _flip_length(frame: bytes) -> list[bytes]:
    head_len, body_len = FRAME_PREFIX.unpack_from(frame)
    return [FRAME_PREFIX.pack(head_len, body_len - 1) + frame[PREFIX_BYTES:]]


N_CHUNKS = 8
FIRST_DATA = 3  # up frames: 0 HELLO, 1 AUTH, 2 CALL, then DATA 0, 1, ...
TARGET = FIRST_DATA + 2  # the frame carrying chunk 2


def tamper_with(kind: str) -> Any:
    held: list[bytes] = []

    def tamper(direction: str, index: int, frame: bytes) -> list[bytes]:
        if direction != UP:
            return [frame]
        head_len = FRAME_PREFIX.unpack_from(frame)[0]
        if index == TARGET:
            if kind == "flip a body bit":
                return _flip(frame, PREFIX_BYTES + head_len + TAG_BYTES + 1000)  # chunks are >= 16 KiB
            if kind == "flip a head bit":
                return _flip(frame, PREFIX_BYTES + 1)
            if kind == "flip a tag bit":
                return _flip(frame, len(frame) - 1)
            if kind == "change the length":
                return _flip_length(frame)
            if kind == "drop":
                return []
            if kind == "replay":
                return [frame, frame]
            if kind == "reorder":
                held.append(frame)
                return []
        if index == TARGET + 1 and held:
            return [frame, held.pop()]
        return [frame]

    return tamper


@pytest.mark.parametrize(
    "kind",
    ["flip a body bit", "flip a head bit", "flip a tag bit", "change the length", "drop", "replay", "reorder"],
)
@pytest.mark.parametrize("chunk", [16 * KiB, 128 * KiB, 512 * KiB], ids=["scratch", "own-buffer", "worker-thread"])
async def test_a_tampered_frame_closes_the_connection_and_never_reaches_the_handler(
    make_host, caplog: pytest.LogCaptureFixture, kind: str, chunk: int
) -> None:
    server, client = await make_host(), await make_host()
    received: list[bytes] = []
    handler_done = asyncio.Event()

    async def collect(ctx: CallContext, args: Any, stream: Stream) -> None:
        try:
            async for chunk in stream:
                received.append(bytes(chunk))
        finally:
            handler_done.set()

    server.add_stream_handler("t.collect", collect)
    server.add_handler("t.echo", echo)
    chunks = [bytes([i + 1]) * chunk for i in range(N_CHUNKS)]
    with caplog.at_level(logging.WARNING, logger="swarm.p2p"):
        async with FrameRelay(server, tamper_with(kind)) as relay:
            with pytest.raises(P2PError):
                async with await client.open_stream(relay.maddr, "t.collect", timeout=5) as stream:
                    for chunk in chunks:
                        await stream.write(chunk)
                    await stream.end()
                    await stream.read()  # the handler's END, were the connection not closed
            await asyncio.wait_for(handler_done.wait(), 5)
    # intact and in order, up to where it stopped (credit may split a write: compare the bytes)
    got, sent = b"".join(received), b"".join(chunks)
    assert got == sent[: len(got)]
    assert len(got) < len(sent)
    assert AUTH_FAILED in caplog.text
    assert await client.call(server.visible_maddrs[0], "t.echo", "still serving", timeout=5) == "still serving"


async def test_a_replayed_call_does_not_run_twice(make_host, caplog: pytest.LogCaptureFixture) -> None:
    server, client = await make_host(), await make_host()
    runs: list[str] = []

    async def count(ctx: CallContext, args: Any) -> int:
        runs.append(args)
        return len(runs)

    server.add_handler("t.count", count)
    saved: list[bytes] = []

    def replay_the_first_call_later(direction: str, index: int, frame: bytes) -> list[bytes]:
        if direction == UP and index == 2:
            saved.append(frame)
        if direction == UP and index == 3:
            return [saved[0], frame]
        return [frame]

    with caplog.at_level(logging.WARNING, logger="swarm.p2p"):
        async with FrameRelay(server, replay_the_first_call_later) as relay:
            assert await client.call(relay.maddr, "t.count", "first", timeout=5) == 1
            with pytest.raises(ConnectionLost):
                await client.call(relay.maddr, "t.count", "second", timeout=5)
    assert runs == ["first"]
    assert AUTH_FAILED in caplog.text


async def test_a_tampered_reply_never_reaches_the_caller(make_host, caplog: pytest.LogCaptureFixture) -> None:
    server, client = await make_host(), await make_host()
    server.add_handler("t.echo", echo)

    def flip_the_reply(direction: str, index: int, frame: bytes) -> list[bytes]:
        return _flip(frame, len(frame) - 5) if direction == DOWN and index == 2 else [frame]

    with caplog.at_level(logging.WARNING, logger="swarm.p2p"):
        async with FrameRelay(server, flip_the_reply) as relay:
            with pytest.raises(ConnectionLost):
                await client.call(relay.maddr, "t.echo", "a reply", timeout=5)
    assert AUTH_FAILED in caplog.text


@pytest.mark.parametrize("encryption", [True, False])
async def test_a_passive_capture_shows_no_plaintext(make_host, encryption: bool) -> None:
    server, client = await make_host(encryption=encryption), await make_host(encryption=encryption)
    server.add_handler("t.echo", echo)
    server.add_stream_handler("t.secret-stream", echo_chunks)
    known = b"KNOWN-PLAINTEXT-"
    async with FrameRelay(server, encrypted=encryption) as relay:
        assert await client.call(relay.maddr, "t.echo", known * 4) == known * 4
        async with await client.open_stream(relay.maddr, "t.secret-stream") as stream:
            for size in (1 * KiB, 100 * KiB, 1 * MiB):  # each record path
                await stream.write(known * (size // len(known)))
                got = 0
                while got < size:
                    got += len(await stream.read())
            await stream.end()
            assert await stream.read() is None
    wire = bytes(relay.captured[UP] + relay.captured[DOWN])
    assert len(wire) > 2 * (1 + 100 + 1024) * KiB
    if encryption:
        assert known not in wire and b"t.secret-stream" not in wire
    else:  # the control: the same capture of a clear connection shows it all
        assert known in wire and b"t.secret-stream" in wire


def _rewrite_hello(direction: str, key: str, value: Any) -> Any:
    def tamper(d: str, index: int, frame: bytes) -> list[bytes]:
        if d != direction or index != 0:
            return [frame]
        head = msgpack.unpackb(frame[PREFIX_BYTES:], raw=False)
        head[key] = value
        packed = msgpack.packb(head, use_bin_type=True)
        return [FRAME_PREFIX.pack(len(packed), 0) + packed]

    return tamper


@pytest.mark.parametrize("direction", [UP, DOWN])
@pytest.mark.parametrize(
    "key, value, log",
    [
        ("e", MITM_KEY.public_key().public_bytes_raw(), "failed to prove"),  # the MITM's own key
        ("n", bytes(range(32)), "failed to prove"),
        ("w", 1 << 30, "failed to prove"),
        ("c", "none", "encryption must be on at both ends"),  # a downgrade to the clear
    ],
    ids=["ephemeral key", "nonce", "window", "cipher"],
)
async def test_a_changed_hello_fails_the_handshake(
    make_host, caplog: pytest.LogCaptureFixture, direction: str, key: str, value: Any, log: str
) -> None:
    server, client = await make_host(), await make_host()
    server.add_handler("t.echo", echo)
    with caplog.at_level(logging.WARNING, logger="swarm.p2p"):
        async with FrameRelay(server, _rewrite_hello(direction, key, value)) as relay:
            with pytest.raises(HandshakeError) as error:
                await client.call(relay.maddr, "t.echo", "never sent", timeout=5)
            await asyncio.sleep(0.1)  # the server's side of the story
    # the side that got the changed HELLO says why (the other may only see the connection close)
    assert log in str(error.value) + caplog.text
    assert "inbound handshake" in caplog.text


@pytest.mark.parametrize("dialer_encrypts", [True, False])
async def test_both_ends_must_agree_to_encrypt(make_host, caplog, dialer_encrypts: bool) -> None:
    server = await make_host(encryption=not dialer_encrypts)
    client = await make_host(encryption=dialer_encrypts)
    server.add_handler("t.echo", echo)
    with caplog.at_level(logging.WARNING, logger="swarm.p2p"):
        with pytest.raises(HandshakeError, match="encryption must be on at both ends"):
            await client.call(server.visible_maddrs[0], "t.echo", 1, timeout=5)
        await asyncio.sleep(0.1)
    assert "inbound handshake" in caplog.text and "P2PConfig.encryption" in caplog.text


async def test_the_record_counter_never_wraps(make_host) -> None:
    """At the last nonce the connection closes instead of reusing one; the next call redials."""
    server, client = await make_host(), await make_host()
    server.add_handler("t.echo", echo)
    assert await client.call(server.visible_maddrs[0], "t.echo", 1) == 1
    first = client._pool.by_peer[server.peer_id][0]
    (server_side,) = server._pool.by_peer[client.peer_id]
    sealer, opener = first.protocol._outbox._sealer, server_side.protocol._opener  # type: ignore[union-attr]
    assert opener is not None and sealer.counter == opener.counter
    sealer.counter = opener.counter = secure.LAST_COUNTER
    assert await client.call(server.peer_id, "t.echo", 2) == 2  # sealed under the last counter
    assert await client.call(server.peer_id, "t.echo", 3) == 3  # no nonce left: a new connection
    await asyncio.wait_for(first.wait_closed(), 5)
    assert client._pool.by_peer[server.peer_id][0] is not first


async def test_keys_roll_over_in_lockstep_on_a_live_connection(make_host, monkeypatch) -> None:
    monkeypatch.setattr(secure, "REKEY_BYTES", 1 * MiB)  # instead of 4 GiB: ~40 rollovers each way
    server, client = await make_host(), await make_host()
    server.add_handler("t.echo", echo)
    server.add_stream_handler("t.echo-stream", echo_chunks)
    data = os.urandom(20 * MiB)
    async with await client.open_stream(server.visible_maddrs[0], "t.echo-stream") as stream:
        await stream.write(data)
        await stream.end()
        assert await stream.read_all(max_bytes=len(data)) == data
    assert await client.call(server.peer_id, "t.echo", "after") == "after"


async def test_a_graceful_close_still_sends_what_waits_behind_a_body_being_sealed(make_host) -> None:
    server, client = await make_host(encryption=True), await make_host(encryption=True)
    received: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def sink(ctx: CallContext, args: Any, stream: Stream) -> None:
        received.set_result(bytes(await stream.read_all(max_bytes=8 * MiB)))

    server.add_stream_handler("t.sink", sink)
    data = os.urandom(4 * MiB)
    stream = await client.open_stream(server.visible_maddrs[0], "t.sink")
    (conn,) = client._pool.by_peer[server.peer_id]
    await stream.write(data)  # sealed in a worker thread; nothing here yields to the loop
    await stream.end()  # so this END waits in the backlog behind it
    conn.close()  # before either is written
    assert await asyncio.wait_for(received, 10) == data
    await asyncio.wait_for(conn.wait_closed(), 5)


async def test_big_bodies_are_sealed_and_opened_off_the_event_loop(make_host, monkeypatch) -> None:
    """Invariant 6: the loop never blocks on the crypto of a big body; small ones stay inline."""
    seen: list[tuple[str, int, str]] = []  # (what, bytes, thread name)
    real_seal, real_open = outbox.seal_into, framing.open_into

    def seal_into(aead: Any, nonce: bytes, data: Any, ad: bytes, out: Any) -> None:
        seen.append(("seal", len(data), threading.current_thread().name))
        real_seal(aead, nonce, data, ad, out)

    def open_into(aead: Any, nonce: bytes, record: Any, ad: bytes, out: Any) -> None:
        seen.append(("open", len(out), threading.current_thread().name))
        real_open(aead, nonce, record, ad, out)

    monkeypatch.setattr(outbox, "seal_into", seal_into)
    monkeypatch.setattr(framing, "open_into", open_into)
    server, client = await make_host(), await make_host()
    server.add_stream_handler("t.echo", echo_chunks)
    async with await client.open_stream(server.visible_maddrs[0], "t.echo") as stream:
        for size in (100 * KiB, secure.OFFLOAD_BYTES, 4 * MiB):
            await stream.write(bytes(size))
            got = 0
            while got < size:
                got += len(await stream.read())
        await stream.end()
    main = threading.current_thread().name
    big = {secure.OFFLOAD_BYTES, 4 * MiB}  # sealed by seal_into; 100 KiB by AESGCM.encrypt, inline
    assert {(what, size) for what, size, _ in seen} == {("seal", n) for n in big} | {("open", n) for n in big} | {
        ("open", 100 * KiB)  # into a buffer of its own, inline
    }
    for what, size, thread in seen:
        assert (thread != main) == (size >= secure.OFFLOAD_BYTES), (what, size, thread)
