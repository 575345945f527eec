"""Digests of the swarm state: two nodes hold the same state iff these are equal."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch

from swarm_kernels import as_memoryview


def state_sha256(state: dict[str, Any]) -> str:
    """sha256 of an outer state as DiLoCo.state_dict() gives it: step, then θ_outer and the
    momentum, each sorted by name (so a state loaded from shards, which lists its tensors shard
    by shard, hashes as the model's own does)."""
    digest = hashlib.sha256(b"swarm-state/2" + int(state["outer_step"]).to_bytes(8, "big"))
    for kind in ("params", "momentum"):
        for name in sorted(state[kind]):
            digest.update(as_memoryview(state[kind][name].detach().cpu().contiguous()))
    return digest.hexdigest()


def tensors_sha256(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 over the raw bytes of each tensor in turn (moved to the CPU, contiguous)."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(as_memoryview(t.detach().cpu().contiguous()))
    return digest.hexdigest()
