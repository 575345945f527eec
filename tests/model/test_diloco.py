from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from swarm.model.data import eval_windows, node_generator, sample_batch, stdlib_corpus
from swarm.model.diloco import DiLoCo, DiLoCoConfig, NonFiniteLossError, inner_lr
from swarm.model.llama import ModelConfig, build_model
from swarm.model.loss import eval_loss
from swarm.model.presets import preset
from swarm.model.state_hash import tensors_sha256

SMALL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


class Toy(nn.Module):
    """Two scalar parameters; its loss pulls them towards the batch's two values."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(1.0))
        self.b = nn.Parameter(torch.tensor(-2.0))


def toy_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (model.a - inputs.float().mean()) ** 2 + (model.b - targets.float().mean()) ** 2


def set_inner(diloco: DiLoCo, *values: float) -> None:
    with torch.no_grad():
        for p, v in zip(diloco.params, values, strict=True):
            p.fill_(v)


def outer(diloco: DiLoCo) -> list[float]:
    return [t.item() for t in diloco.outer_params]


def test_outer_step_matches_a_hand_computation() -> None:
    diloco = DiLoCo(Toy(), loss_fn=toy_loss, config=DiLoCoConfig(inner_steps=1, outer_lr=0.7, outer_momentum=0.9))
    # round 1: θ_inner moved to (0.5, -1.0), so Δ1 = θ_outer - θ_inner = (0.5, -1.0)
    set_inner(diloco, 0.5, -1.0)
    diloco.apply_own()
    # m1 = Δ1; Nesterov update = Δ1 + 0.9 m1 = 1.9 Δ1; θ = θ - 0.7 * 1.9 Δ1
    assert outer(diloco) == pytest.approx([1 - 0.665, -2 + 1.33], abs=1e-6)
    assert [p.item() for p in diloco.params] == outer(diloco)  # θ_inner ← θ_outer
    # round 2: Δ2 = (0.1, 0.2); m2 = 0.9 m1 + Δ2 = (0.55, -0.7); update = Δ2 + 0.9 m2 = (0.595, -0.43)
    set_inner(diloco, 0.335 - 0.1, -0.67 - 0.2)
    diloco.apply_own()
    assert [m.item() for m in diloco.outer_momentum] == pytest.approx([0.55, -0.7], abs=1e-6)
    assert outer(diloco) == pytest.approx([0.335 - 0.7 * 0.595, -0.67 + 0.7 * 0.43], abs=1e-6)
    assert diloco.outer_step == 2


def test_outer_step_agrees_with_torch_sgd_nesterov() -> None:
    diloco = DiLoCo(Toy(), loss_fn=toy_loss, config=DiLoCoConfig(inner_steps=1, outer_lr=0.5, outer_momentum=0.8))
    reference = [nn.Parameter(torch.tensor(1.0)), nn.Parameter(torch.tensor(-2.0))]
    sgd = torch.optim.SGD(reference, lr=0.5, momentum=0.8, nesterov=True)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        deltas = [torch.randn((), generator=gen) for _ in range(2)]
        for p, d in zip(reference, deltas, strict=True):
            p.grad = d.clone()
        sgd.step()
        diloco.apply_outer(deltas)
    assert outer(diloco) == pytest.approx([p.item() for p in reference], abs=1e-6)


def test_no_momentum_without_nesterov_is_plain_sgd() -> None:
    diloco = DiLoCo(
        Toy(), loss_fn=toy_loss, config=DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    )
    set_inner(diloco, 0.25, -1.5)
    diloco.apply_own()  # lr 1, no momentum: θ_outer ← θ_inner
    assert outer(diloco) == [0.25, -1.5]


def _train(diloco: DiLoCo, peer: bytes, tokens: torch.Tensor) -> None:
    while not diloco.ready_for_outer:
        gen = node_generator(peer, diloco.global_inner_step)
        diloco.inner_step(*sample_batch(tokens, batch_size=2, seq_len=16, generator=gen))


def test_group_members_end_with_bit_identical_outer_state() -> None:
    tokens = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    config = DiLoCoConfig(inner_steps=3, lr=1e-2, warmup_steps=0)
    members = [DiLoCo(build_model(SMALL, seed=42), config) for _ in range(2)]
    assert members[0].outer_sha256() == members[1].outer_sha256()
    start = members[0].outer_sha256()
    for _ in range(2):  # two rounds, so the momentum takes part too
        for i, member in enumerate(members):
            _train(member, b"peer-%d" % i, tokens)
        deltas = [m.pseudo_gradients() for m in members]
        assert tensors_sha256(deltas[0]) != tensors_sha256(deltas[1])  # different data, different Δ
        averaged = [(a + b) / 2 for a, b in zip(*deltas, strict=True)]  # what the group agrees on
        for member in members:
            member.apply_outer([t.clone() for t in averaged])
        assert members[0].outer_sha256() == members[1].outer_sha256() != start
        assert tensors_sha256(members[0].outer_momentum) == tensors_sha256(members[1].outer_momentum)
        assert tensors_sha256(members[0].params) == members[0].outer_sha256()  # θ_inner ← θ_outer


def test_a_node_alone_applies_its_own_pseudo_gradient() -> None:
    tokens = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    config = DiLoCoConfig(inner_steps=2, lr=1e-2, warmup_steps=0)
    alone, twin = DiLoCo(build_model(SMALL, seed=5), config), DiLoCo(build_model(SMALL, seed=5), config)
    for node in (alone, twin):
        _train(node, b"me", tokens)
    assert alone.tokens_since_outer == 2 * 2 * 16
    own = alone.pseudo_gradients()
    alone.apply_own()
    twin.apply_outer(own)
    assert alone.outer_sha256() == twin.outer_sha256()
    assert alone.outer_step == 1 and alone.inner_done == 0 and alone.tokens_since_outer == 0


def test_an_averaged_pseudo_gradient_moves_theta_outer_by_the_average() -> None:
    diloco = DiLoCo(
        Toy(), loss_fn=toy_loss, config=DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    )
    diloco.inner_step(torch.full((1, 4), 3), torch.full((1, 4), 5))
    inner = [p.item() for p in diloco.params]
    assert diloco.tokens_since_outer == 4  # the weight this Δ is averaged with
    diloco.apply_outer([t * 0.5 for t in diloco.pseudo_gradients()])  # a peer that stayed at θ_outer
    assert outer(diloco) == pytest.approx([(1 + inner[0]) / 2, (-2 + inner[1]) / 2])
    diloco.apply_outer(diloco.pseudo_gradients())  # with nothing trained
    assert diloco.outer_step == 2


def test_bad_averaged_tensors_are_refused_with_nothing_changed() -> None:
    diloco = DiLoCo(Toy(), loss_fn=toy_loss, config=DiLoCoConfig(inner_steps=1))
    before = diloco.outer_sha256()
    for bad in ([torch.tensor(1.0)], [torch.tensor(1.0), torch.tensor(math.nan)], [torch.zeros(2), torch.zeros(())]):
        with pytest.raises(ValueError):
            diloco.apply_outer(bad)
    assert diloco.outer_sha256() == before and diloco.outer_step == 0


def test_inner_steps_stop_at_h_and_skip_non_finite_losses() -> None:
    diloco = DiLoCo(Toy(), loss_fn=toy_loss, config=DiLoCoConfig(inner_steps=2, warmup_steps=0))
    with pytest.raises(NonFiniteLossError):
        diloco.inner_step(torch.full((1, 2), math.inf), torch.zeros(1, 2))
    assert diloco.inner_done == 0 and [p.item() for p in diloco.params] == [1.0, -2.0]
    for _ in range(2):
        diloco.inner_step(torch.zeros(1, 2), torch.zeros(1, 2))
    with pytest.raises(RuntimeError, match="outer step"):
        diloco.inner_step(torch.zeros(1, 2), torch.zeros(1, 2))


def test_extra_inner_steps_past_h_keep_the_steps_last_rate_draw_their_own_windows_and_end_with_the_step() -> None:
    """extra_room (a node training on while a round lands, swarm/node/loop.py): that many steps past
    H, then none; each at the step's last learning rate, on windows of its own; the next step's
    inner phase (begin_overlap) allows H again."""
    config = DiLoCoConfig(inner_steps=2, lr=1.0, warmup_steps=0, lr_schedule="cosine", total_steps=8)
    diloco = DiLoCo(Toy(), loss_fn=toy_loss, config=config)
    batch = (torch.zeros(1, 2), torch.zeros(1, 2))
    rates = [diloco.inner_step(*batch).lr for _ in range(2)]
    with pytest.raises(RuntimeError, match="outer step"):
        diloco.inner_step(*batch)  # H done, no room past it
    diloco.extra_room = 2
    assert diloco.ready_for_outer  # the next step is past H
    rates += [diloco.inner_step(*batch).lr for _ in range(2)]
    assert rates[2:] == [rates[1], rates[1]] and rates[0] > rates[1]
    with pytest.raises(RuntimeError, match="outer step"):
        diloco.inner_step(*batch)
    assert diloco.inner_done == 4 and diloco.tokens_since_outer == 8  # the extra steps' tokens count
    diloco.begin_overlap(eager=True)
    assert diloco.extra_room == 0 and not diloco.ready_for_outer
    assert diloco.inner_step(*batch).lr < rates[1]  # the next step's own rate, not the extra steps'
    peer = b"\x01" * 34
    same = [torch.randint(0, 1 << 30, (4,), generator=node_generator(peer, 4, extra=e)) for e in (False, True)]
    assert not torch.equal(*same)  # an extra step's index is the next step's first: drawn apart


def test_state_dict_round_trip_and_refusals() -> None:
    source = DiLoCo(Toy(), loss_fn=toy_loss, config=DiLoCoConfig(inner_steps=1))
    set_inner(source, 0.5, 0.5)
    source.apply_own()
    saved = source.state_dict()
    state = {"outer_step": saved["outer_step"]}
    state |= {key: {n: t.clone() for n, t in saved[key].items()} for key in ("params", "momentum")}
    target = DiLoCo(Toy(), loss_fn=toy_loss, config=DiLoCoConfig(inner_steps=1))
    target.load_state_dict(state)
    assert target.outer_step == 1 and target.outer_sha256() == source.outer_sha256()
    assert tensors_sha256(target.outer_momentum) == tensors_sha256(source.outer_momentum)
    assert tensors_sha256(target.params) == target.outer_sha256()
    for broken in (
        {**state, "outer_step": -1},
        {**state, "params": {"a": state["params"]["a"]}},
        {**state, "momentum": {**state["momentum"], "b": torch.tensor(math.inf)}},
    ):
        with pytest.raises(ValueError):
            DiLoCo(Toy(), loss_fn=toy_loss, config=DiLoCoConfig(inner_steps=1)).load_state_dict(broken)


def test_inner_schedule_warms_up_then_decays() -> None:
    config = DiLoCoConfig(lr=1.0, warmup_steps=10, lr_schedule="cosine", total_steps=110, min_lr_ratio=0.1)
    assert inner_lr(config, 0) == pytest.approx(0.1)
    assert inner_lr(config, 9) == pytest.approx(1.0)
    assert inner_lr(config, 60) == pytest.approx(0.55)
    assert inner_lr(config, 110) == pytest.approx(0.1) == inner_lr(config, 10_000)
    assert inner_lr(DiLoCoConfig(lr=1.0, warmup_steps=0), 10_000) == 1.0


@pytest.mark.parametrize(
    "changes",
    [
        {"inner_steps": 0},
        {"lr": 0.0},
        {"warmup_steps": 10, "lr_schedule": "cosine", "total_steps": 10},
        {"outer_momentum": 1.0},
        {"grad_clip": 0.0},
    ],
)
def test_bad_configs_are_refused(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        DiLoCoConfig(**changes)


def test_tiny_model_learns_the_stdlib_corpus_with_diloco_alone() -> None:
    data = stdlib_corpus(1 << 20)
    model = build_model(preset("tiny"), seed=0)
    windows = eval_windows(data.eval, seq_len=64, max_windows=16)
    diloco = DiLoCo(model, DiLoCoConfig(inner_steps=10, lr=3e-3, warmup_steps=5))
    before = eval_loss(model, windows)
    assert before == pytest.approx(math.log(256), abs=0.5)  # about uniform over bytes
    for _ in range(3):  # 30 inner steps
        _train_tiny(diloco, data.train)
        diloco.apply_own()
    after = eval_loss(model, windows)
    assert after < before - 1.5, (before, after)


def _train_tiny(diloco: DiLoCo, tokens: torch.Tensor) -> None:
    while not diloco.ready_for_outer:
        gen = node_generator(b"node", diloco.global_inner_step)
        stats = diloco.inner_step(*sample_batch(tokens, batch_size=4, seq_len=64, generator=gen))
        assert math.isfinite(stats.loss) and stats.lr > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("offload", [False, True])
def test_cuda_inner_steps_use_bf16_autocast_and_fused_adamw(offload: bool) -> None:
    tokens = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    config = DiLoCoConfig(inner_steps=3, lr=1e-2, warmup_steps=0, offload_outer=offload)
    diloco = DiLoCo(build_model(SMALL, seed=42, device="cuda"), config)
    assert diloco.inner_optimizer.defaults["fused"]
    assert diloco.outer_params[0].device.type == ("cpu" if offload else "cuda")
    _train(diloco, b"gpu", tokens)
    cpu = DiLoCo(build_model(SMALL, seed=42), DiLoCoConfig(inner_steps=3))
    deltas = diloco.pseudo_gradients()
    assert all(d.dtype == torch.float32 for d in deltas)
    diloco.apply_outer(deltas)
    cpu.apply_outer([d.cpu() for d in deltas])
    assert diloco.outer_sha256() == cpu.outer_sha256()  # the same outer update bits on GPU and CPU
