"""Error feedback (swarm/model/error_feedback.py): what the codec drops is sent later, the
bookkeeping is exact, and what a flat round's codec makes of `sent` is `sent`."""

from __future__ import annotations

import pytest
import torch

from swarm.model.error_feedback import ErrorFeedback
from swarm_kernels.codecs import get_codec

BLOCK = 64


def small_and_large(steps: int) -> list[list[torch.Tensor]]:
    """Per step: one tensor whose first value (1.0) sets each block's scale, so that the others
    (1e-4, far below int8's step of 1/127) round to zero every time without feedback."""
    delta = torch.full((4 * BLOCK,), 1e-4)
    delta[::BLOCK] = 1.0
    return [[delta.clone().view(4, BLOCK)] for _ in range(steps)]


def test_without_feedback_small_values_never_move_and_with_it_they_do() -> None:
    steps = small_and_large(200)
    codec = get_codec("int8", block_size=BLOCK)
    plain = torch.zeros(4 * BLOCK)
    for (delta,) in steps:
        codec.decode_accumulate(plain, codec.encode(delta.reshape(-1)), 1.0)
    ef = ErrorFeedback("int8", BLOCK)
    fed = torch.zeros(4 * BLOCK)
    for deltas in steps:
        compensated = ef.compensate(deltas)
        fed += compensated.sent[0].reshape(-1)
        ef.commit(compensated)
    small = torch.ones(4 * BLOCK, dtype=torch.bool)
    small[::BLOCK] = False
    assert float(plain[small].abs().max()) == 0.0  # lost for good
    truth = 200 * 1e-4
    # what was sent falls short of the truth by the residual, at most one int8 step (1/127)
    assert float((fed[small] - truth).abs().max()) <= 1 / 127 + 1e-6
    assert float((fed[small] + ef.residual[small] - truth).abs().max()) < 1e-4


def test_sent_plus_residual_is_the_delta_plus_the_decayed_residual() -> None:
    torch.manual_seed(0)
    ef = ErrorFeedback("int8", BLOCK, decay=0.5)
    deltas = [torch.randn(3, 50), torch.randn(77)]
    first = ef.compensate(deltas)
    ef.commit(first)
    second = ef.compensate(deltas)
    flat = torch.cat([d.reshape(-1) for d in deltas])
    sent = torch.cat([s.reshape(-1) for s in second.sent])
    torch.testing.assert_close(sent + second.residual, flat + 0.5 * first.residual, rtol=0, atol=1e-6)
    assert [s.shape for s in second.sent] == [d.shape for d in deltas]


@pytest.mark.parametrize("codec", ["int8", "fp16"])
def test_the_rounds_codec_carries_what_is_sent_unchanged(codec: str) -> None:
    """The averager encodes `sent` again with the same codec and blocks (parts start on block
    boundaries): it must come out as it went in, or the residual would not be what was dropped."""
    torch.manual_seed(1)
    ef = ErrorFeedback(codec, BLOCK)
    sent = torch.cat([s.reshape(-1) for s in ef.compensate([torch.randn(10_000) * 3]).sent])
    again = get_codec(codec, block_size=BLOCK)
    out = torch.zeros_like(sent)
    again.decode_accumulate(out, again.encode(sent), 1.0)
    torch.testing.assert_close(out, sent, rtol=2e-7, atol=0)


def test_a_failed_round_changes_nothing_and_reset_drops_the_residual() -> None:
    ef = ErrorFeedback("int8", BLOCK)
    (delta,) = small_and_large(1)[0]
    ef.commit(ef.compensate([delta]))
    kept = ef.residual.clone()
    ef.compensate([delta])  # a round that failed: never committed
    assert torch.equal(ef.residual, kept)
    ef.reset()
    assert ef.residual is None and ef.norm() == 0.0


def test_the_residual_survives_a_checkpoint_and_bad_ones_are_refused() -> None:
    ef = ErrorFeedback("int8", BLOCK)
    ef.commit(ef.compensate(small_and_large(1)[0]))
    restored = ErrorFeedback("int8", BLOCK)
    restored.load_state_dict(ef.state_dict())
    assert torch.equal(restored.residual, ef.residual)
    for bad in (torch.full((4,), float("nan")), torch.zeros(2, 2), torch.zeros(4, dtype=torch.float64)):
        with pytest.raises(ValueError):
            restored.load_state_dict({"error_feedback/residual": bad})
    with pytest.raises(ValueError, match="residual of"):
        restored.compensate([torch.zeros(5)])
    with pytest.raises(ValueError):
        ErrorFeedback("int8", BLOCK, decay=0.0)
