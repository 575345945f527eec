"""swarm.model.adamw.AdamW against torch.optim.AdamW on CPU: the same parameters, bit for bit."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from swarm.model.adamw import AdamW, inner_adamw
from swarm.model.configs import DiLoCoConfig
from swarm.model.diloco import DiLoCo
from swarm.model.llama import build_model
from swarm.model.presets import preset


def _twins(seed: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(7, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    twin = nn.Sequential(nn.Linear(7, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    twin.load_state_dict(model.state_dict())
    return model, twin


def _groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.8, 0.95)])
def test_the_same_steps_give_the_same_bits_as_torchs_adamw(weight_decay: float, betas: tuple[float, float]) -> None:
    ours_model, torch_model = _twins(1)
    ours = AdamW(_groups(ours_model, weight_decay), lr=3e-3, betas=betas)
    theirs = torch.optim.AdamW(_groups(torch_model, weight_decay), lr=3e-3, betas=betas)
    data = torch.Generator().manual_seed(2)
    for step in range(25):
        x = torch.randn(16, 7, generator=data)
        lr = 3e-3 * (0.5 + 0.5 * (step % 7) / 7)  # a schedule: the rate changes between steps
        for model, optimizer in ((ours_model, ours), (torch_model, theirs)):
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = model(x).square().mean()
            loss.backward()
            if step % 5 == 4:  # a parameter without a gradient this step: neither its moments nor its step move
                model[1].weight.grad = None
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
            assert torch.equal(a, b), f"step {step}: {(a - b).abs().max()}"
            assert a.grad is None and b.grad is None
    for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
        assert torch.equal(ours.state[a]["exp_avg"], theirs.state[b]["exp_avg"])
        assert torch.equal(ours.state[a]["exp_avg_sq"], theirs.state[b]["exp_avg_sq"])
        assert torch.equal(ours.state[a]["step"], theirs.state[b]["step"])


def test_zero_grad_without_set_to_none_zeroes_the_gradients() -> None:
    model, _ = _twins(3)
    optimizer = AdamW(_groups(model, 0.1), lr=1e-3)
    model(torch.ones(2, 7)).sum().backward()
    optimizer.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_a_non_leaf_tensor_is_refused() -> None:
    leaf = torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match="leaf"):
        AdamW([{"params": [leaf * 2]}], lr=1e-3)


def test_diloco_on_cpu_trains_with_it_weight_decay_on_matrices_only() -> None:
    diloco = DiLoCo(build_model(preset("tiny"), seed=0), DiLoCoConfig(inner_steps=2, weight_decay=0.1))
    optimizer = diloco.inner_optimizer
    assert isinstance(optimizer, AdamW)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(diloco.params)
    assert isinstance(inner_adamw([], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, device=torch.device("cpu")), AdamW)


@pytest.mark.swarm  # a child interpreter importing torch: seconds of CPU
def test_a_node_s_inner_steps_do_not_import_torch_dynamo() -> None:
    """Why it exists: torch.optim imports torch._dynamo (2-3 s) on an optimizer's first use."""
    code = (
        "import sys, torch\n"
        "from swarm.model.configs import DiLoCoConfig\n"
        "from swarm.model.diloco import DiLoCo\n"
        "from swarm.model.llama import build_model\n"
        "from swarm.model.presets import preset\n"
        "d = DiLoCo(build_model(preset('tiny'), seed=0), DiLoCoConfig(inner_steps=1))\n"
        "x = torch.randint(0, 256, (2, 9))\n"
        "d.inner_step(x[:, :-1], x[:, 1:])\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr
