"""Error feedback: what the codec dropped from a node's pseudo-gradient is sent in later steps.

A lossy codec (int8 with one scale per 64 values; int4, int2) rounds every pseudo-gradient it
carries, and without feedback the rounding is lost for good: small coordinates that always round
to zero never move. With error feedback (as in SparseLoCo and MuLoCo) each node keeps the part
of its pseudo-gradient the codec dropped and adds it to the next one:

    v   = decay * e + Δ            e: this node's residual (fp32, one buffer per tensor)
    q   = decode(encode(v))        exactly what the round's codec makes of v
    send q;  e = v - q             once the round's average was applied (commit)

`q` is computed on the concatenation of the tensors in order, with the round's codec and block
size: the averager flattens the tensors the same way and splits parts on block boundaries
(averaging/partition.py), so the encoding of q in a flat round is q again (a codec's grid is
idempotent up to one rounding of each block's scale): the residual is what the wire dropped. A
grid round (past max_group_size) quantizes per row: there the residual is the flat encoding's.

The residual belongs to this node, never to the swarm state: it is kept in the local
checkpoint only. It is dropped when the node fetches a state (its pending contribution was not
part of the swarm's lineage; what it dropped is of a state the node no longer holds), and kept
when a round fails (nothing was sent: `compensate` again from the same residual) or when the
node applies its own Δ alone (nothing was dropped). `decay` < 1 lets old residuals fade
(SparseLoCo decays its error buffer); 1 is plain error feedback.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarm.model.sparse_blocks import BlockSelection
from swarm.utils.tensor_layout import flatten, restore
from swarm_kernels.codecs import get_codec


@dataclass(frozen=True, slots=True)
class Compensated:
    """One step's pseudo-gradients after error feedback: `sent` goes to the round; `residual`
    becomes the node's residual if the round's average is applied (ErrorFeedback.commit)."""

    sent: list[torch.Tensor]
    residual: torch.Tensor  # flat fp32
    compact: torch.Tensor | None = None  # with a block selection: the chosen blocks of `sent`, dense


class ErrorFeedback:
    """A node's error-feedback residual for one codec. Owns one flat fp32 buffer the size of the
    pseudo-gradients (allocated at the first step). Per outer step: `compensate(deltas)` in the
    trainer's thread, average `.sent`, then `commit(compensated)` once the average was applied;
    `reset()` when the node adopts a fetched state; `state_dict`/`load_state_dict` for the local
    checkpoint."""

    def __init__(self, codec: str, block_size: int, decay: float = 1.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"error feedback decay must be in (0, 1], got {decay}")
        self.codec = get_codec(codec, block_size=block_size)
        self.decay = decay
        self.residual: torch.Tensor | None = None

    def compensate(self, deltas: Sequence[torch.Tensor], selection: BlockSelection | None = None) -> Compensated:
        """`deltas` plus the (decayed) residual, as the codec will carry it, and what it drops.
        With a block selection (sparse_blocks.py) only its blocks are carried: the others stay in
        the residual whole."""
        flat = flatten(deltas)
        if self.residual is not None:
            if self.residual.numel() != flat.numel():
                raise ValueError(f"a residual of {self.residual.numel()} values for {flat.numel()} parameters")
            flat.add_(self.residual, alpha=self.decay)
        compact = None
        if selection is None:
            carried = torch.zeros_like(flat)
            self.codec.decode_accumulate(carried, self.codec.encode(flat), 1.0)
        else:
            chosen = selection.gather(flat)
            compact = torch.zeros_like(chosen)
            self.codec.decode_accumulate(compact, self.codec.encode(chosen), 1.0)
            carried = selection.scatter(compact)
        residual = flat.sub_(carried)  # v - q, in v's buffer
        return Compensated(restore(carried, deltas), residual, compact)

    def commit(self, compensated: Compensated) -> None:
        """The round averaged `compensated.sent` and the average was applied: keep what it dropped."""
        self.residual = compensated.residual

    def reset(self) -> None:
        self.residual = None

    def norm(self) -> float:
        """The residual's L2 norm (0.0 when there is none): how much the codec still owes."""
        return 0.0 if self.residual is None else float(self.residual.norm())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {} if self.residual is None else {"error_feedback/residual": self.residual.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        residual = state.get("error_feedback/residual")
        if residual is None:
            self.residual = None
            return
        if residual.dtype != torch.float32 or residual.dim() != 1 or not torch.isfinite(residual).all():
            raise ValueError("an error-feedback residual must be a finite flat float32 tensor")
        self.residual = residual.clone()
