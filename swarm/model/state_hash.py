"""Digests of the swarm state (two nodes hold the same state iff these are equal) and of a
wrapped model's architecture and initial state (peers of one run build the same model)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

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


class Wrapped(Protocol):
    """What model_fingerprint reads of a DiLoCo (named so, not imported: diloco.py uses these digests)."""

    @property
    def names(self) -> Sequence[str]: ...
    @property
    def params(self) -> Sequence[torch.Tensor]: ...
    @property
    def outer_params(self) -> Sequence[torch.Tensor]: ...


def model_fingerprint(diloco: Wrapped) -> tuple[str, str]:
    """(architecture, initial state) of a wrapped model as short hex digests: its trainable
    parameters' names, shapes and dtypes, and θ_outer's bytes. Equal on two processes that
    build the same model from the same seed."""
    layout = hashlib.sha256(b"swarm-architecture/1")
    for name, p in zip(diloco.names, diloco.params, strict=True):
        layout.update(f"{name}:{tuple(p.shape)}:{p.dtype}\n".encode())
    return layout.hexdigest()[:32], tensors_sha256(diloco.outer_params)[:32]
