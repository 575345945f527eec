"""State advertisements (swarm/state/holders.py) whose store fails: retried, warned, reported,
and seen by the StateKeeper as a failure."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from torch import nn

from swarm.dht import store_retry
from swarm.dht.run_keys import state_key
from swarm.model.checkpoint import Manifest, RunInfo
from swarm.model.diloco import DiLoCo, DiLoCoConfig
from swarm.p2p import P2PConfig, P2PHost
from swarm.state.config import KeeperConfig
from swarm.state.holders import advertise, find_holders
from swarm.state.keeper import StateKeeper
from swarm.state.lineage_book import LineageBook
from tests.dht.refusing import refusing_dht

MANIFEST = Manifest(RunInfo(run_id="run", model="tiny", model_config={}, seed=0), step=3, shards=())


async def test_an_advertisement_no_node_stores_is_retried_warned_and_reported(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_retry, "STORE_BACKOFF", 0.01)
    maddrs = ["/ip4/127.0.0.1/tcp/1"]
    async with refusing_dht() as dht:
        assert await advertise(dht.client, "run", MANIFEST, maddrs, time.time() + 60) is False
        assert dht.stored(state_key("run")) == store_retry.STORE_TRIES
        assert await find_holders(dht.client, "run") == []
        dht.refuse = 1  # one more refusal, then the DHT accepts: a retry stores it
        assert await advertise(dht.client, "run", MANIFEST, maddrs, time.time() + 60) is True
        (holder,) = await find_holders(dht.client, "run")
        assert holder.step == 3 and holder.peer_id == dht.client.peer_id
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "state holders" in warned[0], warned


async def test_the_keeper_counts_an_advertisement_stored_nowhere_as_failed(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_retry, "STORE_BACKOFF", 0.01)
    caplog.set_level(logging.INFO, logger="swarm.state.keeper")

    async def in_trainer(fn: Any, *args: Any) -> Any:
        return fn(*args)

    diloco = DiLoCo(nn.Linear(4, 4), DiLoCoConfig(inner_steps=2))
    run = RunInfo(run_id="run", model="linear", model_config={}, seed=0)
    async with refusing_dht() as dht, P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))) as host:
        lineage = LineageBook(host, dht.client, "run", b"", serve=True)
        keeper = StateKeeper(host, dht.client, run, in_trainer=in_trainer, serve=True, checkpoint_dir=None,
                             config=KeeperConfig(shard_bytes=1 << 20), lineage=lineage)  # fmt: skip
        await keeper.publish(diloco)
        await keeper.close()  # waits for the publication under way
        await lineage.close()
        assert keeper.current is not None and keeper.advertised is False
        assert dht.stored(state_key("run")) == store_retry.STORE_TRIES
    assert any("is not advertised" in r.getMessage() for r in caplog.records)
