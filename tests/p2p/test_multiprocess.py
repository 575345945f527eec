"""Two real processes on 127.0.0.1: a host in a child process serves unary and stream calls."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from swarm.p2p import P2PConfig, P2PHost
from swarm.utils import process_control

SERVER = """
import asyncio, hashlib, json, sys
from swarm.utils.eventloop import run
from swarm.p2p import P2PConfig, P2PHost

async def main():
    async with P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))) as host:
        async def echo(ctx, args):
            return {"args": args, "caller": str(ctx.peer_id)}
        async def digest(ctx, args, stream):
            h = hashlib.sha256()
            async for chunk in stream:
                h.update(chunk)
            await stream.write(h.digest())
        host.add_handler("mp.echo", echo)
        host.add_stream_handler("mp.digest", digest)
        print(json.dumps({"maddrs": host.visible_maddrs, "peer_id": str(host.peer_id)}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

run(main())
"""


@pytest.fixture
def server_process() -> Iterator[dict]:
    proc = process_control.start(
        [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"}, new_session=False,
    )  # fmt: skip
    try:
        yield process_control.read_json_line(proc, 60, what="the server process")
    finally:
        process_control.close_stdin(proc)  # its cue to stop
        process_control.stop(proc, 10.0, term=None, reap_s=None)


@pytest.mark.swarm
async def test_rpc_and_stream_across_processes(server_process: dict) -> None:
    payload = os.urandom(48 * 2**20)
    async with P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))) as host:
        maddr = server_process["maddrs"][0]
        reply = await host.call(maddr, "mp.echo", {"n": 1}, timeout=10)
        assert reply == {"args": {"n": 1}, "caller": str(host.peer_id)}
        assert host.connected_peers()[0].to_base58() == server_process["peer_id"]
        async with await host.open_stream(maddr, "mp.digest", timeout=30) as stream:
            await stream.write(payload)
            await stream.end()
            assert bytes(await stream.read_all(max_bytes=32)) == hashlib.sha256(payload).digest()
