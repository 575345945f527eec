"""A donor that holds one swarm state and serves it, as a training node would, without training.

    python -m scripts.tools.state_seeder --initial-peers MADDR --run-id RUN --model tiny --step 5

It builds a deterministic state (the model's seed weights, moved by a seeded random step, plus a
seeded momentum), joins the DHT, advertises the state under `<run>/state` and serves it with the
real StateServer until SIGTERM. Its first stdout line is JSON:
{"peer_id", "maddrs", "manifest", "state_sha256" (as DiLoCo.state_sha256 hashes it),
"state_bytes"}. scripts/bench/state.py runs it as a separate process; tests run the same donor
in their own event loop (`Seeder.start`, through the `seeder` fixture of tests/state/conftest.py).

A donor can be made slow, lying or stalled through StateServer's public fault hook (ServeFaults):
`--upload-delay` sleeps after each 256 KiB, `--corrupt` flips one byte of every shard it sends.
`--claim-run`/`--claim-model` write another run id or model into its manifest (a state of
another run, correctly hashed), and `--node-settings` the run settings of swarm-nodes of the same
flags (without it: none, as scripts/bench/state.py expects).

It serves the state's lineage too (`state.lineage`): rounds of one, signed by itself, from the
run's genesis (the model's seed weights) to its state. A newcomer whose anchor is genesis and
whose initial peers hold no state takes such a lineage (state/lineage.py says why): the seeder
stands in for the swarm that would have made the state.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from swarm.dht.node import DHTNode
from swarm.model.checkpoint import RunInfo, Snapshot, make_snapshot
from swarm.model.llama import build_model
from swarm.model.presets import preset
from swarm.model.state_hash import state_sha256
from swarm.node.config import NodeConfig
from swarm.node.settings import RunSettings, training_settings
from swarm.p2p.config import P2PConfig
from swarm.p2p.host import P2PHost
from swarm.p2p.identity import Identity
from swarm.state.holders import advertise
from swarm.state.lineage_book import LINEAGE, serve_lineage
from swarm.state.receipts import Receipt, RoundBody, sign
from swarm.state.server import ServeFaults, StateServer
from swarm.utils import eventloop

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


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


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SeedSpec:
    """Which state a donor holds and what its manifest says about it."""

    run_id: str  # advertised and served under this run
    model: str = "tiny"
    seed: int = 0
    step: int = 5
    inner_steps: int = 100
    shard_bytes: int = 64 << 20
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)  # run settings in the manifest
    claim_run: str | None = None  # the manifest names this run instead (a state of another run)
    claim_model: str | None = None  # the manifest names this model instead (a state of another model)

    @classmethod
    def like_node(cls, node: NodeConfig, **changes: Any) -> SeedSpec:
        """The state of the run that swarm-nodes of `node`'s flags train: they adopt it."""
        spec = cls(run_id=node.run_id, model=node.model, seed=node.seed, inner_steps=node.inner_steps,
                   settings=training_settings(node).wire())  # fmt: skip
        return dataclasses.replace(spec, **changes)

    def run_info(self) -> RunInfo:
        model = self.claim_model or self.model
        return RunInfo(
            run_id=self.claim_run or self.run_id,
            model=model,
            model_config=dataclasses.asdict(preset(model)),
            seed=self.seed,
            data="stdlib",
            inner_steps=self.inner_steps,
            settings=self.settings,
        )

    def genesis(self) -> str:
        """state_sha256 of the run's initial state: the seed weights, zero momentum, step 0."""
        net = build_model(preset(self.model), self.seed)
        params = {n: p.detach().float() for n, p in net.named_parameters() if p.requires_grad}
        return state_sha256({"outer_step": 0, "params": params, "momentum": {n: torch.zeros_like(p) for n, p in
                                                                             params.items()}})  # fmt: skip

    def lineage(self, identity: Identity, state_hash: str) -> list[Receipt]:
        """Rounds of one, signed by `identity`, from the genesis to the state (module docstring)."""
        settings = RunSettings.of(self.settings).digest if self.settings else b""
        receipts, parent = [], bytes.fromhex(self.genesis())
        for step in range(self.step):
            last = step == self.step - 1
            result = bytes.fromhex(state_hash) if last else hashlib.sha256(b"seeded %d" % step).digest()
            body = RoundBody(self.run_id, settings, step, bytes(32), (identity.peer_id,), (1.0,), parent, result)
            receipts.append(Receipt(body, {identity.peer_id: sign(body, identity)}))
            parent = result
        return receipts

    def snapshot(self) -> tuple[Snapshot, str]:
        """(the snapshot served, the state's state_sha256). CPU-heavy: call it in a thread."""
        state = make_state(self.model, self.seed, self.step)
        state_hash = state_sha256(state)
        return make_snapshot(state, self.run_info(), self.shard_bytes), state_hash  # the state itself is dropped


class Seeder:
    """One donor in the caller's event loop: a host, a DHT node, a StateServer (with `faults`)
    and the advertisement of its one state. `await Seeder.start(...)`, then `close()`."""

    def __init__(self, host: P2PHost, dht: DHTNode, server: StateServer, snapshot: Snapshot, state_hash: str) -> None:
        self.host, self.dht, self.server, self.snapshot, self.state_hash = host, dht, server, snapshot, state_hash

    @classmethod
    async def start(cls, spec: SeedSpec, initial_peers: Sequence[str], *, faults: ServeFaults | None = None,
                    max_uploads: int = 4, host_maddrs: Sequence[str] = (LOOPBACK,)) -> Seeder:  # fmt: skip
        snapshot, state_hash = await asyncio.to_thread(spec.snapshot)
        host = await P2PHost(config=P2PConfig(host_maddrs=tuple(host_maddrs))).start()
        try:
            dht = await DHTNode(host=host, initial_peers=initial_peers).start()
        except BaseException:
            await host.close()
            raise
        server = StateServer(host, spec.run_id, max_uploads=max_uploads, faults=faults)
        server.publish(snapshot)
        receipts = await asyncio.to_thread(spec.lineage, host.identity, state_hash)
        serve_lineage(host, spec.run_id, lambda: receipts)
        seeder = cls(host, dht, server, snapshot, state_hash)
        expiration = time.time() + 3600
        if not await advertise(dht, spec.run_id, snapshot.manifest, host.visible_maddrs, expiration):
            await seeder.close()
            raise RuntimeError("no DHT node stored the seeder's advertisement")
        return seeder

    def line(self) -> dict[str, Any]:
        """What the script prints first (module docstring)."""
        return {
            "peer_id": str(self.host.peer_id),
            "maddrs": self.host.visible_maddrs,
            "manifest": self.snapshot.manifest.sha256,
            "state_sha256": self.state_hash,
            "state_bytes": self.snapshot.manifest.total_bytes,
        }

    async def close(self) -> None:
        """Stop serving at once, as a donor that dies would (its connections close). Idempotent."""
        self.server.close()
        self.host.remove_handler(LINEAGE)
        await self.dht.close()
        await self.host.close()


async def serve(args: argparse.Namespace) -> None:
    settings = {}
    if args.node_settings:  # the run settings of swarm-nodes given these flags (node/settings.py)
        node = NodeConfig(run_id=args.run_id, model=args.model, seed=args.seed, inner_steps=args.inner_steps,
                          batch_size=args.batch_size, seq_len=args.seq_len)  # fmt: skip
        settings = training_settings(node).wire()
    spec = SeedSpec(run_id=args.run_id, model=args.model, seed=args.seed, step=args.step, inner_steps=args.inner_steps,
                    shard_bytes=args.shard_bytes, settings=settings, claim_run=args.claim_run,
                    claim_model=args.claim_model)  # fmt: skip
    faults = None
    if args.upload_delay or args.corrupt:
        faults = ServeFaults(chunk_delay=args.upload_delay, corrupt=args.corrupt)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    seeder = await Seeder.start(
        spec, args.initial_peers, faults=faults, max_uploads=args.max_uploads, host_maddrs=args.host_maddrs
    )
    try:
        sys.stdout.write(json.dumps(seeder.line()) + "\n")
        sys.stdout.flush()
        await stop.wait()
    finally:
        await seeder.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--host-maddrs", nargs="+", default=[LOOPBACK],
                        help="where to listen (bench_state --link: the donor's address in its namespace)")  # fmt: skip
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
