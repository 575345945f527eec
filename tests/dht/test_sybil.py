"""Sybil and eclipse attacks on the DHT, over real sockets on 127.0.0.0/8.

- DHT ids cost a proof of work bound to the PeerID (swarm/dht/id_proof.py): a forged id is
  never added to a routing table, and each bad proof is logged once;
- eclipse: 20 identities ground to sit closest to a run's state key accept stores and drop
  them; gets over disjoint paths still return the value (lookup.py);
- the disjoint-path lookup, on an in-memory graph: no node is asked by two paths.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from swarm.dht import DHTConfig, DHTNode, id_proof, owner_subkey
from swarm.dht.freshest import FreshestRecords
from swarm.dht.id_proof import BadIdProof, leading_zero_bits, load_or_solve, node_id_of, solve, verify
from swarm.dht.ids import key_id
from swarm.dht.lookup import iterative_lookup
from swarm.dht.records import Record
from swarm.dht.routing import Contact, RoutingTable
from swarm.dht.run_keys import state_key
from swarm.p2p import CallContext, Identity, P2PConfig, P2PHost, PeerID

BITS = 8
CONFIG = DHTConfig(id_bits=BITS, rpc_timeout=1.0, lookup_timeout=10.0, bootstrap_timeout=10.0)
# patient RPCs for the 44-node eclipse test (44 nodes share one event loop)
PATIENT = dataclasses.replace(CONFIG, rpc_timeout=5.0, lookup_timeout=30.0)


def on(ip: str) -> P2PConfig:
    return P2PConfig(host_maddrs=(f"/ip4/{ip}/tcp/0",))


def failing_nonce(peer: PeerID, bits: int = BITS) -> bytes:
    return next(n for i in range(10_000) if leading_zero_bits(node_id_of(peer, n := i.to_bytes(8, "big"))) < bits)


# --- the proof of work, pure ---------------------------------------------------------------


@pytest.mark.parametrize("bits", [0, 1, 4, 8, 12])
def test_a_solved_proof_has_the_bits_and_verifies_only_for_its_peer(bits: int) -> None:
    peer, other = Identity.generate().peer_id, Identity.generate().peer_id
    nonce = solve(peer, bits)
    node_id = verify(peer, nonce, bits)
    assert node_id == node_id_of(peer, nonce) and leading_zero_bits(node_id) >= bits
    assert node_id != peer.dht_id  # no longer the plain hash anyone can grind for free
    if bits >= 4:
        with pytest.raises(BadIdProof):  # the same nonce for another PeerID: 1 in 2^bits chance
            for candidate in (other, *(Identity.generate().peer_id for _ in range(3))):
                verify(candidate, nonce, bits)


def test_a_proven_id_is_remembered_for_its_peer_nonce_and_bits_and_a_failed_one_never() -> None:
    """verify keeps the ids it proved (the same contacts come back in every lookup's answers),
    each under the difficulty it was proved for; a failed proof fails again."""
    peer = Identity.generate().peer_id
    strong = solve(peer, 8)
    assert verify(peer, strong, 8) == node_id_of(peer, strong)
    hits = id_proof._proven_id.cache_info().hits
    assert verify(peer, strong, 8) == node_id_of(peer, strong)
    assert id_proof._proven_id.cache_info().hits == hits + 1  # the second check hashed nothing
    weak = next(n for n in (i.to_bytes(8, "big") for i in range(1 << 16)) if leading_zero_bits(node_id_of(peer, n)) < 8)
    for _ in range(2):
        with pytest.raises(BadIdProof):
            verify(peer, weak, 8)
    assert verify(peer, weak, 0) == node_id_of(peer, weak)  # no difficulty asked: any nonce names an id
    with pytest.raises(BadIdProof):  # proved under 0 bits, still judged under 8
        verify(peer, weak, 8)


@pytest.mark.parametrize(
    "nonce", [None, b"", b"\x00" * 7, b"\x00" * 9, "00000000", 5, [b"\x00" * 8]], ids=lambda n: repr(n)[:12]
)
def test_malformed_nonces_are_refused(nonce: Any) -> None:
    with pytest.raises(BadIdProof):
        verify(Identity.generate().peer_id, nonce, 0)


def test_verifying_takes_microseconds_and_solving_grows_as_two_to_the_bits() -> None:
    peer = Identity.generate().peer_id
    nonce = solve(peer, 12)
    start = time.perf_counter()
    for _ in range(2000):
        verify(peer, nonce, 12)
    assert (time.perf_counter() - start) / 2000 < 50e-6
    tries = [int.from_bytes(solve(Identity.generate().peer_id, 10), "big") + 1 for _ in range(40)]
    assert 2**10 / 4 < sum(tries) / len(tries) < 2**10 * 4  # geometric with mean 2^bits


def _proves(peer: object, nonce: bytes) -> bool:
    """Whether nonce is a valid proof for peer (a fixed "tampered" nonce is one, 1 time in 2**BITS)."""
    try:
        verify(peer, nonce, BITS)  # type: ignore[arg-type]
    except BadIdProof:
        return False
    return True


def test_the_proof_is_saved_next_to_the_identity_and_reused(tmp_path: Path) -> None:
    peer = Identity.generate().peer_id
    path = tmp_path / "node.key.dht-id"
    nonce = load_or_solve(path, peer, BITS)
    saved = json.loads(path.read_text())
    assert saved["peer_id"] == str(peer) and bytes.fromhex(saved["nonce"]) == nonce
    tampered = next(n for n in (bytes([b]) * 8 for b in range(255, -1, -1)) if not _proves(peer, n))
    path.write_text(json.dumps({**saved, "nonce": tampered.hex()}))  # a tampered file is solved anew
    assert load_or_solve(path, peer, BITS) == nonce
    other = Identity.generate().peer_id  # a file of another identity is not used
    assert verify(other, load_or_solve(path, other, BITS), BITS) and json.loads(path.read_text())["peer_id"] == str(
        other
    )


async def test_a_node_with_an_identity_file_keeps_its_id_across_restarts(tmp_path: Path) -> None:
    identity = Identity.generate()
    path = tmp_path / "node.key.dht-id"
    ids = []
    for _ in range(2):
        async with DHTNode(identity, config=CONFIG, p2p_config=on("127.0.0.1"), id_proof_path=path) as node:
            ids.append(node.node_id)
    assert ids[0] == ids[1] == verify(identity.peer_id, bytes.fromhex(json.loads(path.read_text())["nonce"]), BITS)


# --- a forged id is never trusted, over real sockets ---------------------------------------


async def test_a_contact_with_a_forged_id_is_never_added(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="swarm.dht")
    async with (
        DHTNode(config=CONFIG, p2p_config=on("127.0.0.1")) as node,
        P2PHost(config=on("127.0.0.3")) as attacker,
    ):
        maddr = node.visible_maddrs[0]
        forged = {"a": attacker.visible_maddrs, "n": failing_nonce(attacker.peer_id)}
        for args in (forged, {"a": attacker.visible_maddrs}, {**forged, "n": b"short"}, forged):
            reply = await attacker.call(maddr, "dht.ping", args, timeout=5)  # served, never trusted
            assert reply["n"] == node.trust.nonce
            assert attacker.peer_id not in node.table
            await attacker.call(maddr, "dht.find", {**args, "id": b"\x00" * 20}, timeout=5)
            assert attacker.peer_id not in node.table
        logged = [r for r in caplog.records if "bad DHT id proof" in r.getMessage()]
        assert len(logged) == 1 and str(attacker.peer_id) in logged[0].getMessage()  # once, for 8 tries
        assert node.trust.bad_proofs == 8
        good = {"a": attacker.visible_maddrs, "n": solve(attacker.peer_id, BITS)}
        await attacker.call(maddr, "dht.ping", good, timeout=5)
        assert node.table.get(attacker.peer_id).node_id == verify(attacker.peer_id, good["n"], BITS)


# --- eclipse: 20 ids ground next to a key drop what they get ----------------------------------


class DroppingNode(DHTNode):
    """An attacker's DHT node: answers finds with its fellow attackers only (to pull lookups into
    the group) and never a record; accepts every store and keeps nothing."""

    fellows: list[Contact]

    async def _rpc_find(self, ctx: CallContext, args: Any) -> dict[str, Any]:
        target = int.from_bytes(args["id"], "big")
        self._heard_from_sender(ctx.peer_id, args)
        fellows = sorted(self.fellows, key=lambda c: c.node_id ^ target)[: self.config.k]
        return {"peers": [[c.peer_id.to_bytes(), list(c.maddrs), c.nonce] for c in fellows if c.peer_id != ctx.peer_id]}

    async def _rpc_store(self, ctx: CallContext, args: Any) -> dict[str, Any]:
        return {"results": ["ok"] * len(args["records"])}


def grind_ids_near(target: int, closer_than: int, count: int, bits: int) -> tuple[list[tuple[Identity, bytes]], int]:
    """Identities with valid proofs closer to target than `closer_than`; also the hashes tried."""
    found, tries = [], 0
    while len(found) < count:
        identity = Identity.generate()
        for counter in range(1 << 16):
            tries += 1
            nonce = counter.to_bytes(8, "big")
            node_id = node_id_of(identity.peer_id, nonce)
            if node_id ^ target < closer_than and leading_zero_bits(node_id) >= bits:
                found.append((identity, nonce))
                break
    return found, tries


@pytest.mark.timeout(120)
async def test_values_survive_20_ids_that_sit_closest_to_the_key_and_drop_stores(tmp_path: Path) -> None:
    """The writer may know all 20 ground ids: its 20 closest contacts then are the attackers, and
    when the disjoint paths started from those alone (1 run in 5 under load), each heard only of
    the attackers and every copy went to them. Each path now starts from k contacts of its own."""
    key = state_key("eclipsed")
    target = key_id(key)
    honest: list[DHTNode] = []
    attackers: list[DroppingNode] = []
    try:
        for _ in range(24):
            initial = [honest[0].visible_maddrs[0]] if honest else []
            honest.append(await DHTNode(initial_peers=initial, config=PATIENT, p2p_config=on("127.0.0.1")).start())
        nearest_honest = min(n.node_id ^ target for n in honest)
        ground, tries = grind_ids_near(target, nearest_honest, 20, BITS)
        # the proof of work makes each of these 2^BITS times dearer than grinding plain hashes
        assert tries > 20 * 2 ** (BITS - 2)
        for index, (identity, nonce) in enumerate(ground):
            proof = tmp_path / f"attacker{index}.dht-id"
            proof.write_text(json.dumps({"peer_id": str(identity.peer_id), "nonce": nonce.hex(), "bits": BITS}))
            node = DroppingNode(
                identity, [honest[index % 24].visible_maddrs[0]], config=PATIENT,
                p2p_config=on(f"127.0.0.{10 + index}"), id_proof_path=proof,
            )  # fmt: skip
            node.fellows = []
            attackers.append(await node.start())
        fellows = [node.trust.own_contact(tuple(node.visible_maddrs)) for node in attackers]
        for node in attackers:
            node.fellows = fellows
        for node in [*honest, *attackers]:  # every node announces itself near its own id again
            await node.find_node(node.node_id)
        writer, reader = honest[5], honest[17]
        found = await writer.search.lookup(target, None, stop_on_value=False)
        assert {c.peer_id for c in found.closest[:20]} == {a.peer_id for a in attackers}, "not eclipsed"
        subkey = owner_subkey(writer.peer_id)
        value = {"step": 3, "manifest": "ab" * 32}
        assert await writer.store(key, value, time.time() + 300, subkey=subkey) >= 1
        honest_copies = [n for n in honest if n.storage.get(key, time.time())]
        assert honest_copies, "every copy went to the attackers"
        for getter in (reader, honest[23], honest[0]):
            got = await getter.get(key)
            assert got is not None and got.value[subkey].value == value
    finally:
        await asyncio.gather(*(node.close() for node in [*honest, *attackers]))


# --- disjoint paths, on an in-memory graph -----------------------------------------------------


async def test_disjoint_paths_ask_each_node_once_and_route_around_a_bad_group() -> None:
    """Bad nodes (the closest to the target) answer with each other only; honest nodes know
    everyone and one honest node holds the value. One path is captured by the bad group at its
    first hop; three disjoint paths are not all captured."""
    target = 1 << 100
    peers = [Identity.generate().peer_id for _ in range(60)]
    contacts = {p: Contact(p, ("/memory/0",), target ^ (i + 1) * (1 << 60)) for i, p in enumerate(peers)}
    bad = set(peers[:10])  # the 10 closest to the target
    holder = peers[20]
    record = Record.create("k", None, "v", time.time() + 60)
    asked: list[PeerID] = []

    async def ask(contact: Contact) -> tuple[list[Contact], list[Record], bool]:
        asked.append(contact.peer_id)
        if contact.peer_id in bad:
            return [contacts[p] for p in bad], [], False
        holds = contact.peer_id == holder
        return list(contacts.values())[:30], ([record] if holds else []), holds

    async def lookup(initial: list[Contact], paths: int) -> bool:
        asked.clear()
        result = await iterative_lookup(
            target, initial, ask, own_id=Identity.generate().peer_id, k=10, alpha=3, stop_on_value=True,
            found=FreshestRecords(), paths=paths,
        )  # fmt: skip
        assert len(asked) == len(set(asked)), "a node was asked twice"
        return bool(result.records(time.time()))

    initial = [contacts[p] for p in peers[:3]] + [contacts[p] for p in peers[40:43]]
    assert not await lookup([contacts[p] for p in peers[:3]], paths=1)  # all bad: captured
    assert await lookup(initial, paths=3)
    result = await iterative_lookup(
        target, initial, ask, own_id=Identity.generate().peer_id, k=10, alpha=3, stop_on_value=False,
        found=FreshestRecords(), paths=3,
    )  # fmt: skip
    path_sets = [{c.peer_id for c in path} for path in result.path_closest]
    assert all(not (a & b) for i, a in enumerate(path_sets) for b in path_sets[i + 1 :])
    assert len(result.replicas()) == sum(map(len, path_sets)) > 10


def test_another_peers_word_cannot_move_a_known_peers_id() -> None:
    """A find reply may name a known PeerID with another valid proof (solved for that PeerID by
    someone else): the table keeps the id the peer announced itself; the peer's own word moves it."""
    own, peer = Identity.generate().peer_id, Identity.generate().peer_id
    table = RoutingTable(verify(own, solve(own, 4), 4), 20)
    first, other = solve(peer, 4), next(n for i in range(1 << 12) if verify_ok(peer, n := i.to_bytes(8, "big")))
    assert first != other
    table.add(peer, ("/a",), 1.0, node_id=node_id_of(peer, first), nonce=first)
    assert table.add(peer, ("/b",), 2.0, node_id=node_id_of(peer, other), nonce=other, own_word=False) is None
    assert table.get(peer).node_id == node_id_of(peer, first) and table.get(peer).maddrs == ("/a",)
    table.add(peer, ("/c",), 3.0, node_id=node_id_of(peer, other), nonce=other)
    assert table.get(peer).node_id == node_id_of(peer, other) and table.node_id_of(peer) == node_id_of(peer, other)
    assert len(table) == 1


def verify_ok(peer: PeerID, nonce: bytes) -> bool:
    """A valid 4-bit proof other than the first one solve() finds."""
    return leading_zero_bits(node_id_of(peer, nonce)) >= 4 and nonce != solve(peer, 4)
