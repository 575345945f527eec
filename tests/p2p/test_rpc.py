"""Unary RPC between real hosts on 127.0.0.1: calls, errors, limits, connection reuse, lifecycle."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from swarm.p2p import (
    BadRequest,
    CallContext,
    ConnectionLost,
    ErrorCode,
    Identity,
    MessageTooLarge,
    P2PHost,
    PeerIDMismatch,
    RemoteError,
    RPCTimeout,
    parse_maddr,
)
from tests.p2p.conftest import local_config
from tests.waiting import until


async def echo(ctx: CallContext, args: Any) -> Any:
    return {"args": args, "from": str(ctx.peer_id)}


async def test_unary_call_by_maddr_then_by_peer_id(make_host) -> None:
    a, b = await make_host(), await make_host()
    b.add_handler("t.echo", echo)
    maddr = b.visible_maddrs[0]
    assert parse_maddr(maddr).port > 0 and maddr.endswith(f"/p2p/{b.peer_id}")
    assert await a.call(maddr, "t.echo", [1, "x", b"\x00"]) == {"args": [1, "x", b"\x00"], "from": str(a.peer_id)}
    assert await a.call(b.peer_id, "t.echo", None) == {"args": None, "from": str(a.peer_id)}


async def test_calls_both_ways_share_one_connection(make_host) -> None:
    a, b = await make_host(), await make_host()
    a.add_handler("t.echo", echo)
    b.add_handler("t.echo", echo)
    await asyncio.gather(*(a.call(b.visible_maddrs[0], "t.echo", i) for i in range(50)))
    await asyncio.gather(*(b.call(a.peer_id, "t.echo", i) for i in range(50)))
    assert len(a._pool.by_peer[b.peer_id]) == 1 and len(b._pool.by_peer[a.peer_id]) == 1


async def test_slow_call_does_not_block_fast_ones(make_host) -> None:
    a, b = await make_host(), await make_host()
    release = asyncio.Event()

    async def slow(ctx: CallContext, args: Any) -> str:
        await release.wait()
        return "slow"

    b.add_handler("t.slow", slow)
    b.add_handler("t.echo", echo)
    slow_call = asyncio.ensure_future(a.call(b.visible_maddrs[0], "t.slow", None))
    for i in range(20):
        assert (await a.call(b.visible_maddrs[0], "t.echo", i, timeout=2))["args"] == i
    assert not slow_call.done()
    release.set()
    assert await slow_call == "slow"


async def test_timeout_raises_and_cancels_the_handler(make_host) -> None:
    a, b = await make_host(), await make_host()
    cancelled = asyncio.Event()

    async def hang(ctx: CallContext, args: Any) -> None:
        try:
            await asyncio.sleep(60)  # the behaviour under test: a handler that hangs (the timeout cancels it)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    b.add_handler("t.hang", hang)
    with pytest.raises(RPCTimeout):
        await a.call(b.visible_maddrs[0], "t.hang", None, timeout=0.2)
    await asyncio.wait_for(cancelled.wait(), 2)


async def test_typed_remote_errors(make_host, caplog: pytest.LogCaptureFixture) -> None:
    a, b = await make_host(), await make_host()

    async def picky(ctx: CallContext, args: Any) -> int:
        if not isinstance(args, dict) or not isinstance(args.get("n"), int):
            raise BadRequest("expected {'n': int}")
        return args["n"] * 2

    async def broken(ctx: CallContext, args: Any) -> None:
        raise ZeroDivisionError("bug")

    async def unencodable(ctx: CallContext, args: Any) -> object:
        return object()

    b.add_handler("t.picky", picky)
    b.add_handler("t.broken", broken)
    b.add_handler("t.unencodable", unencodable)
    m = b.visible_maddrs[0]
    assert await a.call(m, "t.picky", {"n": 21}) == 42
    cases = [
        ("t.picky", {"n": "21"}, ErrorCode.BAD_REQUEST),
        ("t.picky", [1, 2], ErrorCode.BAD_REQUEST),
        ("t.missing", None, ErrorCode.UNKNOWN_METHOD),
        ("t.broken", None, ErrorCode.INTERNAL),
        ("t.unencodable", None, ErrorCode.INTERNAL),
    ]
    with caplog.at_level(logging.INFO, logger="swarm.p2p"):
        for method, args, code in cases:
            with pytest.raises(RemoteError) as info:
                await a.call(m, method, args)
            assert info.value.code == code and info.value.method == method
    assert "ZeroDivisionError" in caplog.text and "t.missing" in caplog.text
    assert await a.call(m, "t.picky", {"n": 1}) == 2  # the connection survived all of it


async def test_stream_method_called_as_unary_is_a_bad_request(make_host) -> None:
    a, b = await make_host(), await make_host()

    async def streamer(ctx: CallContext, args: Any, stream: Any) -> None:
        await stream.write(b"x")

    b.add_stream_handler("t.stream", streamer)
    with pytest.raises(RemoteError) as info:
        await a.call(b.visible_maddrs[0], "t.stream", None)
    assert info.value.code == ErrorCode.BAD_REQUEST


async def test_message_too_large_both_ways(make_host) -> None:
    a = await make_host(max_head_bytes=64 * 1024)
    b = await make_host(max_head_bytes=64 * 1024)

    async def big_reply(ctx: CallContext, args: Any) -> bytes:
        return bytes(100 * 1024)

    b.add_handler("t.echo", echo)
    b.add_handler("t.big", big_reply)
    with pytest.raises(MessageTooLarge):  # refused before sending: b announced its limit
        await a.call(b.visible_maddrs[0], "t.echo", bytes(100 * 1024))
    with pytest.raises(RemoteError) as info:  # b refuses to send what a cannot take
        await a.call(b.visible_maddrs[0], "t.big", None)
    assert info.value.code == ErrorCode.TOO_LARGE
    assert (await a.call(b.peer_id, "t.echo", 1))["args"] == 1


async def test_concurrency_limit_answers_busy(make_host) -> None:
    a, b = await make_host(), await make_host(max_concurrent_calls=4)
    release = asyncio.Event()
    running: list[int] = []

    async def wait(ctx: CallContext, args: Any) -> int:
        running.append(args)
        await release.wait()
        return args

    b.add_handler("t.wait", wait)
    calls = [asyncio.ensure_future(a.call(b.visible_maddrs[0], "t.wait", i)) for i in range(10)]
    # every call has reached b: its handler runs, or b has answered it (busy)
    await until(lambda: len(running) + sum(c.done() for c in calls) == len(calls), 10, "b to take all 10 calls")
    release.set()
    results = await asyncio.gather(*calls, return_exceptions=True)
    busy = [r for r in results if isinstance(r, RemoteError) and r.code == ErrorCode.BUSY]
    assert len(busy) == 6 and sorted(r for r in results if isinstance(r, int)) == [0, 1, 2, 3]


async def test_handler_deadline_answers_timeout(make_host) -> None:
    a, b = await make_host(), await make_host(handler_timeout=0.2)

    async def hang(ctx: CallContext, args: Any) -> None:
        await asyncio.sleep(30)  # the behaviour under test: a handler past b's deadline (b cancels it at 0.2 s)

    b.add_handler("t.hang", hang)
    with pytest.raises(RemoteError) as info:
        await a.call(b.visible_maddrs[0], "t.hang", None, timeout=5)
    assert info.value.code == ErrorCode.TIMEOUT


async def test_dialing_the_wrong_peer_id_fails_clearly(make_host) -> None:
    a, b = await make_host(), await make_host()
    b.add_handler("t.echo", echo)
    impostor = Identity.generate().peer_id
    wrong = parse_maddr(b.visible_maddrs[0]).with_peer_id(impostor)
    with pytest.raises(PeerIDMismatch, match=f"dialed {impostor}.*but the peer there is {b.peer_id}: .*ask for its "
                       "current address line"):  # fmt: skip
        await a.call(wrong, "t.echo", None)
    assert (await a.call(b.visible_maddrs[0], "t.echo", 7))["args"] == 7


async def test_unreachable_peer_and_unknown_peer_id(make_host) -> None:
    a, b = await make_host(), await make_host()
    dead = parse_maddr(b.visible_maddrs[0])
    await b.close()
    with pytest.raises(ConnectionLost, match="cannot connect"):
        await a.call(dead, "t.echo", None, timeout=5)
    with pytest.raises(ConnectionLost, match="no known address"):
        await a.call(Identity.generate().peer_id, "t.echo", None)


async def test_peer_closing_fails_pending_calls_with_connection_lost(make_host) -> None:
    a, b = await make_host(), await make_host()
    started = asyncio.Event()

    async def hang(ctx: CallContext, args: Any) -> None:
        started.set()
        await asyncio.sleep(30)  # the behaviour under test: a call still pending when b closes (the close cancels it)

    b.add_handler("t.hang", hang)
    call = asyncio.ensure_future(a.call(b.visible_maddrs[0], "t.hang", None, timeout=10))
    await asyncio.wait_for(started.wait(), 5)  # the call is in b's handler
    await b.close()
    with pytest.raises(ConnectionLost):
        await call
    assert a.connected_peers() == []


async def test_idle_connections_are_closed(make_host) -> None:
    a, b = await make_host(idle_timeout=0.3), await make_host()
    b.add_handler("t.echo", echo)
    await a.call(b.visible_maddrs[0], "t.echo", None)
    assert a.connected_peers() == [b.peer_id]
    await until(lambda: a.connected_peers() == [] and b.connected_peers() == [], 10, "the idle connection to close")
    assert (await a.call(b.visible_maddrs[0], "t.echo", 1))["args"] == 1  # re-dials


async def test_close_is_idempotent_and_leaves_no_tasks() -> None:
    before = asyncio.all_tasks()
    async with P2PHost(config=local_config()) as a, P2PHost(config=local_config()) as b:
        b.add_handler("t.echo", echo)
        await asyncio.gather(*(a.call(b.visible_maddrs[0], "t.echo", i) for i in range(20)))
    await a.close()
    await b.close()
    assert {t for t in asyncio.all_tasks() - before if not t.done()} <= {asyncio.current_task()}


async def test_simultaneous_dials_settle_on_one_preferred_connection(make_host) -> None:
    a, b = await make_host(), await make_host()
    a.add_handler("t.echo", echo)
    b.add_handler("t.echo", echo)
    await asyncio.gather(a.call(b.visible_maddrs[0], "t.echo", 1), b.call(a.visible_maddrs[0], "t.echo", 2))
    conn_a, conn_b = a._pool.best(b.peer_id), b._pool.best(a.peer_id)
    assert conn_a is not None and conn_b is not None
    # both sides pick the same TCP connection: the one dialed by the smaller PeerID
    assert conn_a.protocol.transport.get_extra_info("sockname") == conn_b.protocol.transport.get_extra_info("peername")


async def test_wildcard_listener_reports_loopback_with_real_port() -> None:
    async with P2PHost() as host:  # default: /ip4/0.0.0.0/tcp/0
        maddrs = host.visible_maddrs
        assert maddrs[0].startswith("/ip4/127.0.0.1/tcp/") and parse_maddr(maddrs[0]).port > 0
        assert all(m.endswith(f"/p2p/{host.peer_id}") for m in maddrs)


async def test_dns_maddr_and_maddr_without_peer_id_reuse_one_connection(make_host) -> None:
    a, b = await make_host(), await make_host()
    b.add_handler("t.echo", echo)
    port = parse_maddr(b.visible_maddrs[0]).port
    for _ in range(3):
        assert (await a.call(f"/dns4/localhost/tcp/{port}", "t.echo", 1))["args"] == 1
        assert (await a.call(f"/ip4/127.0.0.1/tcp/{port}", "t.echo", 2))["args"] == 2
    assert a.connected_peers() == [b.peer_id]
    assert len(a._pool.by_peer[b.peer_id]) == 1  # the second address found the peer already connected
