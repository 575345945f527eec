"""Supervised background tasks: a bug is logged with its traceback, the task starts again, and
its owner hears of it at close. The DHT's maintenance, the node's progress records and the state
advertisement run under it; the DHT's is tested here with a bug put in."""

from __future__ import annotations

import asyncio
import logging

import pytest

from swarm.dht import DHTNode
from swarm.p2p import P2PConfig
from swarm.utils.supervised import Supervised


async def test_a_task_that_fails_is_logged_started_again_and_reported_at_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs: list[int] = []
    again = asyncio.Event()

    async def flaky() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise RuntimeError("a bug in round 1")
        again.set()
        await asyncio.Event().wait()  # then it runs on

    with caplog.at_level(logging.ERROR, logger="swarm.utils.supervised"):
        task = Supervised("flaky", flaky, backoff=0.01).start()
        await asyncio.wait_for(again.wait(), 5.0)
    assert task.running and task.failures == 1 and len(runs) == 2
    logged = [r for r in caplog.records if "background task 'flaky' failed (1 time(s))" in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # with its traceback
    error = await task.close()
    assert isinstance(error, RuntimeError) and str(error) == "a bug in round 1" and not task.running


async def test_a_task_that_returns_is_done_and_close_says_nothing_went_wrong() -> None:
    async def once() -> None:
        return None

    task = Supervised("once", once).start()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not task.running and task.failures == 0
    assert await task.close() is None
    with pytest.raises(ValueError):
        Supervised("bad", once, backoff=0)


async def test_a_bug_in_dht_maintenance_is_seen_and_maintenance_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []
    survived = asyncio.Event()

    async def buggy(self: DHTNode) -> None:  # the maintenance loop's first round hits a bug
        calls.append(1)
        if len(calls) == 1:
            raise KeyError("a bug")
        survived.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(DHTNode, "_maintain", buggy)
    node = await DHTNode(p2p_config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
    assert node._maintenance is not None
    node._maintenance.backoff = 0.01  # a test need not wait a second
    with caplog.at_level(logging.WARNING):
        await asyncio.wait_for(survived.wait(), 5.0)
        await node.close()
    text = caplog.text
    assert "background task 'DHT maintenance' failed (1 time(s))" in text
    assert "DHT maintenance had failed 1 time(s), last: KeyError('a bug')" in text
