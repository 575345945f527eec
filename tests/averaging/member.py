"""One group member in its own process, for the multi-process fault tests
(`python -m tests.averaging.member`, run from the repository root).

Prints one JSON line {"peer_id", "maddr"}, reads one JSON line {"group": hex msgpack,
"elements", "seed"}, runs one all-reduce round, prints {"sha256", "contributions"} or
{"error"}. SWARM_TEST_FAULT makes it misbehave: "die-in-reduce" SIGKILLs the process when it
starts reducing its own part; "garbage" sends NaN scales in every chunk.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import sys

import msgpack
import torch

from swarm.averaging.config import AveragingConfig
from swarm.averaging.errors import AllReduceError
from swarm.averaging.messages import GroupInfo
from swarm.averaging.rounds import reduction
from swarm.averaging.rounds.flat import AllReduceRound
from swarm.averaging.rounds.registry import RoundRegistry
from swarm.p2p import P2PConfig, P2PHost
from swarm.utils.eventloop import run
from swarm_kernels import as_memoryview
from tests.averaging.faults import garbage_codec


def inject(fault: str, round_: AllReduceRound) -> None:
    if fault == "die-in-reduce":
        original = reduction.PartReduction._encode_chunk  # the first chunk of a result, streamed or not

        def die(self: reduction.PartReduction, values: torch.Tensor) -> torch.Tensor:
            os.kill(os.getpid(), signal.SIGKILL)
            return original(self, values)

        reduction.PartReduction._encode_chunk = die  # type: ignore[method-assign]
    elif fault == "garbage":
        round_.codec = garbage_codec(round_.codec)


async def main() -> None:
    loop = asyncio.get_running_loop()
    config = AveragingConfig(part_timeout=float(os.environ.get("SWARM_TEST_PART_TIMEOUT", "5")), request_timeout=2.0,
                             block_size=1024, chunk_elements=8192)  # fmt: skip
    async with P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))) as host:
        registry = RoundRegistry(host, config)
        print(json.dumps({"peer_id": host.peer_id.to_bytes().hex(), "maddr": host.visible_maddrs[0]}), flush=True)
        cmd = json.loads(await loop.run_in_executor(None, sys.stdin.readline))
        group = GroupInfo.decode(msgpack.unpackb(bytes.fromhex(cmd["group"]), raw=False))
        me = group.index_of(host.peer_id)
        vector = torch.randn(cmd["elements"], generator=torch.Generator().manual_seed(cmd["seed"] * 100 + me))
        round_ = AllReduceRound(host, registry, group, vector, config)
        inject(os.environ.get("SWARM_TEST_FAULT", ""), round_)
        try:
            result, report = await round_.run()
        except AllReduceError as e:
            print(json.dumps({"error": str(e)}), flush=True)
        else:
            digest = hashlib.sha256(as_memoryview(result)).hexdigest()
            print(json.dumps({"sha256": digest, "contributions": report.contributions}), flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)  # stay up (serving fetches) until told
        registry.close()


if __name__ == "__main__":
    if os.environ.get("SWARM_TEST_LOG"):
        import logging

        logging.basicConfig(level=logging.INFO, format="%(relativeCreated)6.0f %(process)d %(name)s %(message)s")
    run(main())
