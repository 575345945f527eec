"""One vector for a list of tensors and back: the layout every pseudo-gradient takes on its way
through a round (DiLoCo's Δ -> the codec and the all-reduce -> the averaged tensors).

    vector = flatten(tensors)          # float32 on the CPU, the tensors' values in order (a new tensor)
    views = split(vector, shapes)      # views of `vector` in those shapes (no copy)
    like = restore(vector, tensors)    # the same, each back on its tensor's device and dtype

The order is the list's; the receiving side must hold the same shapes in the same order, which the
run's settings and the model's architecture guarantee (nodes of other models never group).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The values of `tensors`, in order, as one new float32 vector on the CPU."""
    if not tensors:
        return torch.empty(0, dtype=torch.float32)
    return torch.cat([t.detach().reshape(-1).to(device="cpu", dtype=torch.float32) for t in tensors])


def split(vector: torch.Tensor, shapes: Sequence[torch.Size | tuple[int, ...]]) -> list[torch.Tensor]:
    """Views of `vector` in `shapes`; ValueError unless their sizes add up to its length."""
    sizes = [torch.Size(shape).numel() for shape in shapes]
    if sum(sizes) != vector.numel():
        raise ValueError(f"{vector.numel()} values for tensors of {sum(sizes)}")
    return [part.view(shape) for part, shape in zip(vector.split(sizes), shapes, strict=True)]


def restore(vector: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """split(vector) in the shapes of `like`, each on its tensor's device and in its dtype."""
    return [part.to(device=t.device, dtype=t.dtype) for part, t in zip(split(vector, [t.shape for t in like]), like,
                                                                         strict=True)]  # fmt: skip
