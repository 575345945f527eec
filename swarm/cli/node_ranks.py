"""swarm-node's side of a node of several ranks: decide the launch, then set the ranks up for rank 0.

    launch = plan(nproc, config)              # None: one rank, the plain node (torch not loaded)
    if launch is not None and not launch.leader:
        sys.exit(follow(launch, timeout=...)) # a torchrun rank >= 1
    with NodeRanks.open(launch, config, peer, ...) as ranks:
        SwarmNode(ranks.config, data=ranks.data, model=ranks.model, training_thread=ranks.training_thread, ...)

Errors become one line (CliError / click.UsageError), never a traceback.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import click

from swarm.cli.common import CliError
from swarm.node.config import NodeConfig

if TYPE_CHECKING:
    from torch import nn

    from swarm.model.data import TokenData
    from swarm.model.diloco import OptimizerFactory
    from swarm.node.training_thread import TrainingThreadFactory
    from swarm.ranks.launch import RankLaunch


def plan(nproc: int, config: NodeConfig) -> RankLaunch | None:
    """This process's place in its node, or None for a node of one rank (the usual case, decided
    before torch loads). Raises click.UsageError with the one line that says what to do."""
    from swarm.ranks.launch import TORCHRUN_VARS, LaunchError, plan_launch

    under_torchrun = all(name in os.environ for name in TORCHRUN_VARS)
    if nproc == 1 and not under_torchrun:
        return None
    import torch

    try:
        launch = plan_launch(nproc=nproc, env=os.environ, device=config.device, cuda_count=torch.cuda.device_count(),
                             batch_size=config.batch_size)  # fmt: skip
    except LaunchError as e:
        raise click.UsageError(str(e)) from None
    return launch if launch.distributed else None


@dataclass(frozen=True, slots=True)
class NodeRanks:
    """Rank 0's view of its node's ranks, ready to train: the config with this rank's device,
    the data, the model (identical on every rank) and the training loop for SwarmNode."""

    config: NodeConfig
    data: TokenData
    model: nn.Module  # --shard: rank 0's full mirror on the CPU (swarm/ranks/shard.py)
    training_thread: TrainingThreadFactory
    pids: tuple[int, ...]  # the rank processes started here (none under torchrun)
    inner_optimizer: OptimizerFactory | None  # --shard: the mirror's HeldOptimizer

    @staticmethod
    @contextmanager
    def open(launch: RankLaunch, config: NodeConfig, peer: bytes, *, threads: int | None, verbose: int,
             timeout: float, shard: bool = False) -> Iterator[NodeRanks]:  # fmt: skip
        """Start ranks 1..N-1 (unless torchrun did), meet them, tell them the settings, build and
        wrap the model; at exit close the group and stop whatever rank still runs."""
        from swarm.model.data import load_data
        from swarm.model.llama import build_model
        from swarm.model.presets import preset
        from swarm.ranks.follower import hello_settings
        from swarm.ranks.group import RankGroup, RankGroupError
        from swarm.ranks.launch import LaunchError
        from swarm.ranks.leader import LeaderTrainingThread
        from swarm.ranks.shard import HeldOptimizer, ShardedInner, shard_model
        from swarm.ranks.spawn import SpawnedRanks

        spawned: SpawnedRanks | None = None
        group: RankGroup | None = None
        stopped = False  # the node stopped as it should, not on an error (a rank died or hung, ...)
        try:
            store = None
            if launch.spawn:
                store, spawned = SpawnedRanks.start(launch, timeout=timeout)
            group = RankGroup.open(launch, timeout=timeout, store=store)
            config = replace(config, device=launch.device)
            try:
                group.hello(hello_settings(config, peer, threads=threads, verbose=verbose, shard=shard))
                try:
                    data = load_data(config.data, tokenizer=config.tokenizer)
                except ValueError as e:
                    raise CliError(str(e)) from None
                model_config = preset(config.model, vocab_size=data.vocab_size)
                model = build_model(model_config, config.seed, device=group.device)
                sharded = None
                if shard:  # the ranks train the shards; the node's DiLoCo wraps a full mirror on the CPU
                    sharded = ShardedInner(shard_model(model, group), config.diloco_config())
                    model = build_model(model_config, config.seed, device="cpu")
                    config = replace(config, device="cpu", offload_outer=True)
                else:
                    group.wrap(model)
            except RuntimeError as e:  # a collective failed: a rank died or timed out meeting us
                dead = spawned.dead() if spawned is not None else None
                raise RankGroupError(dead or f"the node's ranks could not start together: {e}") from None
            watchdog = spawned.dead if spawned is not None else (lambda: None)
            loop = functools.partial(LeaderTrainingThread, group=group, watchdog=watchdog, sharded=sharded)
            yield NodeRanks(config, data, model, loop, tuple(spawned.pids if spawned else ()),
                            HeldOptimizer if shard else None)  # fmt: skip
            stopped = True
        except (RankGroupError, LaunchError) as e:
            raise CliError(str(e)) from None
        finally:
            if group is not None:
                group.close()
            if spawned is not None:
                if stopped:
                    spawned.close()
                else:
                    spawned.kill()
