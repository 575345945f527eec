"""Inner learning-rate schedules (pure; no torch): the rate of each inner step on the swarm's
clock (outer step x H + inner steps done), so that every node, a resumed one and a newcomer
that fetched step k alike, runs the same rate at the same step.

    inner_lr(config, step)     # config: anything with the DiLoCoConfig schedule fields
    schedule_problem(kind, warmup_steps, total_steps, decay_fraction)   # None, or why not

constant (the node's default: a volunteer run has no planned end), cosine (the DiLoCo paper's,
to min_lr_ratio at total_steps) and wsd (warmup-stable-decay, INTELLECT-1's: linear cool-down
over the last decay_fraction). A decaying schedule needs total_steps.
"""

from __future__ import annotations

import math
from typing import Any

DEFAULT_WARMUP_STEPS = 100
DEFAULT_DECAY_FRACTION = 0.2  # INTELLECT-1 cooled down over the last 20%

SCHEDULES = ("constant", "cosine", "wsd")


def schedule_problem(kind: str, warmup_steps: int, total_steps: int | None, decay_fraction: float) -> str | None:
    """Why these schedule settings cannot run (None: they can), in the CLI's words."""
    if kind not in SCHEDULES:
        return f"lr schedule must be one of {', '.join(SCHEDULES)}, got {kind!r}"
    if kind == "constant":
        if total_steps is not None:
            return "--total-steps is the end of a decaying schedule: add --lr-schedule cosine or wsd"
        return None
    if total_steps is None:
        return f"the {kind} schedule decays to its end: give --total-steps (inner steps of the whole run)"
    if total_steps <= warmup_steps:
        return f"--total-steps {total_steps} must exceed --warmup-steps {warmup_steps}"
    if kind == "wsd":
        if not (math.isfinite(decay_fraction) and 0 < decay_fraction <= 1):
            return f"--decay-fraction must be in (0, 1], got {decay_fraction}"
        if wsd_decay_start(total_steps, decay_fraction) < warmup_steps:
            return f"the wsd decay (the last {decay_fraction:g} of {total_steps} steps) would start inside the warmup"
    return None


def wsd_decay_start(total_steps: int, decay_fraction: float) -> int:
    return total_steps - round(decay_fraction * total_steps)


def inner_lr(config: Any, step: int) -> float:
    """The inner learning rate for global inner step `step` (0-based; the swarm's clock), pure:
    linear warmup from lr / warmup_steps to lr over warmup_steps, then
    - constant: lr;
    - cosine: cosine from lr at the end of warmup to lr * min_lr_ratio at total_steps;
    - wsd (warmup-stable-decay, as INTELLECT-1): lr until the last decay_fraction of
      total_steps, then linear to lr * min_lr_ratio at total_steps;
    and lr * min_lr_ratio from total_steps on (a run that trains past its planned end)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant" or config.total_steps is None:
        return config.lr
    floor = config.lr * config.min_lr_ratio
    if step >= config.total_steps:
        return floor
    if config.lr_schedule == "wsd":
        start = wsd_decay_start(config.total_steps, config.decay_fraction)
        if step < start:
            return config.lr
        return config.lr + (floor - config.lr) * (step - start) / (config.total_steps - start)
    progress = (step - config.warmup_steps) / (config.total_steps - config.warmup_steps)
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
