"""Ranks 1..N-1 of a node: build the same model, then follow rank 0's commands until STOP.

    python -m swarm.ranks.follower --rank 1 --world-size 2 --port 29500 --device cpu --timeout 120
    (spawn.py starts it so; under torchrun, swarm-node's ranks >= 1 call follow() themselves)

A follower speaks to nobody but its node's ranks: no DHT, no identity, no checkpoint. It learns
the node's settings from rank 0 (the hello), so a torchrun rank given other flags still trains
rank 0's run. It ends with exit 0 on STOP and, with one line on stderr and exit 1, when rank 0
is gone (a collective fails or times out), or on a command it cannot follow.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from swarm.model.data import TokenData, load_data
from swarm.model.diloco import DiLoCo, NonFiniteLossError
from swarm.model.llama import build_model
from swarm.model.presets import preset
from swarm.model.state_hash import tensors_sha256
from swarm.node.config import NodeConfig
from swarm.ranks.commands import Command, Op
from swarm.ranks.group import RankGroup, describe
from swarm.ranks.launch import LaunchError, RankLaunch
from swarm.ranks.shard import ShardedInner, gather, scatter, shard_model
from swarm.ranks.step import rank_step

logger = logging.getLogger("swarm.ranks.follower")  # also when run as __main__

__all__ = ["follow", "hello_settings", "main"]


def hello_settings(config: NodeConfig, peer: bytes, *, threads: int | None, verbose: int,
                   shard: bool = False) -> dict[str, Any]:  # fmt: skip
    """What rank 0 tells the others in the hello (JSON values)."""
    return {"config": dataclasses.asdict(config), "peer": peer.hex(), "threads": threads, "verbose": verbose,
            "shard": shard}  # fmt: skip


def follow(launch: RankLaunch, *, timeout: float, spawned: bool = False) -> int:
    """Run this rank until rank 0 says STOP (0) or is lost (1, said in one line). `spawned`:
    rank 0 started us and made the TCPStore (spawn.py); else torchrun's rendezvous address."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is rank 0's to handle: it stops us in order
    try:
        store = None
        if spawned:  # the same kind of store object as rank 0's, so that both see the same keys
            store = dist.TCPStore(launch.master_addr, launch.master_port or 0, launch.world_size, is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout))  # fmt: skip
        group = RankGroup.open(launch, timeout=timeout, store=store)
    except Exception as e:
        return _fail(launch.rank, str(e))
    try:
        return _follow(group)
    except LaunchError as e:  # mixed device types: rank 0 says the same line
        return _fail(launch.rank, str(e))
    except Exception as e:
        return _fail(launch.rank, f"lost rank 0 of this node ({describe(e)}): exiting")
    finally:
        group.close()


def _follow(group: RankGroup) -> int:
    settings = group.hello(None)
    config = NodeConfig(**{**settings["config"], "device": str(group.device), "offload_outer": True})
    peer = bytes.fromhex(settings["peer"])
    if settings.get("threads"):
        torch.set_num_threads(int(settings["threads"]))
    verbose = int(settings.get("verbose") or 0)
    logging.getLogger("swarm").setLevel(logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else
                                        logging.DEBUG)  # fmt: skip
    data = load_data(config.data, tokenizer=config.tokenizer)
    model = build_model(preset(config.model, vocab_size=data.vocab_size), config.seed, device=group.device)
    if settings.get("shard"):
        return _follow_sharded(group, config, data, peer, model)
    # θ_outer offloaded: a follower never applies an outer step; DiLoCo gives it the same clip,
    # schedule and AdamW as rank 0, so the ranks' parameters stay bit-identical
    diloco = DiLoCo(model, config.diloco_config())
    group.wrap(model)
    logger.info("rank %d of %d on %s: following rank 0", group.rank, group.world_size, group.device)

    def sync(command: Command) -> None:
        diloco.outer_step, diloco.inner_done = command.outer_step, command.inner_done  # rank 0's clock
        group.broadcast_params(diloco.params)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("rank %d: θ sha256 %s at outer step %d", group.rank, tensors_sha256(diloco.params),
                         command.outer_step)  # fmt: skip

    def step(command: Command) -> None:
        diloco.outer_step, diloco.inner_done = command.outer_step, command.inner_done
        loss, tokens = rank_step(group, data, peer, diloco.global_inner_step, batch_size=config.batch_size,
                                 seq_len=config.seq_len)  # fmt: skip
        try:
            diloco.step_after_backward(tokens, loss=loss)
        except NonFiniteLossError:
            pass  # rank 0 saw the same mean loss and gradient: it skipped too, and decides what next

    return _obey(group, sync, step)


def _obey(group: RankGroup, sync: Callable[[Command], None], step: Callable[[Command], None]) -> int:
    """Rank 0's commands until STOP (exit code 0): SYNC and STEP as the model is kept."""
    while True:
        command = group.receive()
        if command.op is Op.STOP:
            logger.info("rank %d: rank 0 says stop", group.rank)
            return 0
        if command.op is not Op.PING:
            (sync if command.op is Op.SYNC else step)(command)


def _follow_sharded(group: RankGroup, config: NodeConfig, data: TokenData, peer: bytes, model: nn.Module) -> int:
    """--shard: the same commands, on this rank's shards (shard.py)."""
    shard_model(model, group)
    inner = ShardedInner(model, config.diloco_config())
    logger.info("rank %d of %d on %s: following rank 0 (sharded)", group.rank, group.world_size, group.device)

    def step(command: Command) -> None:
        at = command.outer_step * config.inner_steps + command.inner_done
        loss, _ = rank_step(group, data, peer, at, batch_size=config.batch_size, seq_len=config.seq_len)
        try:
            inner.step(loss, at)
        except NonFiniteLossError:
            pass  # rank 0 saw the same: it skipped too
        gather(model, None)

    return _obey(group, lambda _: scatter(model, None), step)


def _fail(rank: int, message: str) -> int:
    print(f"swarm-node rank {rank}: {message}", file=sys.stderr, flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swarm.ranks.follower", description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", required=True, help="this rank's torch device: cpu or cuda:K")
    parser.add_argument("--backend", required=True, choices=("gloo", "nccl"))
    parser.add_argument("--timeout", type=float, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    logging.getLogger("swarm").setLevel(logging.WARNING)  # until rank 0 says how verbose
    local = int(args.device.partition(":")[2] or 0) if args.device.startswith("cuda") else args.rank
    launch = RankLaunch(rank=args.rank, world_size=args.world_size, local_rank=local, spawn=0, backend=args.backend,
                        device=args.device, master_port=args.port)  # fmt: skip
    return follow(launch, timeout=args.timeout, spawned=True)


if __name__ == "__main__":
    sys.exit(main())
