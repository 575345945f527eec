"""The one layout of a pseudo-gradient (swarm/utils/tensor_layout.py): flatten, split, restore."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.utils.tensor_layout import flatten, restore, split

shapes = st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple), min_size=1, max_size=5)


@settings(max_examples=50, deadline=None)
@given(shapes, st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_restore_undoes_flatten_in_every_shape_and_dtype(sizes: list[tuple[int, ...]], dtype: torch.dtype) -> None:
    tensors = [torch.randn(s).to(dtype) for s in sizes]
    vector = flatten(tensors)
    assert vector.dtype == torch.float32 and vector.numel() == sum(t.numel() for t in tensors)
    back = restore(vector, tensors)
    assert [(b.shape, b.dtype) for b in back] == [(t.shape, t.dtype) for t in tensors]
    assert all(torch.equal(b, t) for b, t in zip(back, tensors, strict=True))


def test_split_gives_views_and_refuses_a_vector_of_another_length() -> None:
    vector = torch.arange(10, dtype=torch.float32)
    a, b = split(vector, [torch.Size([2, 3]), (4,)])
    a[0, 0] = 100.0  # a view: no copy on the way back
    assert vector[0] == 100.0 and b.tolist() == [6.0, 7.0, 8.0, 9.0]
    for wrong in ([(3,)], [(2, 3), (5,)]):
        with pytest.raises(ValueError, match="values for tensors of"):
            split(vector, wrong)


def test_flatten_copies_its_input() -> None:
    t = torch.zeros(3)
    vector = flatten([t])
    vector += 1
    assert t.sum() == 0 and flatten([]).numel() == 0
