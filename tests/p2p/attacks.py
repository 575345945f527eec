"""The connection-level attacks , run from many source addresses across 127.0.0.0/8,
and an honest peer's calls while they run. Used by test_limits.py; run it as a script to measure
the full-size attacks against a host with the default limits (peak RSS, honest success rate):

    PYTHONPATH=$PWD python -m tests.p2p.attacks [silent|identities|streams]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from swarm.p2p import CallContext, P2PConfig, P2PError, P2PHost, Stream
from swarm.utils.process_memory import resident_bytes
from tests.p2p.rawpeer import RawPeer

RETRY_PAUSE_S = 0.05  # an attacker slot waits this long after its socket is closed, then retries


def sources(first: int, count: int) -> list[str]:
    """`count` loopback addresses 127.0.<first+i>.1: each plays another machine."""
    return [f"127.0.{first + i}.1" for i in range(count)]


@dataclass
class AttackStats:
    connected: int = 0  # sockets opened (attack 1) or handshakes completed (attack 2)
    failed: int = 0  # connects or handshakes that failed


async def _until_closed(peer: RawPeer, stop: asyncio.Event) -> None:
    reading = asyncio.ensure_future(peer.closed_by_peer(timeout=3600))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({reading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        reading.cancel()
        stopping.cancel()
        await asyncio.gather(reading, stopping, return_exceptions=True)


async def _attacker_slot(
    maddr: str, source: str, stop: asyncio.Event, stats: AttackStats, *, handshake: bool, pause: float
) -> None:
    """Keep one connection from `source` open: silent, or authenticated under a fresh
    identity; when the host closes it, open the next one `pause` seconds later."""
    while not stop.is_set():
        try:
            peer = await RawPeer.connect(maddr, source=source)
        except OSError:
            stats.failed += 1
            await asyncio.sleep(pause)
            continue
        try:
            if handshake:
                await peer.handshake()
            stats.connected += 1
            await _until_closed(peer, stop)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, P2PError):
            stats.failed += 1
        finally:
            await peer.close()
        await asyncio.sleep(pause)


class Flood:
    """`per_source` attacker slots from each of `addresses`, until the `async with` ends."""

    def __init__(
        self, maddr: str, addresses: Sequence[str], per_source: int, *, handshake: bool, pause: float = RETRY_PAUSE_S
    ) -> None:
        self.stop = asyncio.Event()
        self.stats = AttackStats()
        self._slots = [(maddr, a) for a in addresses for _ in range(per_source)]
        self._handshake, self._pause = handshake, pause
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Flood:
        self._tasks = [
            asyncio.ensure_future(
                _attacker_slot(m, a, self.stop, self.stats, handshake=self._handshake, pause=self._pause)
            )
            for m, a in self._slots
        ]
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.stop.set()
        done, late = await asyncio.wait(self._tasks, timeout=10)
        for task in late:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for task in done:
            task.result()  # a bug in the attacker must show


async def honest_pings(
    maddr: str, n: int, *, timeout: float = 5.0, before_each: Callable[[], Awaitable[None]] | None = None
) -> int:
    """`n` calls of t.echo, each from a fresh honest host (a new identity, a new connection)
    on 127.0.0.1, a source of its own, each after `before_each`: how many were answered."""
    answered = 0
    for i in range(n):
        if before_each is not None:
            await before_each()
        host = P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",)))
        try:
            answered += await host.call(maddr, "t.echo", i, timeout=timeout) == i
        except P2PError:
            pass
        finally:
            await host.close()
    return answered


async def echo(ctx: CallContext, args: Any) -> Any:
    return args


def connections_of(host: P2PHost) -> list[Any]:
    return host._pool.open()


def buffered_on(host: P2PHost) -> int:
    """Stream data the host received and its handlers have not read (counted chunk by chunk)."""
    return sum(len(chunk) for conn in connections_of(host) for s in conn._streams.values() for chunk in s._chunks)


async def stream_flood(
    attacker: P2PHost, maddr: str, method: str, *, streams: int, nbytes: int
) -> list[tuple[Stream, asyncio.Task[None]]]:
    """Open `streams` streams of `method` and start writing `nbytes` on each, as fast as the
    credit allows: each stream with the task of its write."""
    opened = [await attacker.open_stream(maddr, method, None, timeout=60) for _ in range(streams)]
    blob = memoryview(bytes(nbytes))
    return [(stream, asyncio.ensure_future(stream.write(blob))) for stream in opened]


# --- measuring the full-size attacks ---------------------------------------------------------


async def _measure(kind: str) -> None:
    server = await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
    server.add_handler("t.echo", echo)
    release = asyncio.Event()

    async def later(ctx: CallContext, args: Any, stream: Stream) -> None:  # avg.part for an unknown group
        await release.wait()
        while await stream.read() is not None:
            pass

    server.add_stream_handler("t.later", later)
    maddr = server.visible_maddrs[0]
    rss0, peak, t0 = resident_bytes(), 0, time.perf_counter()
    try:
        if kind == "streams":
            async with P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))) as attacker:
                opened = await stream_flood(attacker, maddr, "t.later", streams=64, nbytes=16 * 2**20)
                await asyncio.sleep(2)
                peak, rss = buffered_on(server), resident_bytes() - rss0
                ok = await honest_pings(maddr, 25)
                release.set()
                await asyncio.gather(*(writing for _, writing in opened))
        else:
            silent = kind == "silent"
            addresses = sources(1, 8 if silent else 64)
            pause = 0.001 if silent else RETRY_PAUSE_S  # silent: back at once in the slot an honest peer took
            async with Flood(maddr, addresses, 8 if silent else 16, handshake=not silent, pause=pause) as flood:
                await asyncio.sleep(2 if silent else 5)  # silent: before the 5 s handshake deadline
                rss = resident_bytes() - rss0
                print(f"{len(server._handshaking)} handshaking, {len(connections_of(server))} open")
                ok = await honest_pings(maddr, 25)  # from 127.0.0.1: a source of its own
            print(f"attacker: {flood.stats}")
        print(f"{kind}: honest {ok}/25, buffered {peak / 2**20:.1f} MiB, RSS growth {rss / 2**20:.0f} MiB under attack")
        print(f"  {time.perf_counter() - t0:.1f}s (attacker and host in one process: RSS counts both)")
    finally:
        await server.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("kind", choices=["silent", "identities", "streams"])
    asyncio.run(_measure(parser.parse_args().kind))
