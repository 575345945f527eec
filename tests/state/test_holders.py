"""State advertisements (swarm/state/holders.py) whose store fails: retried, warned, reported,
and seen by the StateKeeper as a failure."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from torch import nn

from swarm.dht import DHTConfig, DHTNode, Record, owner_subkey, store_retry
from swarm.dht.id_proof import solve
from swarm.dht.run_keys import state_key
from swarm.model.checkpoint import Manifest, RunInfo
from swarm.model.diloco import DiLoCo, DiLoCoConfig
from swarm.p2p import P2PConfig, P2PHost
from swarm.p2p.identity import Identity
from swarm.state.config import KeeperConfig
from swarm.state.holders import advertise, decode_holder, find_holders
from swarm.state.keeper import StateKeeper
from swarm.state.lineage_book import LineageBook
from tests.averaging.test_ready import failing_nonce
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


async def test_32_identities_without_a_costly_id_are_no_holders_to_a_reader(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """32 fresh key pairs (free) each sign a record advertising a forged state one step ahead,
    stored in a real DHT beside one honest holder's record: a reader that counted them would
    see 32 backers of the forgery against 1. Their records carry no proof of a costly id (or
    one that fails), so the reader sees the honest holder alone, and says so once per identity."""
    caplog.set_level(logging.INFO, logger="swarm.state.holders")
    local = P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))
    fakes = [Identity.generate() for _ in range(32)]
    bits = DHTConfig().id_bits
    async with P2PHost(config=local) as seed_host:
        seed = await DHTNode(host=seed_host).start()
        honest = await DHTNode(p2p_config=local, initial_peers=seed_host.visible_maddrs).start()
        try:
            assert await advertise(honest, "run", MANIFEST, ["/ip4/127.0.0.1/tcp/1"], time.time() + 60)
            forged = {"step": 4, "manifest": "f" * 64, "maddrs": ["/ip4/127.0.0.1/tcp/2"], "bytes": 10}
            records = [
                Record.create(state_key("run"), owner_subkey(f.peer_id),
                              {**forged, **({"proof": failing_nonce(f.peer_id, bits)} if i % 2 else {})},
                              time.time() + 60, f).to_wire()
                for i, f in enumerate(fakes)
            ]  # fmt: skip
            reply = await seed_host.call(honest.visible_maddrs[0], "dht.store", {"a": None, "records": records})
            assert [str(r) for r in reply["results"]].count("ok") >= 2, reply  # the forgeries are in the DHT
            raw = await honest.get(state_key("run"), latest=True)
            assert raw is not None and len(raw.value) > 2
            holders = await find_holders(seed, "run")
            assert [(h.peer_id, h.step) for h in holders] == [(honest.peer_id, 3)]
        finally:
            await honest.close()
            await seed.close()
    skipped = [r.getMessage() for r in caplog.records if "without a proof of a costly id" in r.getMessage()]
    assert skipped and len(skipped) == len(set(skipped))  # each fake named once


def test_a_state_record_counts_only_with_its_owners_proof_of_a_costly_id() -> None:
    bits = 6
    owner = Identity.from_seed(b"\x01" * 32).peer_id
    record = {"step": 5, "manifest": "a" * 64, "maddrs": ["/ip4/127.0.0.1/tcp/4001"], "bytes": 10}
    proven = {**record, "proof": solve(owner, bits)}
    assert decode_holder(owner_subkey(owner), proven, bits) is not None
    for proof in (failing_nonce(owner, bits), b"short", None, "0" * 8):
        assert decode_holder(owner_subkey(owner), {**record, "proof": proof}, bits) is None
    assert decode_holder(owner_subkey(owner), record, bits) is None  # none at all
    assert decode_holder(owner_subkey(owner), record) is not None  # not checked: a display of the records
    # a proof is bound to its owner: the same nonce proves nothing for another (these fixed keys:
    # one nonce in 2^bits would prove both)
    other = Identity.from_seed(b"\x02" * 32).peer_id
    assert decode_holder(owner_subkey(other), proven, bits) is None
