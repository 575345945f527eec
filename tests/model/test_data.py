from __future__ import annotations

import sys

import pytest
import torch

from swarm.model.data import (
    DataUnavailableError,
    eval_windows,
    load_data,
    node_generator,
    sample_batch,
    stdlib_corpus,
)
from swarm_kernels import as_memoryview

MIB = 1 << 20


@pytest.fixture(scope="module")
def corpus():
    return stdlib_corpus(MIB)


def test_the_stdlib_corpus_splits_the_same_way_every_time(corpus) -> None:
    again = stdlib_corpus(MIB)
    assert again.fingerprint == corpus.fingerprint
    assert torch.equal(again.train, corpus.train) and torch.equal(again.eval, corpus.eval)
    assert corpus.name == "stdlib" and corpus.vocab_size == 256
    assert corpus.train.dtype == torch.uint8
    assert MIB <= len(corpus.train) + len(corpus.eval) <= MIB + 1
    assert 0.01 < len(corpus.eval) / len(corpus.train) < 0.2
    assert b"def " in bytes(as_memoryview(corpus.eval[:20000].contiguous()))  # it is Python source
    assert stdlib_corpus(MIB // 4).fingerprint != corpus.fingerprint


def test_node_generators_differ_by_peer_and_step_and_repeat() -> None:
    def draw(peer: bytes, step: int) -> torch.Tensor:
        return torch.randint(0, 1 << 30, (4,), generator=node_generator(peer, step))

    assert torch.equal(draw(b"\x00\x24peer-a", 5), draw(b"\x00\x24peer-a", 5))
    assert not torch.equal(draw(b"\x00\x24peer-a", 5), draw(b"\x00\x24peer-b", 5))
    assert not torch.equal(draw(b"\x00\x24peer-a", 5), draw(b"\x00\x24peer-a", 6))
    with pytest.raises(ValueError):
        node_generator(b"peer", -1)


def test_sample_batch_gives_shifted_windows_that_differ_by_peer(corpus) -> None:
    inputs, targets = sample_batch(corpus.train, 4, 32, node_generator(b"peer-a", 0))
    assert inputs.shape == targets.shape == (4, 32) and inputs.dtype == torch.long
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    again, _ = sample_batch(corpus.train, 4, 32, node_generator(b"peer-a", 0))
    other, _ = sample_batch(corpus.train, 4, 32, node_generator(b"peer-b", 0))
    assert torch.equal(inputs, again) and not torch.equal(inputs, other)
    text = bytes(as_memoryview(corpus.train))
    assert bytes(inputs[0].tolist()) in text  # a real window of the training split


def test_sample_batch_refuses_too_little_data() -> None:
    with pytest.raises(ValueError):
        sample_batch(torch.zeros(10, dtype=torch.uint8), 1, 9, torch.Generator())


def test_eval_windows_are_fixed_disjoint_and_in_bounds(corpus) -> None:
    windows = eval_windows(corpus.eval, seq_len=64, max_windows=16)
    assert windows.shape == (16, 65)
    assert torch.equal(windows, eval_windows(stdlib_corpus(MIB).eval, seq_len=64, max_windows=16))
    assert torch.equal(windows[0], corpus.eval[:65].long())
    short = eval_windows(torch.arange(100, dtype=torch.uint8), seq_len=9, max_windows=64)
    assert short.shape == (10, 10) and torch.equal(short.flatten(), torch.arange(100))
    with pytest.raises(ValueError):
        eval_windows(torch.zeros(5, dtype=torch.uint8), seq_len=9)


def test_hugging_face_data_without_the_packages_is_a_clear_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    with pytest.raises(DataUnavailableError, match="pip install"):
        load_data("hf:roneneldan/TinyStories", tokenizer="gpt2")


def test_load_data_dispatches_and_refuses_unknown_specs() -> None:
    assert load_data("stdlib", max_bytes=MIB).fingerprint == stdlib_corpus(MIB).fingerprint
    with pytest.raises(DataUnavailableError, match="tokenizer"):
        load_data("hf:roneneldan/TinyStories")
    with pytest.raises(ValueError, match="unknown data"):
        load_data("wikipedia")
