"""Inner learning-rate schedules (swarm/model/schedule.py): each schedule's rate at chosen steps
of the swarm's clock, and the settings each refuses."""

from __future__ import annotations

import pytest
import torch

from swarm.model.diloco import DiLoCo, DiLoCoConfig
from swarm.model.schedule import inner_lr, schedule_problem

# lr 1, warmup 10, total 110, min 0.1, wsd decaying over the last 20% (steps 88 to 110)
COSINE = DiLoCoConfig(lr=1.0, warmup_steps=10, lr_schedule="cosine", total_steps=110, min_lr_ratio=0.1)
WSD = DiLoCoConfig(lr=1.0, warmup_steps=10, lr_schedule="wsd", total_steps=110, min_lr_ratio=0.1, decay_fraction=0.2)
CONSTANT = DiLoCoConfig(lr=1.0, warmup_steps=10)


@pytest.mark.parametrize(
    ("config", "step", "lr"),
    [
        (CONSTANT, 0, 0.1), (CONSTANT, 9, 1.0), (CONSTANT, 10, 1.0), (CONSTANT, 10**6, 1.0),
        (COSINE, 0, 0.1), (COSINE, 9, 1.0), (COSINE, 10, 1.0), (COSINE, 60, 0.55), (COSINE, 110, 0.1),
        (COSINE, 10**6, 0.1),
        (WSD, 0, 0.1), (WSD, 9, 1.0), (WSD, 10, 1.0), (WSD, 87, 1.0), (WSD, 88, 1.0), (WSD, 99, 0.55),
        (WSD, 109, 1.0 - 0.9 * 21 / 22), (WSD, 110, 0.1), (WSD, 10**6, 0.1),
        (DiLoCoConfig(lr=2.0, warmup_steps=0, lr_schedule="cosine", total_steps=100), 0, 2.0),
    ],
)  # fmt: skip
def test_each_schedule_at_chosen_steps(config: DiLoCoConfig, step: int, lr: float) -> None:
    assert inner_lr(config, step) == pytest.approx(lr)


def test_the_rate_runs_on_the_swarm_clock_across_outer_steps_and_a_fetched_state() -> None:
    """Step k of the clock is outer_step x H + inner steps done: a node at outer step 3 (H = 5),
    like one that resumed or fetched step 3, runs the rate of clock step 15 next."""
    config = DiLoCoConfig(inner_steps=5, lr=1.0, warmup_steps=0, lr_schedule="cosine", total_steps=40)
    model = torch.nn.Linear(2, 1)
    diloco = DiLoCo(model, config, loss_fn=lambda m, x, y: ((m(x) - y) ** 2).mean())
    x, y = torch.ones(4, 2), torch.zeros(4, 1)
    rates = []
    for _ in range(2):
        rates += [diloco.inner_step(x, y).lr for _ in range(5)]
        diloco.apply_own()
    assert rates == pytest.approx([inner_lr(config, k) for k in range(10)])
    fetched = DiLoCo(torch.nn.Linear(2, 1), config, loss_fn=diloco.loss_fn)
    fetched.load_state_dict({**diloco.state_dict(), "outer_step": 3})
    assert fetched.inner_step(x, y).lr == pytest.approx(inner_lr(config, 15))


@pytest.mark.parametrize(
    ("kind", "warmup", "total", "fraction", "words"),
    [
        ("cosine", 10, None, 0.2, "give --total-steps"),
        ("wsd", 10, None, 0.2, "give --total-steps"),
        ("constant", 10, 100, 0.2, "add --lr-schedule cosine or wsd"),
        ("cosine", 100, 100, 0.2, "must exceed --warmup-steps"),
        ("wsd", 90, 100, 0.5, "would start inside the warmup"),
        ("wsd", 10, 100, 0.0, "--decay-fraction"),
        ("linear", 10, 100, 0.2, "must be one of constant, cosine, wsd"),
    ],
)
def test_schedules_that_cannot_run_are_refused(kind: str, warmup: int, total: int | None, fraction: float,
                                               words: str) -> None:  # fmt: skip
    problem = schedule_problem(kind, warmup, total, fraction)
    assert problem is not None and words in problem
    with pytest.raises(ValueError, match=words.replace("-", r"\-")):
        DiLoCoConfig(warmup_steps=warmup, lr_schedule=kind, total_steps=total, decay_fraction=fraction)


def test_runnable_schedules_have_no_problem() -> None:
    assert schedule_problem("constant", 100, None, 0.2) is None
    assert schedule_problem("cosine", 100, 101, 0.2) is None
    assert schedule_problem("wsd", 10, 100, 0.9) is None
