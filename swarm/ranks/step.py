"""One inner step of one rank: its rows of the node's batch, forward and backward under DDP.

The node's batch at a global inner step is the one a single-rank node of the same PeerID would
draw (node_generator(PeerID, step), `batch_size` windows): rank k trains rows
[k·b, (k+1)·b) with b = batch_size / N. DDP averages the ranks' gradients, each the mean over
b rows, so the step equals the single-rank node's up to floating-point order; the loss is
averaged the same way. Sampling the whole batch on every rank costs an index gather, nothing.
"""

from __future__ import annotations

import torch

from swarm.model.data import TokenData, node_generator, sample_batch
from swarm.model.loss import autocast_for, lm_loss
from swarm.ranks.group import RankGroup

__all__ = ["rank_rows", "rank_step"]


def rank_rows(batch_size: int, world_size: int, rank: int) -> slice:
    """The rows of the node's batch that `rank` trains."""
    if world_size < 1 or not 0 <= rank < world_size or batch_size % world_size:
        raise ValueError(f"batch {batch_size} does not split over {world_size} ranks for rank {rank}")
    per_rank = batch_size // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def rank_step(
    group: RankGroup, data: TokenData, peer: bytes, step: int, *, batch_size: int, seq_len: int
) -> tuple[torch.Tensor, int]:
    """This rank's forward and backward (through group.ddp) for the node's global inner step
    `step`: (the loss averaged over the ranks, the node's target tokens: every rank's)."""
    ddp = group.ddp
    if ddp is None:
        raise RuntimeError("rank_step before RankGroup.wrap")
    inputs, targets = sample_batch(data.train, batch_size, seq_len, node_generator(peer, step))
    rows = rank_rows(batch_size, group.world_size, group.rank)
    inputs, targets = inputs[rows].to(group.device), targets[rows].to(group.device)
    with autocast_for(group.device):
        loss = lm_loss(ddp, inputs, targets)
    loss.backward()  # DDP all-reduces the gradients (their mean over the ranks) during this
    return group.mean(loss), targets.numel() * group.world_size
