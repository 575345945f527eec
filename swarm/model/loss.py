"""The language-modelling loss, for training and for the shared eval set."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats per token) of `model(inputs)` against `targets`,
    both int64 [batch, seq]; computed in fp32 whatever the logits' dtype."""
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """bf16 autocast on CUDA; nothing elsewhere (the CPU path runs in fp32)."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def eval_loss(model: nn.Module, windows: torch.Tensor, batch_size: int = 16) -> float:
    """Mean loss over eval windows [n, seq_len + 1] (from `data.eval_windows`), on the model's
    device; every window counts the same. Leaves the model in the train/eval mode it found."""
    if windows.dim() != 2 or windows.shape[0] == 0 or windows.shape[1] < 2:
        raise ValueError(f"eval windows must be [n >= 1, seq_len + 1 >= 2], got {tuple(windows.shape)}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    try:
        for batch in windows.split(batch_size):
            batch = batch.to(device)
            with autocast_for(device):
                loss = lm_loss(model, batch[:, :-1], batch[:, 1:])
            total += loss.double() * batch.shape[0]
    finally:
        model.train(was_training)
    return total.item() / windows.shape[0]
