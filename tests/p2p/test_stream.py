"""Streaming calls: bulk transfer, both directions, flow control, errors and cancellation."""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

import pytest

from swarm.p2p import CallContext, ErrorCode, P2PError, RemoteError, RPCTimeout, Stream

MiB = 1024 * 1024


async def sha_sink(ctx: CallContext, args: Any, stream: Stream) -> None:
    digest, total = hashlib.sha256(), 0
    async for chunk in stream:
        digest.update(chunk)
        total += len(chunk)
    await stream.write(total.to_bytes(8, "big") + digest.digest())


async def test_bulk_upload_arrives_intact(make_host) -> None:
    a, b = await make_host(), await make_host(chunk_bytes=1 * MiB)
    b.add_stream_handler("t.sink", sha_sink)
    payload = os.urandom(37 * MiB + 123)  # not a multiple of the chunk size
    async with await a.open_stream(b.visible_maddrs[0], "t.sink") as stream:
        await stream.write(payload)
        await stream.end()
        reply = await stream.read_all(max_bytes=40)
    assert int.from_bytes(reply[:8], "big") == len(payload)
    assert bytes(reply[8:]) == hashlib.sha256(payload).digest()
    assert stream.bytes_sent == len(payload)


async def test_bidirectional_echo_and_many_streams_at_once(make_host) -> None:
    a, b = await make_host(), await make_host()

    async def echo_stream(ctx: CallContext, args: Any, stream: Stream) -> None:
        async for chunk in stream:
            await stream.write(bytes(chunk) * args["times"])

    b.add_stream_handler("t.echo", echo_stream)

    async def one(i: int) -> None:
        async with await a.open_stream(b.visible_maddrs[0], "t.echo", {"times": 2}) as stream:
            for j in range(5):
                piece = f"{i}:{j}".encode()
                await stream.write(piece)
                assert bytes(await stream.read()) == piece * 2
            await stream.end()
            assert await stream.read() is None

    await asyncio.gather(*(one(i) for i in range(30)))


async def test_download_stream(make_host) -> None:
    a, b = await make_host(), await make_host()
    blob = os.urandom(9 * MiB)

    async def source(ctx: CallContext, args: Any, stream: Stream) -> None:
        await stream.write(memoryview(blob)[args["start"] :])

    b.add_stream_handler("t.source", source)
    async with await a.open_stream(b.visible_maddrs[0], "t.source", {"start": 5}) as stream:
        got = await stream.read_all(max_bytes=len(blob))
    assert got == blob[5:]


async def test_slow_reader_bounds_what_the_writer_has_in_flight(make_host) -> None:
    window, chunk = 1 * MiB, 256 * 1024
    a = await make_host(chunk_bytes=chunk, stream_window_bytes=window)
    b = await make_host(chunk_bytes=chunk, stream_window_bytes=window)
    started, release = asyncio.Event(), asyncio.Event()

    async def lazy(ctx: CallContext, args: Any, stream: Stream) -> None:
        started.set()
        await release.wait()
        await stream.read_all(max_bytes=64 * MiB)

    b.add_stream_handler("t.lazy", lazy)
    async with await a.open_stream(b.visible_maddrs[0], "t.lazy") as stream:
        writer = asyncio.ensure_future(stream.write(bytes(16 * MiB)))
        await started.wait()
        await asyncio.sleep(0.5)
        assert not writer.done()
        assert stream.bytes_sent <= window  # the writer waits for credit instead of flooding
        release.set()
        await asyncio.wait_for(writer, 20)
        await stream.end()
        assert await stream.read() is None


async def test_handler_error_reaches_the_reader(make_host) -> None:
    a, b = await make_host(), await make_host()

    async def fails(ctx: CallContext, args: Any, stream: Stream) -> None:
        await stream.read()
        raise ValueError("boom")

    b.add_stream_handler("t.fails", fails)
    async with await a.open_stream(b.visible_maddrs[0], "t.fails") as stream:
        await stream.write(b"x")
        with pytest.raises(RemoteError) as info:
            await stream.read()
    assert info.value.code == ErrorCode.INTERNAL and info.value.method == "t.fails"


async def test_unknown_stream_method(make_host) -> None:
    a, b = await make_host(), await make_host()
    async with await a.open_stream(b.visible_maddrs[0], "t.nothing") as stream:
        with pytest.raises(RemoteError) as info:
            await stream.read()
    assert info.value.code == ErrorCode.UNKNOWN_METHOD


async def test_caller_closing_early_cancels_the_handler(make_host) -> None:
    a, b = await make_host(), await make_host()
    cancelled = asyncio.Event()

    async def endless(ctx: CallContext, args: Any, stream: Stream) -> None:
        try:
            while True:
                await stream.write(bytes(64 * 1024))
        except asyncio.CancelledError:
            cancelled.set()
            raise

    b.add_stream_handler("t.endless", endless)
    async with await a.open_stream(b.visible_maddrs[0], "t.endless") as stream:
        await stream.read()
    await asyncio.wait_for(cancelled.wait(), 5)
    with pytest.raises(P2PError):
        await stream.read()


async def test_read_timeout(make_host) -> None:
    a, b = await make_host(), await make_host()

    async def silent(ctx: CallContext, args: Any, stream: Stream) -> None:
        await asyncio.sleep(30)

    b.add_stream_handler("t.silent", silent)
    async with await a.open_stream(b.visible_maddrs[0], "t.silent", timeout=0.2) as stream:
        with pytest.raises(RPCTimeout):
            await stream.read()


async def test_read_all_refuses_more_than_max_bytes(make_host) -> None:
    a, b = await make_host(), await make_host()

    async def source(ctx: CallContext, args: Any, stream: Stream) -> None:
        await stream.write(bytes(1000))

    b.add_stream_handler("t.source", source)
    async with await a.open_stream(b.visible_maddrs[0], "t.source") as stream:
        with pytest.raises(P2PError, match="more than 100 bytes"):
            await stream.read_all(max_bytes=100)


async def test_kept_chunks_are_never_overwritten_by_later_frames(make_host) -> None:
    """Large-frame buffers are pooled; a chunk the reader still holds must never be reused."""
    a, b = await make_host(chunk_bytes=256 * 1024), await make_host()
    kept: list[memoryview] = []

    async def keeper(ctx: CallContext, args: Any, stream: Stream) -> None:
        async for chunk in stream:
            kept.append(chunk)  # type: ignore[arg-type]
        await stream.write(hashlib.sha256(b"".join(kept)).digest())

    b.add_stream_handler("t.keep", keeper)
    payload = os.urandom(12 * MiB)
    async with await a.open_stream(b.visible_maddrs[0], "t.keep") as stream:
        await stream.write(payload)
        await stream.end()
        digest = await stream.read_all(max_bytes=32)
    assert bytes(digest) == hashlib.sha256(payload).digest() and len(kept) == 48
