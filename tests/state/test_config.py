"""The state configs (swarm/state/config.py): the old defaults, checked fields, the node's mapping."""

from __future__ import annotations

import dataclasses

import pytest

from swarm.node.config import NodeConfig
from swarm.state.config import FetchConfig, KeeperConfig


def test_defaults_are_those_of_the_old_arguments() -> None:
    assert FetchConfig() == FetchConfig(timeout=60.0, streams_per_peer=2, recruit_every=2.0)  # fetch_state's
    keeper = KeeperConfig(shard_bytes=1 << 20)  # StateKeeper's: it fetched with a 120 s timeout
    assert (keeper.checkpoint_every, keeper.max_uploads, keeper.advertise_ttl) == (1, 4, 60.0)
    assert keeper.fetch == FetchConfig(timeout=120.0)


@pytest.mark.parametrize(
    "bad",
    [{"timeout": 0.0}, {"timeout": float("nan")}, {"recruit_every": -1.0}, {"streams_per_peer": 0}],
)
def test_a_bad_fetch_config_fails_where_it_is_built(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        FetchConfig(**bad)


@pytest.mark.parametrize(
    "bad", [{"shard_bytes": 0}, {"checkpoint_every": 0}, {"max_uploads": 0}, {"advertise_ttl": float("inf")}]
)
def test_a_bad_keeper_config_fails_where_it_is_built(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        KeeperConfig(**{"shard_bytes": 1, **bad})


def test_configs_are_frozen_and_keyword_only() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        FetchConfig().timeout = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        FetchConfig(1.0)  # type: ignore[misc]


def test_the_node_flags_map_onto_the_keeper_config() -> None:
    node = NodeConfig(run_id="r", shard_bytes=123, checkpoint_every=3, max_uploads=2, fetch_timeout=9.0)
    assert node.keeper_config() == KeeperConfig(
        shard_bytes=123, checkpoint_every=3, max_uploads=2, fetch=FetchConfig(timeout=9.0)
    )
    defaults = NodeConfig(run_id="r").keeper_config()
    assert defaults.fetch == KeeperConfig(shard_bytes=1).fetch  # 120 s, as before
