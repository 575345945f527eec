"""State exchange in one event loop: a newcomer (an in-process SwarmNode) fetches the swarm's state from
donors (the `seeder` fixture) that die, lie about their bytes, or hold a state of another run or
model; it survives each, loads only verified bytes and never adopts a foreign state."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from scripts.tools.state_seeder import SeedSpec
from swarm.node.config import NodeConfig
from swarm.state.server import ServeFaults
from tests.node.inprocess import QUICK, LocalSwarm, Running
from tests.state.conftest import StartSeeder
from tests.waiting import until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]  # nodes that train: slow, like the other swarm tests

# the newcomer: it finds step 5 advertised, fetches it, then trains one outer step alone
NEWCOMER: dict[str, Any] = dict(run_id="seeded", inner_steps=2, max_outer_steps=6, matchmaking_time=0.3)
SHARDS = 256 << 10  # the tiny model's 10 MB state in about 40 shards: several donors


def spec(**changes: Any) -> SeedSpec:
    """A donor state that nodes of NEWCOMER's settings adopt (unless `changes` say otherwise)."""
    node = NodeConfig(**{**QUICK, **NEWCOMER})  # what LocalSwarm.start builds
    return SeedSpec.like_node(node, **{"step": 5, "shard_bytes": SHARDS, **changes})


def fetches(node: Running) -> list[dict[str, Any]]:
    return [e for e in node.events if e["event"] == "fetch"]


async def test_a_donor_killed_mid_fetch_does_not_stop_it(local: LocalSwarm, seeder: StartSeeder) -> None:
    bootstrap = await local.start_bootstrap()
    slow = await seeder(spec(), [bootstrap], faults=ServeFaults(chunk_delay=0.5))  # each shard takes 0.5 s
    others = [await seeder(spec(), [bootstrap]) for _ in range(2)]
    newcomer = local.start((bootstrap,), **NEWCOMER)
    await until(lambda: slow.server.uploads > 0 or newcomer.task.done(), 60, "an upload by the slow donor")
    await slow.close()  # mid-fetch, as a killed donor: its connections close with shards under way
    assert await asyncio.wait_for(newcomer.task, 90) == "finished"
    (fetch,) = fetches(newcomer)
    assert fetch["outer_step"] == 5 and fetch["state_sha256"] == others[0].state_hash
    assert fetch["peers"] >= 2  # the live donors sent what the dead one did not


async def test_a_state_whose_holders_all_died_gives_way_to_the_live_peers_state(
    local: LocalSwarm, seeder: StartSeeder, caplog: pytest.LogCaptureFixture
) -> None:
    """Two donors of step 6 die; their advertisements outlive them (here by an hour, in a swarm
    by up to the advertisement's TTL). The newcomer chooses step 6 (the best backed), cannot get
    it, and takes the live donor's step 5 at once instead of retrying dead addresses until the
    records expire (a late node once chased a killed peer's state for 50 s this way)."""
    caplog.set_level(logging.INFO, logger="swarm.state.keeper")
    bootstrap = await local.start_bootstrap()
    dead = [await seeder(spec(step=6), [bootstrap]) for _ in range(2)]
    live = await seeder(spec(), [bootstrap])
    for donor in dead:
        await donor.close()
    newcomer = local.start((bootstrap,), **NEWCOMER)
    assert await asyncio.wait_for(newcomer.task, 60) == "finished"
    (fetch,) = fetches(newcomer)
    assert fetch["outer_step"] == 5 and fetch["state_sha256"] == live.state_hash
    assert any("did not deliver it" in r.getMessage() for r in caplog.records)


async def test_a_corrupt_donor_is_detected_and_its_bytes_never_loaded(local: LocalSwarm, seeder: StartSeeder) -> None:
    bootstrap = await local.start_bootstrap()
    bad = await seeder(spec(), [bootstrap], faults=ServeFaults(corrupt=True))
    good = [await seeder(spec(), [bootstrap]) for _ in range(2)]
    assert bad.snapshot.manifest.sha256 == good[0].snapshot.manifest.sha256  # the right state, wrong bytes
    newcomer = local.start((bootstrap,), **NEWCOMER)
    assert await asyncio.wait_for(newcomer.task, 90) == "finished"
    fetch = fetches(newcomer)[0]
    assert fetch["corrupt_peers"] == [str(bad.host.peer_id)]
    assert fetch["state_sha256"] == good[0].state_hash


@pytest.mark.parametrize(("claim", "needle"), [({"claim_run": "someone-else"}, "run"), ({}, "model")])
async def test_a_state_of_another_run_or_model_is_refused_and_the_node_stays_up(
    local: LocalSwarm, seeder: StartSeeder, caplog: pytest.LogCaptureFixture, claim: dict[str, str], needle: str
) -> None:
    """Anyone can advertise a state under our run's key: one of another run or model is refused
    with a line that says why, and never stops the node (no remote kill switch)."""
    caplog.set_level(logging.WARNING)
    bootstrap = await local.start_bootstrap()
    await seeder(spec(**claim), [bootstrap])
    model = {"model": "small"} if needle == "model" else {}
    newcomer = local.start((bootstrap,), **{**NEWCOMER, "max_outer_steps": None, **model})

    def refusals() -> list[str]:  # its manifest, or (another model: other run settings) its lineage
        return [r.getMessage() for r in caplog.records
                if "refusing state" in r.getMessage() or "receipt of other run settings" in r.getMessage()]  # fmt: skip

    await until(lambda: refusals() or newcomer.task.done(), 90, "a refusal")
    assert not newcomer.task.done(), newcomer.task
    refused = refusals()[0]
    assert (needle in refused and "not adopted" in refused) or "other run settings" in refused, refusals()
    assert not fetches(newcomer)
    newcomer.stop.set()
    assert await asyncio.wait_for(newcomer.task, 60) == "stopped"
