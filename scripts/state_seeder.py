"""A process that holds one swarm state and serves it, as a training node would, without training.

    python -m scripts.state_seeder --initial-peers MADDR --run-id RUN --model tiny --step 5

It builds a deterministic state (the model's seed weights, moved by a seeded random step, plus a
seeded momentum), joins the DHT, advertises the state under `<run>/state` and serves it with the
real StateServer until SIGTERM. Its first stdout line is JSON:
{"peer_id", "maddrs", "manifest", "state_sha256" (as DiLoCo.state_sha256 hashes it),
"state_bytes"}. Tests and scripts/bench_state.py use it as a donor they can slow down, corrupt
or kill; `--upload-delay` sleeps between chunks, `--corrupt` flips one byte of every shard it
sends, `--claim-run`/`--claim-model` write another run id or model into its manifest, and
`--node-settings` the run settings of swarm-nodes of the same flags (without it: none, as
scripts/bench_state.py expects).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import sys
import time
from typing import Any

import torch

from swarm import eventloop
from swarm.dht.node import DHTNode
from swarm.model.checkpoint import RunInfo, Snapshot, make_snapshot
from swarm.model.diloco import state_sha256
from swarm.model.llama import build_model
from swarm.model.presets import preset
from swarm.model.run_settings import training_settings
from swarm.node_config import NodeConfig
from swarm.p2p.config import P2PConfig
from swarm.p2p.host import P2PHost
from swarm.p2p.stream import Stream
from swarm.state import protocol
from swarm.state.holders import advertise
from swarm.state.server import StateServer


def make_state(model: str, seed: int, step: int) -> dict[str, Any]:
    """θ_outer = seed weights + a seeded nudge, momentum seeded: a state no training node has by
    chance, the same in every seeder with the same arguments."""
    config = preset(model)
    net = build_model(config, seed)
    gen = torch.Generator().manual_seed(1000 + step)
    params, momentum = {}, {}
    for name, p in net.named_parameters():
        params[name] = p.detach() + 0.01 * torch.randn(p.shape, generator=gen)
        momentum[name] = 0.001 * torch.randn(p.shape, generator=gen)
    return {"outer_step": step, "params": params, "momentum": momentum}


def run_info(args: argparse.Namespace) -> RunInfo:
    config = preset(args.claim_model or args.model)
    settings = {}
    if args.node_settings:  # the run settings of swarm-nodes given these flags (model/run_settings.py)
        node = NodeConfig(run_id=args.run_id, model=args.model, seed=args.seed, inner_steps=args.inner_steps,
                          batch_size=args.batch_size, seq_len=args.seq_len)  # fmt: skip
        settings = training_settings(node)
    return RunInfo(
        run_id=args.claim_run or args.run_id,
        model=args.claim_model or args.model,
        model_config=dataclasses.asdict(config),
        seed=args.seed,
        data="stdlib",
        inner_steps=args.inner_steps,
        settings=settings,
    )


class SlowOrBadServer(StateServer):
    """The real server, optionally slowed down or lying about its bytes."""

    def __init__(self, *args: Any, upload_delay: float, corrupt: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.upload_delay, self.corrupt = upload_delay, corrupt

    async def _rpc_shard(self, ctx: Any, args: Any, stream: Stream) -> None:
        if not self.upload_delay and not self.corrupt:
            return await super()._rpc_shard(ctx, args, stream)
        sha, name = protocol.parse_shard_args(args, self.run_id)
        data = bytearray(self._snapshot(sha).shards[name])
        if self.corrupt:
            data[len(data) // 2] ^= 0xFF
        step = 256 << 10
        for start in range(0, len(data), step):
            await stream.write(memoryview(data)[start : start + step])
            await asyncio.sleep(self.upload_delay)
        await stream.end()


async def serve(args: argparse.Namespace) -> None:
    state = make_state(args.model, args.seed, args.step)
    state_hash = state_sha256(state)
    snapshot: Snapshot = await asyncio.to_thread(make_snapshot, state, run_info(args), args.shard_bytes)
    del state  # only the serialized snapshot is served: a donor holds the state once
    host = await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
    dht = DHTNode(host=host, initial_peers=args.initial_peers)
    server = SlowOrBadServer(host, args.run_id, upload_delay=args.upload_delay, corrupt=args.corrupt,
                             max_uploads=args.max_uploads)  # fmt: skip
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await dht.start()
        server.publish(snapshot)
        await advertise(dht, args.run_id, snapshot.manifest, host.visible_maddrs, time.time() + 3600)
        line = {
            "peer_id": str(host.peer_id),
            "maddrs": host.visible_maddrs,
            "manifest": snapshot.manifest.sha256,
            "state_sha256": state_hash,
            "state_bytes": snapshot.manifest.total_bytes,
        }
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()
        await stop.wait()
    finally:
        server.close()
        await dht.close()
        await host.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step", type=int, default=5)
    parser.add_argument("--inner-steps", type=int, default=100)
    parser.add_argument("--shard-bytes", type=int, default=64 << 20)
    parser.add_argument("--max-uploads", type=int, default=4)
    parser.add_argument("--upload-delay", type=float, default=0.0, help="seconds to sleep after each 256 KiB")
    parser.add_argument("--corrupt", action="store_true")
    parser.add_argument("--claim-run", default=None)
    parser.add_argument("--claim-model", default=None)
    parser.add_argument(
        "--node-settings",
        action="store_true",
        help="write into the manifest the run settings of swarm-nodes with these --model, --seed, "
        "--inner-steps, --batch-size and --seq-len (their defaults otherwise), so that they adopt it",
    )
    parser.add_argument("--batch-size", type=int, default=NodeConfig().batch_size)
    parser.add_argument("--seq-len", type=int, default=NodeConfig().seq_len)
    eventloop.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
