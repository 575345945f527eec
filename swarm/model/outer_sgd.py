"""The outer optimizer's arithmetic: Nesterov SGD on θ_outer, one tensor at a time, and the check
every tensor handed to it passes first (the right shape, floats, no NaN or inf), as does every
outer state loaded from a checkpoint or a peer.

Agreement: the outer update is written as single IEEE-754 operations (no fused multiply-adds,
no `alpha=` scaling), so members that hold the same θ_outer and momentum and apply the same
averaged tensors end with bit-identical θ_outer (tests/model/test_diloco.py checks it by hash on
the CPU). The same ops on a GPU round the same way, so a CUDA member and a member with θ_outer
offloaded to the CPU should agree too; that cross-device claim is not yet pinned by a test.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from swarm.model.configs import DiLoCoConfig


def outer_sgd_step(theta: torch.Tensor, momentum: torch.Tensor, g: torch.Tensor, config: DiLoCoConfig) -> torch.Tensor:
    """One tensor's outer step, in place: m ← μ·m + Δ, then θ ← θ - η·(Δ + μ·m) (Nesterov) or
    θ - η·m; returns θ."""
    lr, mu = config.outer_lr, config.outer_momentum
    momentum.mul_(mu).add_(g)
    update = torch.mul(momentum, mu).add_(g) if config.nesterov else momentum.clone()
    return theta.sub_(update.mul_(lr))


def checked_tensors(
    tensors: Sequence[torch.Tensor], what: str, names: Sequence[str], like: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """`tensors` as fp32, each on the device of its `like` tensor (θ_outer's), one for each of
    `names`; ValueError on a wrong count, shape or a non-finite value."""
    if len(tensors) != len(names):
        raise ValueError(f"{what}: {len(tensors)} tensors for {len(names)} parameters")
    out = []
    for t, name, ref in zip(tensors, names, like, strict=True):
        if not isinstance(t, torch.Tensor) or t.shape != ref.shape or not t.is_floating_point():
            raise ValueError(f"{what}: {name} must be a float tensor of shape {tuple(ref.shape)}")
        t = t.detach().to(ref.device, torch.float32)
        if not torch.isfinite(t).all():
            raise ValueError(f"{what}: {name} has NaN or inf values")
        out.append(t)
    return out


def checked_state(
    state: dict[str, Any], names: Sequence[str], like: Sequence[torch.Tensor]
) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
    """An outer state as DiLoCo.state_dict() gives it, checked: (outer step, θ_outer, momentum),
    the tensors in `names` order as checked_tensors gives them; ValueError on a bad step, a
    missing or extra name, a wrong shape or a non-finite value."""
    step = state.get("outer_step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"outer_step must be an int >= 0, got {step!r}")
    loaded = []
    for key in ("params", "momentum"):
        tensors = state.get(key)
        if not isinstance(tensors, dict) or set(tensors) != set(names):
            raise ValueError(f"state[{key!r}] must map exactly this model's parameter names to tensors")
        loaded.append(checked_tensors([tensors[name] for name in names], f"state[{key!r}]", names, like))
    return step, loaded[0], loaded[1]
