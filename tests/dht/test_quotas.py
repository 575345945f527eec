"""Storage quotas (swarm/dht/quotas.py): the rules as tables of cases, then the two
storage attacks over real sockets on 127.0.0.0/8:

- one peer stores 6,000 unowned 60 KiB records: it keeps at most its quota (4 MiB), the node's
  memory stays bounded, honest stores still work;
- 1,000 throwaway identities each sign a record under `<run>/nodes`: an honest node's own record
  is still stored and read, and readers see at most max_unproven_subkeys_per_key fakes;
- a `<run>/nodes` record that asks to live a week is refused.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest

from swarm.dht import DHTConfig, DHTNode, Record, owner_subkey
from swarm.dht.errors import ExpirationOutOfRange, StorageFull
from swarm.dht.quotas import (
    PeerStandings,
    Quotas,
    Standing,
    SubkeyFacts,
    fair_share_victim,
    keep_rank,
    record_bytes,
    subkey_admission,
)
from swarm.dht.records import pack_value
from swarm.dht.run_keys import nodes_key
from swarm.dht.storage import RecordStorage
from swarm.dht.ttl_caps import key_kind, max_ttl_for
from swarm.p2p import Identity, P2PConfig, P2PHost, PeerID
from swarm.utils.process_memory import resident_bytes

CONFIG = DHTConfig(rpc_timeout=2.0, lookup_timeout=10.0, bootstrap_timeout=10.0)
A, B, C = (Identity.from_seed(bytes([i]) * 32).peer_id for i in (1, 2, 3))


def on(ip: str) -> P2PConfig:
    return P2PConfig(host_maddrs=(f"/ip4/{ip}/tcp/0",))


def facts(
    subkey: str, source: PeerID | None = A, proven: bool = True, alive: bool = True, at: float = 0.0
) -> SubkeyFacts:
    return SubkeyFacts(subkey, source, proven, alive, at)


# --- the rules, as tables --------------------------------------------------------------------

LIMITS = {"max_subkeys": 4, "max_per_source": 2, "max_unproven": 2}
ADMISSION_CASES = [
    # (name, entries, newcomer, admitted, evicted)
    ("room", [facts("x", A)], facts("n", B), True, None),
    ("per-source cap", [facts("x", A), facts("y", A)], facts("n", A), False, None),
    ("per-source cap counts only that source", [facts("x", A), facts("y", B)], facts("n", A), True, None),
    (
        "unproven share full: the newest unproven newcomer is refused",
        [facts("x", B, proven=False, at=1), facts("y", C, proven=False, at=2)],
        facts("n", A, proven=False, at=9),
        False,
        None,
    ),
    (
        "unproven share full: an owner never seen alive makes room for one that is",
        [facts("x", B, proven=False, alive=False, at=1), facts("y", C, proven=False, at=2)],
        facts("n", A, proven=False, at=9),
        True,
        "x",
    ),
    (
        "unproven share full does not stop a proven newcomer",
        [facts("x", B, proven=False), facts("y", C, proven=False)],
        facts("n", A),
        True,
        None,
    ),
    (
        "full key: a proven newcomer evicts the newest unproven entry",
        [facts("p", A), facts("q", B), facts("u1", C, proven=False, at=1), facts("u2", None, proven=False, at=5)],
        facts("n", None, at=9),
        True,
        "u2",
    ),
    (
        "full key: a proven, alive newcomer evicts a proven owner not seen alive",
        [facts("p", A, at=1), facts("q", B, alive=False, at=2), facts("r", C, at=3), facts("s", None, at=4)],
        facts("n", None, at=9),
        True,
        "q",
    ),
    (
        "full key of proven, alive owners: the newcomer is refused",
        [facts("p", A, at=1), facts("q", B, at=2), facts("r", C, at=3), facts("s", None, at=4)],
        facts("n", None, at=9),
        False,
        None,
    ),
]


@pytest.mark.parametrize(("entries", "newcomer", "admitted", "evicted"), [c[1:] for c in ADMISSION_CASES],
                         ids=[c[0] for c in ADMISSION_CASES])  # fmt: skip
def test_subkey_admission(entries: list[SubkeyFacts], newcomer: SubkeyFacts, admitted: bool, evicted: Any) -> None:
    plan = subkey_admission(entries, newcomer, **LIMITS)
    assert (plan.admit, plan.evict) == (admitted, evicted), plan.reason
    assert plan.admit or plan.reason


def test_keep_rank_orders_proven_then_alive_then_established() -> None:
    ranked = sorted(
        [facts("new-unknown", proven=False, alive=False, at=9), facts("old-unknown", proven=False, alive=False, at=1),
         facts("alive-unproven", proven=False, at=9), facts("stale-proven", alive=False, at=1),
         facts("new-proven", at=9), facts("old-proven", at=1)],
        key=keep_rank,
    )  # fmt: skip
    assert [f.subkey for f in ranked] == [
        "new-unknown", "old-unknown", "alive-unproven", "stale-proven", "new-proven", "old-proven",
    ]  # fmt: skip


FAIR_SHARE_CASES = [
    # (bytes by source, newcomer, victim or None for "refuse")
    ({A: 100, B: 50}, C, A),
    ({A: 100, B: 50}, B, A),
    ({A: 100, B: 50}, A, None),  # the largest source does not push out smaller ones
    ({A: 100, B: 100}, B, None),  # nor an equal one
    ({A: 100, None: 500}, B, None),  # this node's own records are the largest share: evicted too
    ({}, A, None),
]


@pytest.mark.parametrize(("by_source", "newcomer", "victim"), FAIR_SHARE_CASES)
def test_fair_share_victim(by_source: dict[PeerID | None, int], newcomer: PeerID, victim: PeerID | None) -> None:
    if by_source.get(None):
        assert fair_share_victim(by_source, newcomer) is None
        return
    if victim is None:
        with pytest.raises(LookupError):
            fair_share_victim(by_source, newcomer)
    else:
        assert fair_share_victim(by_source, newcomer) == victim


@pytest.mark.parametrize(
    ("key", "kind", "cap"),
    [("run/nodes", "nodes", 900.0), ("run/state", "state", 3600.0), ("run/ready/12", "ready", 3600.0),
     ("run/ready/x", None, 7 * 24 * 3600.0), ("run/nodes/x", None, 7 * 24 * 3600.0), ("nodes", None, 7 * 24 * 3600.0),
     ("/nodes", None, 7 * 24 * 3600.0), (b"run/nodes", None, 7 * 24 * 3600.0), ("a/b/state", None, 7 * 24 * 3600.0)],
)  # fmt: skip
def test_ttl_caps_by_key_kind(key: Any, kind: str | None, cap: float) -> None:
    assert key_kind(key) == kind and max_ttl_for(key, DHTConfig()) == cap


def test_a_run_record_that_asks_to_live_too_long_is_refused() -> None:
    now = time.time()
    Record.create("run/nodes", None, 1, now + 800).validate(CONFIG, now)
    with pytest.raises(ExpirationOutOfRange):
        Record.create("run/nodes", None, 1, now + 3600).validate(CONFIG, now)
    Record.create("run/other", None, 1, now + 3600).validate(CONFIG, now)


def test_storage_charges_sources_and_evicts_the_largest_share_when_full() -> None:
    size = record_bytes(Record.create("k0", None, bytes(1000), 100.0))
    quotas = Quotas(max_bytes=10 * size, max_records_per_source=6, max_bytes_per_source=6 * size, max_per_source=16,
                    max_unproven=32, liveness_window=60.0)  # fmt: skip
    storage = RecordStorage(1000, 1000, quotas)
    for i in range(6):
        storage.put(Record.create(f"a{i}", None, bytes(1000), 100.0 + i), 0.0, source=A)
    with pytest.raises(StorageFull):  # A's own quota
        storage.put(Record.create("a9", None, bytes(1000), 200.0), 0.0, source=A)
    storage.put(Record.create("a0", None, bytes(1000), 300.0), 0.0, source=A)  # a replacement fits the quota
    for i in range(4):
        storage.put(Record.create(f"b{i}", None, bytes(1000), 100.0), 0.0, source=B)
    assert storage.total_bytes == 10 * size
    storage.put(Record.create("c0", None, bytes(1000), 100.0), 0.0, source=C)  # full: A, the largest, pays
    assert storage.held_by(A) == (5, 5 * size) and storage.get("a1", 0.0) == []  # A's earliest expiring
    assert storage.held_by(C) == (1, size) and storage.total_bytes == 10 * size


def test_peer_standings_remember_proof_and_forget_the_oldest() -> None:
    standings = PeerStandings(max_peers=2)
    standings.heard_from(A, 1.0, proven=True)
    standings.heard_from(A, 2.0, proven=False)  # a proof once seen stays
    assert standings(A) == Standing(True, 2.0)
    standings.heard_from(B, 3.0, proven=False)
    standings.heard_from(C, 4.0, proven=False)
    assert standings(A).last_seen == float("-inf") and standings(C) == Standing(False, 4.0)


# --- the attacks, over real sockets ----------------------------------------------------------


async def honest_store_and_get(node: DHTNode, key: str) -> None:
    async with DHTNode(initial_peers=[node.visible_maddrs[0]], config=CONFIG, p2p_config=on("127.0.0.1")) as honest:
        assert await honest.store(key, {"honest": True}, time.time() + 60) >= 1
        for reader in (honest, node):
            got = await reader.get(key, latest=True)
            assert got is not None and got.value == {"honest": True}


async def honest_calls_during(attack: Any, node: DHTNode) -> float:
    """The share of an honest peer's stores and gets through `node` that succeed while `attack` runs."""
    async with DHTNode(initial_peers=[node.visible_maddrs[0]], config=CONFIG, p2p_config=on("127.0.0.1")) as honest:
        task = asyncio.ensure_future(attack)
        ok = calls = 0
        try:
            while not task.done() or calls < 20:
                key = f"honest/{calls}"
                calls += 2
                try:
                    ok += await honest.store(key, calls, time.time() + 60) >= 1
                    got = await node.get(key, latest=True)
                    ok += got is not None and got.value == calls
                except (TimeoutError, OSError):
                    pass
                await asyncio.sleep(0.02)
            await task
        finally:
            task.cancel()
    return ok / calls


@pytest.mark.timeout(240)
async def test_6000_unowned_60kib_records_from_one_peer_keep_memory_bounded() -> None:
    async with (
        DHTNode(config=CONFIG, p2p_config=on("127.0.0.1")) as node,
        P2PHost(config=on("127.0.0.5")) as attacker,
    ):
        rss_before = resident_bytes()
        expiration = time.time() + 3600
        value = pack_value(os.urandom(60 * 1024))
        accepted = 0

        async def flood() -> None:
            nonlocal accepted
            batch = 12  # 720 KiB per call, under the 1 MiB request head limit
            for start in range(0, 6000, batch):
                records = [[f"junk/{i}", None, value, expiration, None] for i in range(start, start + batch)]
                args = {"a": None, "records": records}
                reply = await attacker.call(node.visible_maddrs[0], "dht.store", args, timeout=30)
                accepted += reply["results"].count("ok")

        assert await honest_calls_during(flood(), node) >= 0.95
        records, held = node.storage.held_by(attacker.peer_id)
        assert accepted == records <= CONFIG.max_records_per_source
        assert held <= CONFIG.max_bytes_per_source and node.storage.total_bytes <= CONFIG.max_storage_bytes
        growth = resident_bytes() - rss_before
        assert growth < 128 * 1024 * 1024, f"memory grew by {growth / 2**20:.0f} MiB"  # 360 MiB were sent
        await honest_store_and_get(node, "after/junk")


async def throwaway_store(maddr: str, key: str, expiration: float, semaphore: asyncio.Semaphore) -> str:
    """A fresh identity connects, stores its own signed record under key, and leaves."""
    async with semaphore:
        identity = Identity.generate()
        record = Record.create(key, owner_subkey(identity.peer_id), {"fake": True}, expiration, identity)
        async with P2PHost(identity, on("127.0.0.1")) as host:
            reply = await host.call(maddr, "dht.store", {"a": None, "records": [record.to_wire()]}, timeout=30)
        return str(reply["results"][0])


@pytest.mark.timeout(300)
async def test_1000_throwaway_identities_under_run_nodes_do_not_push_out_an_honest_node() -> None:
    key = nodes_key("flooded")
    async with (
        DHTNode(config=CONFIG, p2p_config=on("127.0.0.1")) as node,
        DHTNode(initial_peers=[], config=CONFIG, p2p_config=on("127.0.0.1")) as first_honest,
    ):
        maddr = node.visible_maddrs[0]
        await first_honest.bootstrap([maddr])
        expiration = time.time() + 600
        early = owner_subkey(first_honest.peer_id)  # an honest record stored before the flood
        assert await first_honest.store(key, {"honest": 1}, expiration, subkey=early) == 2
        semaphore = asyncio.Semaphore(16)
        results = await asyncio.gather(*(throwaway_store(maddr, key, expiration, semaphore) for _ in range(1000)))
        assert results.count("ok") <= CONFIG.max_unproven_subkeys_per_key
        # one peer relaying records that 64 other throwaway identities signed
        signed = [Record.create(key, owner_subkey(i.peer_id), {"fake": True}, expiration, i).to_wire()
                  for i in (Identity.generate() for _ in range(64))]  # fmt: skip
        async with P2PHost(config=on("127.0.0.6")) as relay:
            reply = await relay.call(maddr, "dht.store", {"a": None, "records": signed}, timeout=30)
        assert reply["results"].count("ok") <= CONFIG.max_subkeys_per_source_per_key
        async with DHTNode(initial_peers=[maddr], config=CONFIG, p2p_config=on("127.0.0.1")) as late_honest:
            late = owner_subkey(late_honest.peer_id)  # an honest node that joins after the flood
            assert await late_honest.store(key, {"honest": 2}, expiration, subkey=late) == 3
            assert {early, late} <= {r.subkey for r in node.storage.get(key, time.time())}
            async with DHTNode(
                initial_peers=[maddr], config=CONFIG, client_mode=True, p2p_config=on("127.0.0.1")
            ) as reader:
                got = await reader.get(key, latest=True)
        assert got is not None and got.value[early].value == {"honest": 1} and got.value[late].value == {"honest": 2}
        fakes = [v for v in got.value.values() if v.value == {"fake": True}]
        assert len(fakes) <= CONFIG.max_unproven_subkeys_per_key + CONFIG.max_subkeys_per_source_per_key


async def test_a_run_nodes_record_for_a_week_is_refused_over_the_wire() -> None:
    async with DHTNode(config=CONFIG, p2p_config=on("127.0.0.1")) as node, P2PHost(config=on("127.0.0.7")) as peer:
        week = time.time() + 7 * 24 * 3600 - 60
        records = [[nodes_key("r"), None, pack_value(1), week, None], ["r/other", None, pack_value(1), week, None]]
        reply = await peer.call(node.visible_maddrs[0], "dht.store", {"a": None, "records": records}, timeout=10)
        assert reply["results"] == ["bad_expiration", "ok"]
