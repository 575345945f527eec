"""FSDP2 inside a node (`--shard`): every rank holds 1/N of the parameters and of the inner AdamW.

    shard_model(model, group)                 # fully_shard each block, then the root
    inner = ShardedInner(model, config)       # AdamW over this rank's shards, DiLoCo's schedule
    inner.step(loss, global_step)             # clip (a collective), check, step
    gather(model, mirror)                     # θ_inner in full into rank 0's mirror (others: None)
    scatter(model, mirror)                    # rank 0's mirror into every rank's shards

Rank 0's SwarmNode does not train the sharded model: its DiLoCo wraps a full copy on the CPU (the
mirror: θ_inner, from which the pseudo-gradient, the outer step, the state and the eval are
taken) with an optimizer that does nothing (`HeldOptimizer`). After every inner step, inside the
permit, all ranks gather the full θ_inner into the mirror, so the node finds it whole whenever
it starts an outer step; after an outer step (or a fetched or resumed state) SYNC scatters the
mirror back into the shards. The gather costs one more all-gather of the parameters per inner
step (FSDP already gathers them at every forward); gathering only after the last step of an outer
step would save it, but needs the node to announce its last permit.

The mirror is the price of a pseudo-gradient reduced by rank 0 alone: rank 0 needs CPU memory for
the full model, θ_outer and the momentum; the GPUs hold 1/N each. Averaging each rank's shard
through rank 0's connections, shard by shard, would remove it (not built).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from swarm.model.configs import DiLoCoConfig
from swarm.model.diloco import NonFiniteLossError
from swarm.model.schedule import inner_lr
from swarm.ranks.group import RankGroup

__all__ = ["HeldOptimizer", "ShardedInner", "gather", "scatter", "shard_model"]


def shard_model(model: nn.Module, group: RankGroup) -> nn.Module:
    """fully_shard every transformer block, then the root (embeddings, norm, output head)."""
    # torch.distributed's fsdp and tensor modules are imported where used: with sympy under them
    # they take 1-2 s to import, which every importer of swarm.ranks (a test worker collecting the
    # suite, a rank that never shards) would pay
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(group.device.type, (group.world_size,))
    for block in getattr(model, "layers", []):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    group.ddp = model  # the module every rank's forward runs through (rank_step)
    return model


class HeldOptimizer(torch.optim.Optimizer):
    """Rank 0's mirror's optimizer under --shard: the sharded model took the step already."""

    def __init__(self, params: list[nn.Parameter], lr: float = 0.0) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


class ShardedInner:
    """DiLoCo's inner step (clip to grad_clip, skip a non-finite loss or norm, the schedule's
    rate, AdamW with weight decay on matrices) over this rank's shards: the same on every rank."""

    def __init__(self, model: nn.Module, config: DiLoCoConfig) -> None:
        self.config = config
        self.params = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas)

    def step(self, loss: torch.Tensor, global_step: int) -> None:
        max_norm = self.config.grad_clip if self.config.grad_clip is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)  # a collective over the shards
        from torch.distributed.tensor import DTensor

        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        loss_value, norm_value = float(loss), float(norm)
        if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"loss {loss_value}, gradient norm {norm_value} at step {global_step}")
        for group in self.optimizer.param_groups:
            group["lr"] = inner_lr(self.config, global_step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def gather(model: nn.Module, mirror: list[torch.Tensor] | None) -> None:
    """Every rank: the full parameters (one all-gather each); rank 0 copies them into `mirror`."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.requires_grad]
    for i, p in enumerate(params):
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if mirror is not None:
            mirror[i].copy_(full)


@torch.no_grad()
def scatter(model: nn.Module, mirror: list[torch.Tensor] | None) -> None:
    """Every rank: its shard of rank 0's `mirror` (others pass None) into its parameters."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for p in model.parameters() if p.requires_grad]
    for i, p in enumerate(params):
        assert isinstance(p, DTensor), "scatter is for fully_shard's parameters"
        local = p.to_local()
        full = (mirror[i].to(local.device, local.dtype) if mirror is not None
                else torch.empty(p.shape, dtype=local.dtype, device=local.device))  # fmt: skip
        local.copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=0).to_local())
