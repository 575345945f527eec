"""swarm-sim --nat: its homes parsed and checked before anything is built, nodes placed in order."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from swarm.cli.sim import main
from swarm.cli.sim_config import SimConfig, parse_nat


def config(**changes: object) -> SimConfig:
    fields: dict[str, object] = dict(nodes=6, model="tiny", outer_steps=2, inner_steps=2, batch_size=2, seq_len=8,
                                     compression="int8", seed=0, lr=None, warmup_steps=None, matchmaking_time=None,
                                     max_group_size=None, part_timeout=None, kill_every=None, join_every=None,
                                     threads=1, run_dir=Path(), metrics_out=Path(), plot_out=Path(), timeout=None,
                                     verbose=0, nat=parse_nat("cone:2,cone:2,symmetric:2"))  # fmt: skip
    return SimConfig(**{**fields, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "homes"),
    [
        ("cone:2,cone:2,symmetric:2", (("cone", 2), ("cone", 2), ("symmetric", 2))),
        (" symmetric:1 ", (("symmetric", 1),)),
    ],
)
def test_homes_are_kinds_with_their_node_counts(text: str, homes: tuple[tuple[str, int], ...]) -> None:
    assert parse_nat(text) == homes


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("full-cone:2", "the kind is one of"),
        ("cone", "KIND:N"),
        ("cone:0", "KIND:N"),
        ("cone:-1", "KIND:N"),
        ("cone:65", "KIND:N"),
        ("cone:x", "KIND:N"),
        (",".join(["cone:1"] * 33), "1 to 32"),
    ],
)
def test_bad_homes_are_refused_with_the_reason(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_nat(text)


def test_nodes_go_to_the_homes_in_order_and_newcomers_in_turn() -> None:
    assert [config().home_of(i) for i in range(10)] == [0, 0, 1, 1, 2, 2, 0, 1, 2, 0]
    with pytest.raises(IndexError):
        config().home_of(-1)


@pytest.mark.parametrize(
    ("changes", "why"),
    [({"nodes": 5}, "--nodes says 5"), ({"dashboard": 0}, "not with --dashboard")],
)
def test_nat_and_what_it_cannot_go_with_are_refused(changes: dict[str, object], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        config(**changes)


def test_nodes_default_to_the_homes_and_a_bad_kind_is_one_line() -> None:
    result = CliRunner().invoke(main, ["--nat", "cone:2,upnp:1"], prog_name="swarm-sim")
    assert result.exit_code == 2 and "the kind is one of cone, symmetric" in result.stderr
    result = CliRunner().invoke(main, ["--nat", "cone:2", "--nodes", "3"], prog_name="swarm-sim")
    assert result.exit_code == 2 and "--nat puts 2 node(s) in homes, --nodes says 3" in result.stderr
