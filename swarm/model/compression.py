"""What one outer step sends: `--compression CODEC[:DENSITY]`, error feedback, chosen blocks.

    spec = CompressionSpec.parse("int8:0.25")          # codec int8, a quarter of the blocks
    payload = outgoing(deltas, spec, feedback, run_id, outer_step, block_size)
    averaged = averager.run_round(group, payload.tensors)   # what travels: dense, reducible
    update = payload.unpack(averaged)                  # full-size tensors to apply (zeros elsewhere)
    if applied and payload.compensated: feedback.commit(payload.compensated)

With density 1 (the default) the tensors are the pseudo-gradients themselves (after error
feedback when it is on); below 1 they are one dense vector of the step's chosen blocks
(sparse_blocks.py), the same blocks on every member of the step. The spec is part of the run's
settings (all nodes of a run agree on the codec and the density).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarm.model.compression_spec import CompressionSpec
from swarm.model.error_feedback import Compensated, ErrorFeedback
from swarm.model.sparse_blocks import BlockSelection, step_seed
from swarm.utils.tensor_layout import flatten, restore


@dataclass(frozen=True, slots=True)
class StepPayload:
    """The tensors one outer step all-reduces, and how to turn their average back into an update."""

    tensors: list[torch.Tensor]
    like: list[torch.Tensor]  # the pseudo-gradients' shapes, dtypes and devices
    selection: BlockSelection | None = None
    compensated: Compensated | None = None  # commit it once the average was applied

    def unpack(self, averaged: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self.selection is None:
            return list(averaged)
        return restore(self.selection.scatter(flatten(averaged[:1])), self.like)


def outgoing(
    deltas: Sequence[torch.Tensor],
    spec: CompressionSpec,
    feedback: ErrorFeedback | None,
    run_id: str,
    outer_step: int,
    block_size: int,
) -> StepPayload:
    """What this step sends of `deltas` (call it in the trainer's thread: it is tensor work)."""
    like = list(deltas)
    selection = None
    if spec.density < 1.0:
        numel = sum(d.numel() for d in deltas)
        selection = BlockSelection.choose(numel, block_size, spec.density, step_seed(run_id, outer_step))
    if feedback is not None:
        compensated = feedback.compensate(deltas, selection)
        tensors = [compensated.compact] if compensated.compact is not None else compensated.sent
        return StepPayload(tensors, like, selection, compensated)
    if selection is None:
        return StepPayload(like, like)
    flat = flatten(deltas)
    return StepPayload([selection.gather(flat)], like, selection)
