"""Bad input to a DHT node over real connections on 127.0.0.1: a raw P2PHost plays the attacker,
calling dht.ping / dht.find / dht.store with malformed and hostile arguments, and answering the
node's lookups with garbage. The node answers each with a typed error (bad_request) or a
per-record refusal, stores nothing it should not, never crashes, and keeps serving honest
peers (DESIGN.md, invariant 3)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.dht import DHTConfig, DHTNode, Record, owner_subkey
from swarm.dht.errors import RECORD_ERRORS
from swarm.dht.id_proof import solve
from swarm.dht.ids import ID_BYTES, id_to_bytes, key_id
from swarm.dht.protocol import proves_id
from swarm.dht.records import pack_value, signing_message
from swarm.p2p import CallContext, Identity, P2PConfig, P2PError, P2PHost, PeerID, RemoteError

LOCAL = ("/ip4/127.0.0.1/tcp/0",)
REFUSED = "/ip4/127.0.0.1/tcp/1"  # nothing listens on port 1: dialing it fails at once
CONFIG = DHTConfig(rpc_timeout=1.0, lookup_timeout=5.0, bootstrap_timeout=5.0, ping_timeout=1.0)


def p2p_config() -> P2PConfig:
    return P2PConfig(host_maddrs=LOCAL)


@pytest.fixture
async def node() -> AsyncIterator[DHTNode]:
    before = asyncio.all_tasks()
    async with DHTNode(config=CONFIG, p2p_config=p2p_config()) as node:
        yield node
    await asyncio.sleep(0)
    leaked = [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task() and not t.done()]
    assert not leaked, f"tasks leaked: {leaked}"


@pytest.fixture
async def attacker() -> AsyncIterator[P2PHost]:
    async with P2PHost(config=p2p_config()) as host:
        yield host


async def call(attacker: P2PHost, node: DHTNode, method: str, args: Any) -> Any:
    return await attacker.call(node.visible_maddrs[0], method, args, timeout=5)


async def assert_bad_request(attacker: P2PHost, node: DHTNode, method: str, args: Any) -> None:
    with pytest.raises(RemoteError) as info:
        await call(attacker, node, method, args)
    assert info.value.code == "bad_request", (method, args, info.value)


async def store(attacker: P2PHost, node: DHTNode, records: list[Any], **extra: Any) -> list[str]:
    reply = await call(attacker, node, "dht.store", {"a": None, "records": records, **extra})
    assert isinstance(reply, dict) and len(reply["results"]) == len(records)
    return reply["results"]


def stored(node: DHTNode, key: Any) -> list[Record]:
    now = time.time()
    return node.storage.get(key, now) + node.cache.get(key, now)


async def honest_peer_still_served(node: DHTNode) -> None:
    """A second node joins through `node`, stores a plain and an owned value, and reads them back
    through `node`; `node` reads them too."""
    async with DHTNode(initial_peers=[node.visible_maddrs[0]], config=CONFIG, p2p_config=p2p_config()) as honest:
        expiration = time.time() + 60
        assert await honest.store("honest/plain", {"x": 1}, expiration) >= 1
        subkey = owner_subkey(honest.peer_id, "ready")
        assert await honest.store("honest/owned", 7, expiration, subkey=subkey) >= 1
        for reader in (honest, node):
            plain = await reader.get("honest/plain", latest=True)
            assert plain is not None and plain.value == {"x": 1}
            owned = await reader.get("honest/owned", latest=True)
            assert owned is not None and owned.value[subkey].value == 7
        for key in ("honest/plain", "honest/owned"):  # store() counts honest's own copy: check `node` has one
            assert node.storage.get(key, time.time()), key


# --- malformed requests get bad_request ---------------------------------------------------------

BAD_ADDRS = [
    5,
    "x",
    b"/ip4",
    {"a": 1},
    [5],
    ["no-slash"],
    [b"/ip4/1.2.3.4/tcp/1"],
    ["/ip4"] * (CONFIG.max_maddrs_per_peer + 1),
    ["/" + "a" * 300],
]
NOT_A_MAP = [None, 5, "x", b"x", [], [{"a": None}], True]


async def test_ping_with_malformed_arguments(node: DHTNode, attacker: P2PHost) -> None:
    for args in NOT_A_MAP:
        await assert_bad_request(attacker, node, "dht.ping", args)
    for addrs in BAD_ADDRS:
        await assert_bad_request(attacker, node, "dht.ping", {"a": addrs})
    assert attacker.peer_id not in node.table
    assert await call(attacker, node, "dht.ping", {"a": None}) == {"a": node.visible_maddrs, "n": node.trust.nonce}
    assert attacker.peer_id not in node.table  # client mode: asks, is not added
    await honest_peer_still_served(node)


async def test_find_with_malformed_arguments(node: DHTNode, attacker: P2PHost) -> None:
    good_id = id_to_bytes(key_id("k"))
    for args in NOT_A_MAP:
        await assert_bad_request(attacker, node, "dht.find", args)
    for addrs in BAD_ADDRS:
        await assert_bad_request(attacker, node, "dht.find", {"a": addrs, "id": good_id})
    for raw_id in [None, 5, "x" * ID_BYTES, good_id[:-1], good_id + b"\x00", b"", [good_id], key_id("k") >> 100]:
        await assert_bad_request(attacker, node, "dht.find", {"a": None, "id": raw_id})
    for key in [5, 1.5, True, ["k"], {"k": 1}]:
        await assert_bad_request(attacker, node, "dht.find", {"a": None, "id": good_id, "key": key})
    await honest_peer_still_served(node)


async def test_find_whose_id_is_not_the_keys_id(node: DHTNode, attacker: P2PHost) -> None:
    expiration = time.time() + 60
    assert await node.store("secret", "v", expiration) == 1
    for other in (key_id("other"), key_id(b"secret"), key_id("secret") ^ 1):
        await assert_bad_request(attacker, node, "dht.find", {"a": None, "id": id_to_bytes(other), "key": "secret"})
    reply = await call(attacker, node, "dht.find", {"a": None, "id": id_to_bytes(key_id("secret")), "key": "secret"})
    assert [r[1] for r in reply["records"]] == [pack_value("v")]  # the well-formed request is served


async def test_find_with_an_oversize_key(node: DHTNode, attacker: P2PHost) -> None:
    for key in ("k" * (CONFIG.max_key_bytes + 1), b"k" * (CONFIG.max_key_bytes + 1)):
        await assert_bad_request(attacker, node, "dht.find", {"a": None, "id": id_to_bytes(key_id(key)), "key": key})
    await honest_peer_still_served(node)


async def test_store_with_malformed_arguments(node: DHTNode, attacker: P2PHost) -> None:
    good = Record.create("k", None, 1, time.time() + 60).to_wire()
    for args in NOT_A_MAP:
        await assert_bad_request(attacker, node, "dht.store", args)
    for addrs in BAD_ADDRS:  # a bad address refuses the whole request, good records included
        await assert_bad_request(attacker, node, "dht.store", {"a": addrs, "records": [good]})
    for records in [None, 5, "x", b"x", {"0": good}, []]:
        await assert_bad_request(attacker, node, "dht.store", {"a": None, "records": records})
    await assert_bad_request(attacker, node, "dht.store", {"a": None})
    assert len(node.storage) == 0 and len(node.cache) == 0
    await honest_peer_still_served(node)


async def test_store_with_too_many_records(node: DHTNode, attacker: P2PHost) -> None:
    expiration = time.time() + 60
    records = [Record.create(f"k{i}", None, i, expiration).to_wire() for i in range(CONFIG.max_store_batch + 1)]
    await assert_bad_request(attacker, node, "dht.store", {"a": None, "records": records})
    assert len(node.storage) == 0
    assert await store(attacker, node, records[: CONFIG.max_store_batch]) == ["ok"] * CONFIG.max_store_batch
    assert len(node.storage) == CONFIG.max_store_batch


async def test_store_records_of_the_wrong_shape_are_refused_one_by_one(node: DHTNode, attacker: P2PHost) -> None:
    exp = time.time() + 60
    good = ["k", None, pack_value(1), exp, None]
    bad = [
        None,
        "k",
        5,
        {"key": "k"},
        good[:4],
        [*good, None],
        [5, *good[1:]],
        [None, *good[1:]],
        ["k", 5, *good[2:]],
        ["k", ["s"], *good[2:]],
        ["k", None, "str value", exp, None],
        ["k", None, 5, exp, None],
        ["k", None, pack_value(1), "soon", None],
        ["k", None, pack_value(1), True, None],
        ["k", None, pack_value(1), None, None],
        ["k", None, pack_value(1), exp, "signature"],
        ["k" * (CONFIG.max_key_bytes + 1), None, pack_value(1), exp, None],  # oversize key
        ["k", "s" * (CONFIG.max_subkey_bytes + 1), pack_value(1), exp, None],  # oversize subkey
        ["k", "[owner:nonsense]x", pack_value(1), exp, b"\x00" * 64],  # malformed owner marker
        ["k", "plain", pack_value(1), exp, b"\x00" * 64],  # a signature on an unowned record
    ]
    results = await store(attacker, node, [*bad, good])
    assert results == ["bad_record"] * len(bad) + ["ok"]
    assert [r.value for r in stored(node, "k")] == [pack_value(1)]  # only the good one
    assert len(node.storage) == 1


async def test_store_refuses_expired_far_future_and_oversize_records(node: DHTNode, attacker: P2PHost) -> None:
    now = time.time()
    records = [
        ["late", None, pack_value(1), now - 1, None],
        ["far", None, pack_value(1), now + CONFIG.max_ttl + CONFIG.max_clock_skew + 3600, None],
        ["nan", None, pack_value(1), float("nan"), None],
        ["big", None, b"\xc4" + bytes(CONFIG.max_value_bytes), now + 60, None],
        ["skewed", None, pack_value(1), now + CONFIG.max_ttl + CONFIG.max_clock_skew / 2, None],
    ]
    results = await store(attacker, node, records)
    assert results == ["bad_expiration", "bad_expiration", "bad_expiration", "too_large", "ok"]
    assert node.storage.keys() == ["skewed"]


# --- signed records ---------------------------------------------------------------------------


async def test_forged_signed_records_are_refused_and_not_stored(node: DHTNode, attacker: P2PHost) -> None:
    victim = Identity.generate()
    expiration = time.time() + 60
    key, subkey = "run/ready", owner_subkey(victim.peer_id, "#1")
    value = pack_value("evil")
    message = signing_message(key, subkey, value, expiration)
    genuine = Record.create(key, subkey, "good", expiration, victim)
    forged = [
        [key, subkey, value, expiration, attacker.identity.sign(message)],  # signed by the wrong key
        [key, subkey, value, expiration, None],  # not signed at all
        [key, subkey, value, expiration, b"\x00" * 64],  # garbage signature
        [key, subkey, value, expiration, genuine.signature],  # a genuine signature over other content
        [key, subkey, value, expiration + 1, victim.sign(message)],  # tampered expiration
        [owner_subkey(victim.peer_id), None, value, expiration, attacker.identity.sign(message)],  # owned plain key
    ]
    for cache in (False, True):
        assert await store(attacker, node, forged, cache=cache) == ["bad_signature"] * len(forged)
    assert stored(node, key) == [] and stored(node, owner_subkey(victim.peer_id)) == []
    assert len(node.storage) == 0 and len(node.cache) == 0
    # the victim's own record still goes in, and a forgery cannot then replace it
    assert await store(attacker, node, [genuine.to_wire()]) == ["ok"]
    later = [
        key,
        subkey,
        value,
        expiration + 30,
        attacker.identity.sign(signing_message(key, subkey, value, expiration + 30)),
    ]
    assert await store(attacker, node, [later]) == ["bad_signature"]
    assert stored(node, key) == [genuine]
    await honest_peer_still_served(node)


async def test_replayed_older_record_is_outdated(node: DHTNode, attacker: P2PHost) -> None:
    owner = Identity.generate()
    now = time.time()
    subkey = owner_subkey(owner.peer_id)
    old = Record.create("k", subkey, "old", now + 60, owner)
    new = Record.create("k", subkey, "new", now + 120, owner)
    assert await store(attacker, node, [new.to_wire()]) == ["ok"]
    assert await store(attacker, node, [old.to_wire(), new.to_wire()]) == ["outdated", "outdated"]
    assert stored(node, "k") == [new]
    found = await node.get("k")
    assert found is not None and found.value[subkey].value == "new"


async def test_mixed_batch_gets_one_result_per_record_in_order(node: DHTNode, attacker: P2PHost) -> None:
    owner = Identity.generate()
    exp = time.time() + 60
    subkey = owner_subkey(owner.peer_id)
    batch = [
        Record.create("a", None, 1, exp).to_wire(),
        ["a", subkey, pack_value(2), exp, attacker.identity.sign(b"x")],
        ["b", None, pack_value(bytes(CONFIG.max_value_bytes)), exp, None],  # with its header: too large
        Record.create("c", subkey, 3, exp, owner).to_wire(),
        Record.create("c", subkey, 3, exp, owner).to_wire(),  # the same again: not newer
        "junk",
    ]
    assert await store(attacker, node, batch) == ["ok", "bad_signature", "too_large", "ok", "outdated", "bad_record"]
    assert sorted(node.storage.keys()) == ["a", "c"] and len(node.storage) == 2


# --- garbage replies to the node's own lookups --------------------------------------------------


class FakeDHTPeer:
    """Handlers on the attacker's host that answer the node's pings properly and its finds with
    whatever `reply` says."""

    def __init__(self, host: P2PHost) -> None:
        self.host = host
        self.reply: Any = {"peers": []}
        self.finds = 0
        self.release = asyncio.Event()
        host.add_handler("dht.ping", self.ping)
        host.add_handler("dht.find", self.find)

    async def ping(self, ctx: CallContext, args: Any) -> Any:
        return {"a": self.host.visible_maddrs, "n": solve(self.host.peer_id, CONFIG.id_bits)}

    async def find(self, ctx: CallContext, args: Any) -> Any:
        self.finds += 1
        if self.reply == "hang":
            await self.release.wait()
            return {"peers": []}
        return self.reply


def failing_nonce(peer: PeerID) -> bytes:
    """A nonce that does not prove an id of CONFIG.id_bits for peer."""
    return next(n for i in range(1000) if not proves_id(n := i.to_bytes(8, "big"), peer, CONFIG))


def fake_peers(count: int, addrs: list[str] | None = None) -> list[list[Any]]:
    """Contacts with valid id proofs (so they are tried, and fail to answer)."""
    peers = [Identity.generate().peer_id for _ in range(count)]
    return [[peer.to_bytes(), addrs or [REFUSED], solve(peer, CONFIG.id_bits)] for peer in peers]


async def look_up_through(node: DHTNode, fake: FakeDHTPeer, key: str, reply: Any) -> Any:
    """Make the node know the attacker (a ping), then get(key) with the attacker's find answering `reply`."""
    fake.reply = reply
    peer, _ = await node.ping(fake.host.visible_maddrs[0])
    assert peer == fake.host.peer_id and peer in node.table
    asked = fake.finds
    result = await asyncio.wait_for(node.get(key), 5)
    assert fake.finds > asked, "the node never asked the attacker"
    return result


async def test_garbage_find_replies_do_not_break_lookups(node: DHTNode, attacker: P2PHost) -> None:
    fake = FakeDHTPeer(attacker)
    some_id = Identity.generate().peer_id.to_bytes()
    now = time.time()
    malformed = [
        None,
        5,
        "peers",
        [],
        b"\x00" * 20,
        {"peers": "x"},
        {"peers": None},
        {"peers": [1, 2]},
        {"peers": [[b"not a peer id", [REFUSED]]]},
        {"peers": [[some_id]]},
        {"peers": [[some_id, REFUSED]]},
        {"peers": [[some_id, [5]]]},
        {"peers": [[some_id, ["no-slash"]]]},
        {"peers": [[some_id, [REFUSED] * (CONFIG.max_maddrs_per_peer + 1)]]},
        {"peers": [[str(PeerID(some_id)), [REFUSED]]]},
        {"peers": fake_peers(CONFIG.k + 1)},  # more than k
        {"peers": [], "records": "x"},
        {"peers": [], "records": [["only", "three", "fields"]]},
        {"peers": [], "records": [None]},
        {"peers": [], "records": [[None, pack_value(1), now + 60, None]] * (CONFIG.max_subkeys_per_key + 1)},
    ]
    for i, reply in enumerate(malformed):
        assert await look_up_through(node, fake, f"key{i}", reply) is None, reply
        assert attacker.peer_id not in node.table, f"kept a peer that sent a malformed reply: {reply}"
    # well-formed replies that lead nowhere, or carry records no honest node would store
    owner = Identity.generate()
    subkey = owner_subkey(owner.peer_id)
    useless = [
        {"peers": []},
        {"peers": fake_peers(CONFIG.k)},  # k peers nobody can reach
        {"peers": fake_peers(3, ["/not/a/multiaddr", "/ip4/127.0.0.1/tcp/99999"])},
        {"peers": [[node.peer_id.to_bytes(), node.visible_maddrs, node.trust.nonce]]},  # the node itself
        {"peers": [[attacker.peer_id.to_bytes(), [REFUSED], solve(attacker.peer_id, CONFIG.id_bits)]]},  # elsewhere
        {"peers": [[some_id, [REFUSED], failing_nonce(PeerID(some_id))], [some_id, [REFUSED], b"short"]]},  # bad proofs
        {"peers": [], "records": [[5, pack_value(1), now + 60, None]]},  # bad subkey type
        {"peers": [], "records": [[None, "str", now + 60, None]]},
        {"peers": [], "records": [[None, pack_value(1), now - 1, None]]},  # expired
        {"peers": [], "records": [[None, pack_value(1), now + 10 * CONFIG.max_ttl, None]]},  # too far ahead
        {"peers": [], "records": [[None, bytes(CONFIG.max_value_bytes + 10), now + 60, None]]},  # too large
        {"peers": [], "records": [[subkey, pack_value(1), now + 60, None]]},  # owned, unsigned
        {"peers": [], "records": [[subkey, pack_value(1), now + 60, attacker.identity.sign(b"x")]]},  # forged
        {"peers": [], "records": [[None, pack_value(1), now + 60, b"\x00" * 64]]},  # signed, unowned
        {"peers": [], "records": []},
        "hang",  # never answers: the lookup gives up on it after rpc_timeout
    ]
    for i, reply in enumerate(useless):
        assert await look_up_through(node, fake, f"useless{i}", reply) is None, reply
    fake.release.set()
    # positive control: the same channel does deliver records that are valid
    valid = Record.create("ctl", subkey, "signed", now + 60, owner)
    reply = {
        "peers": [],
        "records": [
            [subkey, pack_value("forged"), now + 90, attacker.identity.sign(b"x")],
            [valid.subkey, valid.value, valid.expiration, valid.signature],
            ["other", pack_value("plain"), now + 60, None],
        ],
    }
    found = await look_up_through(node, fake, "ctl", reply)
    assert found is not None
    assert {s: v.value for s, v in found.value.items()} == {subkey: "signed", "other": "plain"}
    assert len(node.storage) == 0  # a lookup's results are not stored as if a peer had stored them
    await honest_peer_still_served(node)


@pytest.mark.parametrize(
    "raw_value",
    [b"\xc1", b"\x92\x01", b"\x81\x91\x01\x01", b"\x01\x02"],
    ids=["reserved-byte", "truncated", "unhashable-map-key", "trailing-bytes"],
)
async def test_undecodable_value_in_a_find_reply_does_not_break_get(
    node: DHTNode, attacker: P2PHost, raw_value: bytes
) -> None:
    """A value is opaque bytes on the wire, and get() unpacks it: a peer can send bytes that are
    not msgpack (or not a value get() can build)."""
    fake = FakeDHTPeer(attacker)
    reply = {"peers": [], "records": [[None, raw_value, time.time() + 60, None]]}
    assert await look_up_through(node, fake, "poisoned", reply) is None


@pytest.mark.parametrize("raw_value", [b"\xc1", b"\x81\x91\x01\x01"], ids=["reserved-byte", "unhashable-map-key"])
async def test_undecodable_value_stored_by_a_peer_does_not_break_get(
    node: DHTNode, attacker: P2PHost, raw_value: bytes
) -> None:
    results = await store(attacker, node, [["poisoned", None, raw_value, time.time() + 60, None]])
    assert results[0] in ("ok", "bad_record")
    assert await asyncio.wait_for(node.get("poisoned"), 5) is None
    async with DHTNode(initial_peers=[node.visible_maddrs[0]], config=CONFIG, p2p_config=p2p_config()) as honest:
        assert await asyncio.wait_for(honest.get("poisoned"), 5) is None


async def test_garbage_ping_reply_is_a_typed_error(node: DHTNode, attacker: P2PHost) -> None:
    replies = iter([None, 5, {"a": 5}, {"a": ["no-slash"]}, {"a": [REFUSED] * (CONFIG.max_maddrs_per_peer + 1)}])

    async def ping(ctx: CallContext, args: Any) -> Any:
        return next(replies)

    attacker.add_handler("dht.ping", ping)
    for _ in range(5):
        with pytest.raises(P2PError):  # a typed error (BadRequest), not a crash
            await node.ping(attacker.visible_maddrs[0])
    assert attacker.peer_id not in node.table
    await honest_peer_still_served(node)


# --- random requests --------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=30),
    st.binary(max_size=30),
    st.binary(min_size=ID_BYTES, max_size=ID_BYTES),
    st.just("/ip4/127.0.0.1/tcp/1"),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=6), max_leaves=12)
requests = st.one_of(
    values,
    st.dictionaries(st.sampled_from(["a", "id", "key", "records", "cache", "x"]), values, max_size=5),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(["dht.ping", "dht.find", "dht.store"]), args=requests)
async def test_random_requests_get_a_reply_or_bad_request(
    node: DHTNode, attacker: P2PHost, method: str, args: Any
) -> None:
    try:
        msgpack.packb(args, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return
    try:
        reply = await call(attacker, node, method, args)
    except RemoteError as e:
        assert e.code == "bad_request", e  # never "internal": no handler may crash on input
    else:
        assert isinstance(reply, dict)
        if method == "dht.store":
            assert set(reply["results"]) <= {"ok", *RECORD_ERRORS}


async def test_node_serves_an_honest_peer_after_random_requests(node: DHTNode, attacker: P2PHost) -> None:
    for args in ({"a": [1, 2]}, {"records": [[1] * 5] * 64, "a": None}, {"id": b"\x00" * 20, "key": 1, "a": None}):
        for method in ("dht.ping", "dht.find", "dht.store"):
            try:
                await call(attacker, node, method, args)
            except RemoteError as e:
                assert e.code == "bad_request"
    await honest_peer_still_served(node)
