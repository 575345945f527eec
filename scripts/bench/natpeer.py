"""A peer for the NAT lab (tests/netlab/test_nat.py, scripts/bench/nat.py), run inside one of the
lab's namespaces (`ip netns exec`):

    python -m scripts.bench.natpeer relay ADDRESS              a relay on ADDRESS, port 0
    python -m scripts.bench.natpeer target RELAY_MADDR         a NATed host with a reservation on the relay
    python -m scripts.bench.natpeer dial RELAY_MADDR RELAYED DIRECT N   call RELAYED, try DIRECT, stream N bytes
    python -m scripts.bench.natpeer punch RELAYED [N]          call RELAYED, punch, call again, stream N bytes
    python -m scripts.bench.natpeer serve ADDRESS              a plain host on ADDRESS that takes streams
    python -m scripts.bench.natpeer send MADDR N               stream N bytes to MADDR on a direct connection

target punches too when given `punch` after the relay's multiaddr.

Each prints one JSON line once it is ready (its addresses, or the results of `dial`, `punch`,
`send`); relay, target and serve then serve until their stdin closes, so whoever started them
stops them by closing it (and the lab kills whatever is left in its namespaces).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from typing import Any

from swarm.p2p import CallContext, P2PConfig, P2PError, P2PHost, Stream
from swarm.p2p.maddr import parse_address
from swarm.p2p.punch import PunchConfig, Puncher
from swarm.p2p.relay import RelayConfig, RelayService
from swarm.p2p.relay_client import RelayKeeper

CALL_TIMEOUT = 10.0
# the lab adds no delay: a SYN is answered in a millisecond or, dropped by a NAT, retransmitted
# after 1 s; 2 s per dial keeps a symmetric NAT's three failed attempts short
PUNCHING = PunchConfig(dial_timeout_s=2.0)
PUNCH_TIMEOUT = 30.0  # three attempts of a 2 s dial and two calls each, at most
DIRECT_TIMEOUT = 3.0  # a dial through a NAT that drops unsolicited SYNs never completes: bounded


async def echo(ctx: CallContext, args: Any) -> Any:
    return {"echo": args, "from": str(ctx.peer_id), "via": ctx.remote_address[0]}


async def sink(ctx: CallContext, args: Any, stream: Stream) -> None:
    received = 0
    async for chunk in stream:
        received += len(chunk)
    await stream.write(received.to_bytes(8, "big"))


async def goodput(host: P2PHost, peer: str, size: int) -> float:
    """Stream payload bytes per second to the peer's sink, until it confirms all arrived. Written
    in 256 KiB pieces: a relay forwards a piece once it has all of it, so with 1 MiB pieces an
    8 MiB stream spent 1/8 of its time waiting on the relay's first piece (0.84x the link at best)."""
    chunk, began = os.urandom(256 * 1024), time.monotonic()
    async with await host.open_stream(peer, "demo.sink", timeout=CALL_TIMEOUT) as stream:
        for _ in range(size // len(chunk)):
            await stream.write(chunk)
        await stream.end()
        confirmed = await stream.read(timeout=CALL_TIMEOUT)
    assert confirmed is not None and int.from_bytes(confirmed, "big") == size
    return size / (time.monotonic() - began)


def say(fields: dict[str, Any]) -> None:
    print(json.dumps(fields), flush=True)


async def until_stdin_closes() -> None:
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)


async def relay(address: str) -> None:
    async with P2PHost(config=P2PConfig(host_maddrs=(f"/ip4/{address}/tcp/0",))) as host:
        service = await RelayService(host, RelayConfig()).start()
        say({"maddr": host.visible_maddrs[0]})
        await until_stdin_closes()
        await service.close()


async def target(relay_maddr: str, punching: str = "") -> None:
    config = P2PConfig(host_maddrs=("/ip4/0.0.0.0/tcp/0",), reuse_port=punching == "punch")
    async with P2PHost(config=config) as host, contextlib.AsyncExitStack() as stack:
        if punching == "punch":
            await stack.enter_async_context(Puncher(host, PUNCHING))
        host.add_handler("demo.echo", echo)
        host.add_stream_handler("demo.sink", sink)
        async with RelayKeeper(host, [relay_maddr]) as keeper:
            relayed = await keeper.wait_reserved(timeout=CALL_TIMEOUT)
            port = host.visible_maddrs[0].split("/")[4]
            say({"relayed": relayed.to_maddr(), "peer_id": str(host.peer_id), "port": int(port)})
            await until_stdin_closes()


async def dial(relay_maddr: str, relayed: str, direct: str, stream_bytes: str, streams: str = "1") -> None:
    """Calls through the relay, a direct dial that must fail, then `streams` streams of `stream_bytes`
    through the relay: the best one's rate (a busy machine's scheduler only ever slows a stream, so the
    best of a few is the circuit's rate, not the machine's load)."""
    async with P2PHost(config=P2PConfig(host_maddrs=("/ip4/0.0.0.0/tcp/0",))) as host:
        began = time.monotonic()
        reply = await host.call(relayed, "demo.echo", {"x": 1}, timeout=CALL_TIMEOUT)
        relayed_s = time.monotonic() - began
        began = time.monotonic()
        calls = [await host.call(relayed, "demo.echo", {"x": i}, timeout=CALL_TIMEOUT) for i in range(20)]
        rtt = (time.monotonic() - began) / len(calls)
        try:  # a fresh TCP connection (a call would reuse the relayed one: same PeerID)
            await host.probe(direct, timeout=DIRECT_TIMEOUT)
            direct_error = None
        except P2PError as e:
            direct_error = f"{type(e).__name__}: {e}"
        rate = max([await goodput(host, relayed, int(stream_bytes)) for _ in range(int(streams))])
        say(
            {
                "reply": reply,
                "first_call_s": relayed_s,
                "call_s": rtt,
                "direct_error": direct_error,
                "bytes_per_s": rate,
            }
        )


async def punch(relayed: str, stream_bytes: str = "0") -> None:
    config = P2PConfig(host_maddrs=("/ip4/0.0.0.0/tcp/0",), reuse_port=True)
    async with P2PHost(config=config) as host, Puncher(host, PUNCHING) as puncher:
        began = time.monotonic()  # the punch starts as soon as the relayed connection is up
        first = await host.call(relayed, "demo.echo", {"x": 1}, timeout=CALL_TIMEOUT)
        first_s = time.monotonic() - began
        outcome = await puncher.outcome(parse_address(relayed).peer_id, timeout=PUNCH_TIMEOUT)
        punch_s = time.monotonic() - began
        again = await host.call(relayed, "demo.echo", {"x": 2}, timeout=CALL_TIMEOUT)
        rate = await goodput(host, relayed, int(stream_bytes)) if int(stream_bytes) else None
        say({"first": first, "first_s": first_s, "outcome": outcome, "punch_s": punch_s, "again": again,
             "bytes_per_s": rate})  # fmt: skip


async def serve(address: str) -> None:
    async with P2PHost(config=P2PConfig(host_maddrs=(f"/ip4/{address}/tcp/0",))) as host:
        host.add_stream_handler("demo.sink", sink)
        say({"maddr": host.visible_maddrs[0]})
        await until_stdin_closes()


async def send(maddr: str, stream_bytes: str) -> None:
    async with P2PHost(config=P2PConfig(host_maddrs=("/ip4/0.0.0.0/tcp/0",))) as host:
        say({"bytes_per_s": await goodput(host, maddr, int(stream_bytes))})


def main() -> None:
    # the punch's attempts, on stderr (the test's output): which attempt succeeded, or why not
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("swarm.p2p.punch").setLevel(logging.INFO)
    role, *args = sys.argv[1:]
    roles = {"relay": relay, "target": target, "dial": dial, "punch": punch, "serve": serve, "send": send}
    asyncio.run(roles[role](*args))


if __name__ == "__main__":
    main()
