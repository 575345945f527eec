"""store_or_warn (swarm/dht/store_retry.py): a store that no node accepts is tried again a few
times, then is a WARNING naming the kind of record; a refusal that passes costs one more try."""

from __future__ import annotations

import logging
import time

import pytest

from swarm.dht import store_retry
from swarm.dht.records import owner_subkey
from swarm.dht.store_retry import store_or_warn
from tests.dht.refusing import refusing_dht


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_retry, "STORE_BACKOFF", 0.01)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


async def test_a_store_no_node_accepts_is_tried_again_then_a_warning_names_its_kind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="swarm.dht.store_retry")
    async with refusing_dht() as dht:
        subkey = owner_subkey(dht.client.peer_id)
        accepted = await store_or_warn(dht.client, "run/nodes", {"x": 1}, time.time() + 60, subkey, kind="progress")
        assert accepted == 0
        assert dht.stored("run/nodes") == 3  # STORE_TRIES
    (warning,) = warnings(caplog)
    assert "progress" in warning and "no DHT node accepted it" in warning and "3 tries" in warning
    assert sum("trying again" in r.getMessage() for r in caplog.records) == 2


async def test_a_refusal_that_passes_costs_one_more_try_and_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    async with refusing_dht(refuse=1) as dht:
        assert await store_or_warn(dht.client, "key", "value", time.time() + 60, kind="test") == 1
        assert dht.stored("key") == 2
        found = await dht.client.get("key")
        assert found is not None and found.value == "value"
    assert not warnings(caplog)


async def test_no_try_starts_after_the_callers_budget(caplog: pytest.LogCaptureFixture) -> None:
    async with refusing_dht() as dht:
        assert await store_or_warn(dht.client, "key", 1, time.time() + 60, kind="test", backoff=5.0, within=1.0) == 0
        assert dht.stored("key") == 1  # the next try would start after the budget
    assert len(warnings(caplog)) == 1 and "1 try" in warnings(caplog)[0]


async def test_a_record_this_node_refuses_to_make_is_not_tried_again(caplog: pytest.LogCaptureFixture) -> None:
    async with refusing_dht() as dht:
        assert await store_or_warn(dht.client, "key", 1, time.time() - 1, kind="test") == 0  # already expired
        assert dht.stores == []
    assert len(warnings(caplog)) == 1 and "bad_expiration" in warnings(caplog)[0]
