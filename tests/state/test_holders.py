"""State advertisements (swarm/state/holders.py) whose store fails: retried, warned, reported."""

from __future__ import annotations

import logging
import time

import pytest

from swarm.dht import store_retry
from swarm.dht.run_keys import state_key
from swarm.model.checkpoint import Manifest, RunInfo
from swarm.state.holders import advertise, find_holders
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
