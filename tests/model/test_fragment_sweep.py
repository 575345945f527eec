"""scripts/experiments/fragment_sweep.py: fragments cut and scheduled as Streaming DiLoCo does, and with one
fragment and no delay it is blocking DiLoCo to the bit (train_diloco's loss)."""

from __future__ import annotations

import pytest

from scripts.experiments.diloco_sim import HSchedule, Setting, Workload, load_corpus, train_diloco
from scripts.experiments.fragment_sweep import sync_steps, train_fragments
from scripts.experiments.overlap_sweep import train_overlapped

# Two workers and H = 2 over 6 steps: three rounds, so a round lands late inside the next one and
# fragment 1 of 2 syncs between fragment 0's rounds, as at any size; every mode and delay below
# still ends at a different loss, so each equality is one path's arithmetic, not a coincidence.
TINY = Workload(workers=2, steps=6, seq_len=32, eval_windows=2, lr_schedule="constant")
H2 = Setting(name="H2", h=HSchedule(target=2))


@pytest.mark.parametrize(
    ("fragment", "fragments", "h", "steps", "expected"),
    [
        (0, 1, 50, 300, [50, 100, 150, 200, 250]),  # the run's end (300) syncs everything anyway
        (0, 4, 50, 300, [50, 100, 150, 200, 250]),
        (1, 4, 50, 300, [62, 112, 162, 212, 262]),
        (3, 4, 50, 300, [87, 137, 187, 237, 287]),
        (0, 2, 50, 40, []),  # a run shorter than H: only the end's sync
    ],
)
def test_fragments_are_synced_every_h_steps_staggered_by_h_over_p(
    fragment: int, fragments: int, h: int, steps: int, expected: list[int]
) -> None:
    assert sync_steps(fragment, fragments, h, steps) == expected


def test_one_fragment_without_delay_is_blocking_diloco_to_the_bit() -> None:
    data = load_corpus()
    assert train_fragments(data, TINY, H2, 1, "blocking", 0.0) == train_diloco(data, TINY, H2).eval_loss


@pytest.mark.parametrize(("mode", "delay"), [("eager", 0.5), ("eager", 1.0), ("delayed", 1.0)])
def test_one_fragment_landing_late_is_the_overlap_sweeps_run_to_the_bit(mode: str, delay: float) -> None:
    """The node's overlapped rules as overlap_sweep drives them (DiLoCo.begin_overlap, apply_outer),
    a round as long as H (delay 1) included: it lands just before the next one starts."""
    data = load_corpus()
    assert train_fragments(data, TINY, H2, 1, mode, delay) == train_overlapped(data, TINY, H2, mode, delay)[0]


@pytest.mark.parametrize("mode", ["eager", "delayed"])
def test_fragments_landing_late_train_to_a_finite_loss(mode: str) -> None:
    loss = train_fragments(load_corpus(), TINY, H2, 2, mode, 1.0)
    assert 0 < loss < 20


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="mode must be"):
        train_fragments(load_corpus(), TINY, H2, 1, "sideways", 0.0)
