"""The inner AdamW of a node's own model (DiLoCo's default inner optimizer).

On CUDA it is torch's fused AdamW. Elsewhere it is `AdamW` below: torch.optim.AdamW's update on
CPU (its single-tensor path, the one torch takes there) op for op, so bit for bit the same
(tests/model/test_adamw.py), without torch.optim. Any torch.optim optimizer imports
torch._dynamo on first use (its methods are wrapped to disable compilation), 2-3 CPU-seconds at
every node process's start, which on a 2-core machine is as long as importing torch itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

# torch.optim.AdamW's defaults
EPS = 1e-8
BETAS = (0.9, 0.999)


class AdamW:
    """AdamW with decoupled weight decay over `param_groups` (dicts of "params", "lr", "betas",
    "eps", "weight_decay", as torch.optim's): `step()` updates the parameters that have a
    gradient, `zero_grad()` drops the gradients. Owns the moments and the step count of each
    parameter (`state`), created at its first update."""

    def __init__(self, groups: Sequence[dict[str, Any]], *, lr: float, betas: tuple[float, float] = BETAS,
                 eps: float = EPS, weight_decay: float = 0.01) -> None:  # fmt: skip
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        self.param_groups: list[dict[str, Any]] = []
        for group in groups:
            params = list(group["params"])
            if any(not p.is_leaf for p in params):
                raise ValueError("AdamW can only optimize leaf tensors")
            self.param_groups.append({**defaults, **group, "params": params})
        self.state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                state = self.state.get(param)
                if state is None:  # as torch: the step count a float32 scalar, the moments zeros like the parameter
                    state = self.state[param] = {
                        "step": torch.tensor(0.0, dtype=torch.float32),
                        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                    }
                step_t, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
                step_t += 1
                if weight_decay != 0:
                    param.mul_(1 - lr * weight_decay)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step = step_t.item()
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                step_size = lr / bias_correction1
                denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
                param.addcdiv_(exp_avg, denom, value=-step_size)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()


def inner_adamw(named: list[tuple[str, nn.Parameter]], *, lr: float, betas: tuple[float, float],
                weight_decay: float, device: torch.device) -> AdamW | torch.optim.AdamW:  # fmt: skip
    """The inner optimizer of DiLoCo's own: weight decay on matrices only; torch's fused AdamW on
    CUDA, AdamW (above) elsewhere."""
    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if device.type == "cuda":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)
    return AdamW(groups, lr=lr, betas=betas)
