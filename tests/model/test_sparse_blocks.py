"""Reducible sparsity (swarm/model/sparse_blocks.py, compression.py): the blocks a step sends are
the same everywhere (pinned values: a change of torch or of the hash would make nodes average
other coordinates), what is not sent stays in the error-feedback residual, and the
--compression spec is checked."""

from __future__ import annotations

import pytest
import torch

from swarm.model.compression import outgoing
from swarm.model.compression_spec import CompressionSpec
from swarm.model.error_feedback import ErrorFeedback
from swarm.model.sparse_blocks import BlockSelection, block_hash, step_seed

CODECS = ("int8", "fp16", "none")


def test_the_choice_is_pinned_across_machines_and_versions() -> None:
    """Golden values: every node must choose exactly these (a node that chose others would add
    its values to other coordinates than its group's)."""
    assert step_seed("run", 7) == step_seed("run", 7) != step_seed("run", 8)
    assert step_seed("run", 7) == 0xE6135F68
    hashes = block_hash(torch.arange(6, dtype=torch.int64), 12345).tolist()
    # the same as the plain-integer hash: x = ((j ^ s) * M) mod 2^32; x ^= x >> 16; twice
    assert hashes == [1747545881, 1529301928, 3214139262, 1699593848, 3177249767, 2907709144]
    chosen = BlockSelection.choose(64 * 1000, 64, 0.1, step_seed("run", 7)).blocks
    assert chosen[:5].tolist() == [0, 3, 19, 42, 44] and chosen.numel() == 99


def test_the_density_is_kept_and_steps_choose_other_blocks() -> None:
    numel, block = 64 * 20_000, 64
    a = BlockSelection.choose(numel, block, 0.25, step_seed("r", 1))
    b = BlockSelection.choose(numel, block, 0.25, step_seed("r", 2))
    for selection in (a, b):
        assert abs(selection.blocks.numel() / 20_000 - 0.25) < 0.02
        assert torch.equal(selection.blocks, torch.sort(selection.blocks).values)
    overlap = len(set(a.blocks.tolist()) & set(b.blocks.tolist())) / a.blocks.numel()
    assert 0.15 < overlap < 0.35  # independent choices: about a quarter in common
    assert BlockSelection.choose(1000, 64, 1.0, 5).blocks.numel() == 16  # density 1: every block


def test_gather_and_scatter_keep_the_chosen_values_and_zero_the_rest() -> None:
    numel = 64 * 10 + 17  # a partial last block
    flat = torch.randn(numel)
    selection = BlockSelection(numel, 64, torch.tensor([0, 3, 10]))
    compact = selection.gather(flat)
    assert compact.numel() == 3 * 64
    assert torch.equal(compact[:64], flat[:64]) and torch.equal(compact[64:128], flat[192:256])
    assert torch.equal(compact[128:145], flat[640:]) and not compact[145:].any()  # the padding
    back = selection.scatter(compact)
    assert back.numel() == numel and torch.equal(back[192:256], flat[192:256]) and not back[64:192].any()
    with pytest.raises(ValueError):
        selection.scatter(torch.zeros(5))
    with pytest.raises(ValueError):
        selection.gather(torch.zeros(5))


def test_what_a_step_does_not_send_stays_in_the_residual_whole() -> None:
    torch.manual_seed(0)
    deltas = [torch.randn(40, 64), torch.randn(300)]
    spec = CompressionSpec("int8", 0.25)
    feedback = ErrorFeedback("int8", 64)
    payload = outgoing(deltas, spec, feedback, "r", 3, 64)
    assert payload.selection is not None and len(payload.tensors) == 1
    assert payload.tensors[0].numel() == payload.selection.compact_numel
    flat = torch.cat([d.reshape(-1) for d in deltas])
    residual = payload.compensated.residual
    chosen = torch.zeros(flat.numel(), dtype=torch.bool)
    chosen[payload.selection.scatter(torch.ones(payload.selection.compact_numel)).bool()] = True
    assert torch.equal(residual[~chosen], flat[~chosen])  # not sent: kept whole
    assert float(residual[chosen].abs().max()) <= float(flat.abs().max()) / 127  # sent: within one int8 step
    update = payload.unpack(payload.tensors)  # as if the group averaged alone
    assert [u.shape for u in update] == [d.shape for d in deltas]
    torch.testing.assert_close(torch.cat([u.reshape(-1) for u in update]) + residual, flat, rtol=0, atol=1e-6)


def test_without_feedback_a_sparse_step_sends_the_chosen_blocks_of_the_delta() -> None:
    deltas = [torch.randn(1000)]
    payload = outgoing(deltas, CompressionSpec("int8", 0.5), None, "r", 0, 64)
    assert payload.compensated is None
    assert torch.equal(payload.tensors[0], payload.selection.gather(deltas[0]))
    dense = outgoing(deltas, CompressionSpec("int8"), None, "r", 0, 64)
    assert dense.tensors == deltas and dense.unpack(deltas) == deltas


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("int8", CompressionSpec("int8")),
        ("int8:0.1", CompressionSpec("int8", 0.1)),
        ("none", CompressionSpec("none")),
        ("fp16:1", CompressionSpec("fp16")),
    ],
)
def test_compression_specs(text: str, expected: CompressionSpec) -> None:
    assert CompressionSpec.parse(text, CODECS) == expected


@pytest.mark.parametrize("text", ["int3", "int8:0", "int8:1.5", "int8:nan", "int8:x", "none:0.5", "", "int8:-1"])
def test_bad_compression_specs_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        CompressionSpec.parse(text, CODECS)
