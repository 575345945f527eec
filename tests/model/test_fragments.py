"""Streaming DiLoCo's fragments (DiLoCoConfig.fragments, swarm/model/fragments.py): how the
parameters are cut, and that outer step s syncs fragment s mod P alone, with its own weight,
members agreeing bit for bit whether they block or overlap."""

from __future__ import annotations

import pytest
import torch

from swarm.model.data import node_generator, sample_batch, stdlib_corpus
from swarm.model.diloco import DiLoCo, DiLoCoConfig
from swarm.model.fragments import fragments_of
from swarm.model.llama import ModelConfig, build_model
from swarm.model.state_hash import state_sha256

SMALL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
H = 2  # inner steps per outer step: each of P fragments is synced every P * H
TOKENS = 2 * 32  # per inner step (train's batches)


@pytest.mark.parametrize(
    ("sizes", "fragments", "expected"),
    [
        ([7, 7, 7], 1, [range(0, 3)]),
        ([1, 1, 1, 1], 4, [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]),
        ([5] * 8, 3, [range(0, 3), range(3, 6), range(6, 8)]),
        ([100, 1, 1, 1], 2, [range(0, 1), range(1, 4)]),  # a big first tensor is a fragment alone
        ([1, 1, 1, 100], 2, [range(0, 3), range(3, 4)]),
        ([1, 1, 100], 3, [range(0, 1), range(1, 2), range(2, 3)]),  # each fragment keeps a tensor
    ],
)
def test_fragments_are_runs_of_consecutive_tensors_of_about_equal_size(sizes, fragments, expected) -> None:
    assert fragments_of(sizes, fragments) == expected


@pytest.mark.parametrize(("sizes", "fragments"), [([4, 4], 0), ([4, 4], 3), ([], 1), ([4, 0], 1)])
def test_impossible_fragments_are_refused(sizes: list[int], fragments: int) -> None:
    with pytest.raises(ValueError, match="fragment"):
        fragments_of(sizes, fragments)


@pytest.mark.parametrize("fragments", [0, -1, True, 1.5])
def test_the_config_refuses_a_fragment_count_that_is_not_a_positive_int(fragments: object) -> None:
    with pytest.raises(ValueError, match="fragments"):
        DiLoCoConfig(fragments=fragments)  # type: ignore[arg-type]


def test_more_fragments_than_tensors_is_refused_with_the_models_count() -> None:
    with pytest.raises(ValueError, match=r"fragments must be in \[1, 20\]"):
        DiLoCo(build_model(SMALL, seed=0), DiLoCoConfig(fragments=1000))


@pytest.fixture(scope="module")
def corpus() -> torch.Tensor:
    return stdlib_corpus().train


def member(fragments: int = 3) -> DiLoCo:
    return DiLoCo(build_model(SMALL, seed=0), DiLoCoConfig(inner_steps=H, warmup_steps=1, lr=3e-3, fragments=fragments))


def train(diloco: DiLoCo, corpus: torch.Tensor, peer: bytes, steps: int = H) -> None:
    for _ in range(steps):
        diloco.inner_step(*sample_batch(corpus, 2, 32, node_generator(peer, diloco.global_inner_step)))


def copy(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


def test_each_outer_step_syncs_its_fragment_alone(corpus: torch.Tensor) -> None:
    d = member()
    assert len(d.parts) == 3 and [i for part in d.parts for i in part] == list(range(len(d.params)))
    for step in range(4):
        fragment = step % 3
        train(d, corpus, b"a")
        assert d.fragment == fragment
        # a fragment's weight: every token since it was last synced (fragment 1 at step 1: 2 steps' worth)
        assert d.round_tokens == TOKENS * H * (step + 1 if step < 3 else 3)
        deltas = d.pseudo_gradients()
        assert len(deltas) == len(d.parts[fragment])
        outer_before, inner_before = copy(d.outer_params), [p.detach().clone() for p in d.params]
        d.apply_outer([g * 0.5 for g in deltas])
        assert d.outer_step == step + 1 and d.inner_done == 0
        for i in range(len(d.params)):
            mine = i in d.parts[fragment]
            assert torch.equal(d.outer_params[i], outer_before[i]) is not mine  # only its θ_outer moved
            # its θ_inner is θ_outer now; the others keep what they trained
            expected = d.outer_params[i] if mine else inner_before[i]
            assert torch.equal(d.params[i].detach(), expected)


def test_an_average_of_the_whole_model_is_refused_for_a_fragment(corpus: torch.Tensor) -> None:
    d = member()
    train(d, corpus, b"a")
    before = d.state_sha256()
    with pytest.raises(ValueError, match="tensors for"):
        d.apply_outer([torch.zeros_like(t) for t in d.outer_params])
    assert d.state_sha256() == before and d.outer_step == 0


@pytest.mark.parametrize("eager", [True, False])
def test_members_that_block_and_overlap_agree_on_every_fragments_step(corpus: torch.Tensor, eager: bool) -> None:
    """Two members on other windows, one blocking, one overlapped (its average lands one inner
    step into the next step), average each step's fragment: one state after every step."""
    blocking, overlapped = member(), member()
    train(overlapped, corpus, b"b")
    for step in range(4):
        train(blocking, corpus, b"a")
        mine, theirs = blocking.pseudo_gradients(), overlapped.round_deltas() if overlapped.pending else None
        if theirs is None:
            theirs = overlapped.pseudo_gradients()
            overlapped.begin_overlap(eager=eager)
            assert overlapped.pending is not None and overlapped.pending.fragment == step % 3
        average = [(a + b) * 0.5 for a, b in zip(mine, theirs, strict=True)]
        blocking.apply_outer(copy(average))
        train(overlapped, corpus, b"b", 1)  # the next step's first inner step, before the landing
        overlapped.apply_outer(copy(average))
        assert state_sha256(overlapped.state_dict()) == state_sha256(blocking.state_dict()), step
        train(overlapped, corpus, b"b", H - 1)
        if step < 3:
            overlapped.begin_overlap(eager=eager)


def test_a_loaded_state_puts_every_fragment_on_it(corpus: torch.Tensor) -> None:
    source, d = member(), member()
    train(source, corpus, b"a")
    source.apply_outer(source.pseudo_gradients())
    train(d, corpus, b"b")
    d.load_state_dict(source.state_dict())
    assert d.outer_step == 1 and d.fragment == 1 and d.round_tokens == 0
    assert all(torch.equal(p.detach(), t) for p, t in zip(d.params, source.outer_params, strict=True))


def test_one_fragment_is_plain_diloco(corpus: torch.Tensor) -> None:
    plain = DiLoCo(build_model(SMALL, seed=0), DiLoCoConfig(inner_steps=H, warmup_steps=1, lr=3e-3))
    one = member(fragments=1)
    for d in (plain, one):
        train(d, corpus, b"a")
        assert d.round_tokens == d.tokens_since_outer == TOKENS * H
        d.apply_outer([g * 0.5 for g in d.pseudo_gradients()])
    assert plain.state_sha256() == one.state_sha256()
