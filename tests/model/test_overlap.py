"""DiLoCo's overlapped outer step (begin_overlap, then apply_outer when the average lands): the
state it holds while a round is in flight, what the landing writes, and agreement with blocking
members bit for bit."""

from __future__ import annotations

import pytest
import torch

from swarm.model.data import node_generator, sample_batch, stdlib_corpus
from swarm.model.diloco import DiLoCo, DiLoCoConfig
from swarm.model.llama import ModelConfig, build_model
from swarm.model.state_hash import state_sha256

SMALL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
H = 3


@pytest.fixture(scope="module")
def corpus() -> torch.Tensor:
    return stdlib_corpus().train


def member(seed: int = 0) -> DiLoCo:
    return DiLoCo(build_model(SMALL, seed=0), DiLoCoConfig(inner_steps=H, warmup_steps=1, lr=3e-3))


def train(diloco: DiLoCo, corpus: torch.Tensor, peer: bytes, steps: int = H) -> None:
    for _ in range(steps):
        diloco.inner_step(*sample_batch(corpus, 2, 32, node_generator(peer, diloco.global_inner_step)))


def copy(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


@pytest.mark.parametrize("eager", [True, False])
def test_a_landed_average_gives_the_blocking_members_state_bit_for_bit(corpus: torch.Tensor, eager: bool) -> None:
    """Two members train step 0 on the same windows; one blocks, one overlaps (and trains two
    inner steps of step 1 before the average lands): both end step 0 with one state."""
    blocking, overlapped = member(), member()
    train(blocking, corpus, b"a")
    train(overlapped, corpus, b"a")
    averaged = [d * 0.5 for d in blocking.pseudo_gradients()]  # any average both members receive
    blocking.apply_outer(copy(averaged))
    overlapped.begin_overlap(eager=eager)
    assert overlapped.outer_step == 0 and overlapped.working_step == 1 and overlapped.round_tokens == H * 64
    assert overlapped.global_inner_step == H  # step 1's clock: its schedule and its windows
    train(overlapped, corpus, b"a", 2)
    overlapped.apply_outer(copy(averaged))
    assert overlapped.outer_step == 1 and overlapped.pending is None and overlapped.inner_done == 2
    assert state_sha256(overlapped.state_dict()) == state_sha256(blocking.state_dict())


def test_eager_landing_of_our_own_delta_leaves_the_inner_weights_as_they_are(corpus: torch.Tensor) -> None:
    """No group: our own Δ lands (apply_own); eager began round t+1 from exactly that outer step."""
    alone, overlapped = member(), member()
    for d in (alone, overlapped):
        train(d, corpus, b"b")
    alone.apply_own()
    overlapped.begin_overlap(eager=True)
    assert all(torch.equal(p, q) for p, q in zip(overlapped.params, alone.params, strict=True))
    train(overlapped, corpus, b"b", 1)
    before = copy([p.detach() for p in overlapped.params])
    overlapped.apply_own()
    assert all(torch.equal(p.detach(), q) for p, q in zip(overlapped.params, before, strict=True))
    assert state_sha256(overlapped.state_dict()) == state_sha256(alone.state_dict())


def test_the_landing_keeps_what_round_t_plus_1_trained(corpus: torch.Tensor) -> None:
    """After the landing, the next Δ is exactly the progress made since round t+1 began (up to
    rounding): nothing of it is lost, nothing of round t counted twice."""
    d = member()
    train(d, corpus, b"c")
    d.begin_overlap(eager=False)
    base = copy(d.pending.base)
    train(d, corpus, b"c", 2)
    progress = [b - p.detach() for b, p in zip(base, d.params, strict=True)]
    d.apply_outer([g * 0.3 for g in d.round_deltas()])
    for delta, want in zip(d.pseudo_gradients(), progress, strict=True):
        torch.testing.assert_close(delta, want, rtol=0, atol=1e-6)


def test_while_in_flight_the_state_is_step_ts_and_a_loaded_state_replaces_the_round(corpus: torch.Tensor) -> None:
    d = member()
    train(d, corpus, b"d")
    served = state_sha256(d.state_dict())
    d.begin_overlap(eager=True)
    train(d, corpus, b"d", 1)
    assert state_sha256(d.state_dict()) == served  # θ_outer, momentum and step untouched until it lands
    with pytest.raises(RuntimeError, match="in flight"):
        d.pseudo_gradients()
    with pytest.raises(RuntimeError, match="already in flight"):
        d.begin_overlap(eager=True)
    other = member()
    other.apply_own()  # some other node's step 1
    d.load_state_dict(other.state_dict())
    assert d.pending is None and d.inner_done == 0 and d.outer_step == 1
    assert all(torch.equal(p.detach(), t) for p, t in zip(d.params, d.outer_params, strict=True))


def test_an_eval_during_round_t_plus_1_sees_the_outer_weights_and_puts_the_inner_ones_back(
    corpus: torch.Tensor,
) -> None:
    d = member()
    train(d, corpus, b"e")
    d.begin_overlap(eager=True)
    train(d, corpus, b"e", 1)
    d.apply_outer([g * 0.5 for g in d.round_deltas()])
    inner = copy([p.detach() for p in d.params])
    seen = d.on_outer_weights(lambda: copy([p.detach() for p in d.params]))
    assert all(torch.equal(s, t) for s, t in zip(seen, d.outer_params, strict=True))
    assert all(torch.equal(p.detach(), q) for p, q in zip(d.params, inner, strict=True))


def test_the_overlap_sweep_runs_the_nodes_arithmetic_and_its_workers_agree() -> None:
    """scripts/experiments/overlap_sweep.py drives DiLoCo.begin_overlap itself: a short run of 2 workers whose
    averages land mid-round (three rounds of H = 2) ends with one θ_outer (it raises otherwise) and a finite loss."""
    from scripts.experiments.diloco_sim import HSchedule, Setting, Workload, load_corpus
    from scripts.experiments.overlap_sweep import train_overlapped

    workload = Workload(workers=2, steps=6, seq_len=32, eval_windows=2, lr_schedule="constant")
    loss, _ = train_overlapped(load_corpus(), workload, Setting(name="H2", h=HSchedule(target=2)), "eager", 0.5)
    assert 0 < loss < 20
