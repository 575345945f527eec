"""Sparsity that stays reducible: every member of a step sends the same blocks of its pseudo-gradient.

Top-k sparsification (SparseLoCo's) picks other coordinates on every peer, so indices travel and
peers gather each other's payloads (O(n) per peer). Here the blocks are chosen by a seed every
member of a step knows (the run and the outer step): each member gathers the chosen blocks of
its pseudo-gradient into one dense vector, the group all-reduces that vector with the usual
butterfly (parts stay contiguous, no index travels, the result is bit-identical on every member),
and each member scatters the average back (zeros elsewhere). What a step does not send stays in
the node's error-feedback residual (error_feedback.py) until a later step chooses its block.

A block is `block_size` consecutive values of the flattened pseudo-gradients (the codec's block,
so each keeps one scale); block j is chosen at a step when hash32(j ^ seed) < density * 2^32,
with an integer hash written in int64 torch arithmetic that never overflows: the choice is the
same on every machine and torch version (a torch.randperm would tie nodes to one version's
generator, and a node on another would average other coordinates).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B  # < 2^31: a product of it and a 32-bit value fits in int64


def step_seed(run_id: str, outer_step: int) -> int:
    """The 32-bit seed every member of `run_id`'s step `outer_step` derives alike."""
    digest = hashlib.sha256(f"swarm-sparse-blocks/1\x00{run_id}\x00{outer_step}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def block_hash(indices: torch.Tensor, seed: int) -> torch.Tensor:
    """hash32 of each block index (int64 in [0, 2^32)), the classic xorshift-multiply mix."""
    h = torch.bitwise_xor(indices, seed) & _MASK32
    h = (h * _MULTIPLIER) & _MASK32
    h = torch.bitwise_xor(h >> 16, h)
    h = (h * _MULTIPLIER) & _MASK32
    return torch.bitwise_xor(h >> 16, h)


@dataclass(frozen=True, slots=True)
class BlockSelection:
    """The blocks of one step: `gather` the chosen values of a flat vector into a dense one,
    `scatter` a dense one back (zeros elsewhere). density 1.0 chooses every block."""

    numel: int
    block_size: int
    blocks: torch.Tensor  # sorted indices (int64) of the chosen blocks

    @classmethod
    def choose(cls, numel: int, block_size: int, density: float, seed: int) -> BlockSelection:
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density}")
        count = -(-numel // block_size)
        indices = torch.arange(count, dtype=torch.int64)
        if density < 1.0:
            indices = indices[block_hash(indices, seed) < int(density * 2**32)]
        return cls(numel, block_size, indices)

    @property
    def compact_numel(self) -> int:
        return int(self.blocks.numel()) * self.block_size

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """The chosen blocks of `flat` (numel values), as one dense vector (the last block padded
        with zeros when numel is not a multiple of block_size)."""
        return self._blocks_of(flat)[self.blocks].reshape(-1)

    def scatter(self, compact: torch.Tensor) -> torch.Tensor:
        """A flat vector of numel values: `compact` in the chosen blocks, zeros elsewhere."""
        if compact.numel() != self.compact_numel:
            raise ValueError(f"{compact.numel()} values for {self.blocks.numel()} blocks of {self.block_size}")
        padded = torch.zeros(self._padded_numel(), dtype=compact.dtype)
        padded.view(-1, self.block_size)[self.blocks] = compact.view(-1, self.block_size)
        return padded[: self.numel]

    def _padded_numel(self) -> int:
        return -(-self.numel // self.block_size) * self.block_size

    def _blocks_of(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.numel() != self.numel:
            raise ValueError(f"a vector of {flat.numel()} values for a selection over {self.numel}")
        pad = self._padded_numel() - self.numel
        padded = torch.cat([flat.reshape(-1), flat.new_zeros(pad)]) if pad else flat.reshape(-1)
        return padded.view(-1, self.block_size)
