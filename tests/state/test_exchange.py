"""State exchange over real sockets on 127.0.0.1: StateServer on several hosts, fetch_state
from all of them, with corrupt, dying, busy and incompatible peers."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from swarm.dht.records import owner_subkey
from swarm.model.checkpoint import RunInfo, Snapshot, copy_state, make_snapshot
from swarm.p2p import P2PConfig, P2PHost
from swarm.p2p.errors import RemoteError
from swarm.p2p.identity import Identity
from swarm.state import protocol
from swarm.state.config import FetchConfig
from swarm.state.fetcher import FetchError, RefusedManifest, fetch_state
from swarm.state.holders import Holder, choose_state, decode_holder, settled_holders
from swarm.state.server import ServeFaults, StateServer
from swarm.state.trust import fetch_reason

RUN = RunInfo(run_id="run", model="tiny", model_config={"dim": 8}, seed=0)
ONE_STREAM = FetchConfig(streams_per_peer=1)


def _state(step: int = 3, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    names = [f"layers.{i}.w" for i in range(6)]
    params = {n: torch.randn(64, 64, generator=gen) for n in names}
    momentum = {n: torch.randn(64, 64, generator=gen) for n in names}
    return {"outer_step": step, "params": params, "momentum": momentum}


def _snapshot(step: int = 3, run: RunInfo = RUN) -> Snapshot:
    return make_snapshot(copy_state(_state(step)), run, shard_bytes=40_000)  # 12 tensors of 16 KiB: 6 shards


async def _servers(
    n: int, snapshot: Snapshot, *, faults: Sequence[ServeFaults | None] = (), **kwargs
) -> tuple[list[P2PHost], list[StateServer]]:
    """n hosts serving snapshot; server i misbehaves as faults[i] says (None or absent: it does not)."""
    hosts = [await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start() for _ in range(n)]
    faults = list(faults) + [None] * (n - len(faults))
    servers = [StateServer(h, "run", faults=f, **kwargs) for h, f in zip(hosts, faults, strict=True)]
    for server in servers:
        server.publish(snapshot)
    return hosts, servers


def _holder(host: P2PHost, snapshot: Snapshot) -> Holder:
    m = snapshot.manifest
    return Holder(host.peer_id, m.step, m.sha256, tuple(host.visible_maddrs), m.total_bytes)


def _assert_same(state: dict, expected: dict) -> None:
    assert state["outer_step"] == expected["outer_step"]
    for kind in ("params", "momentum"):
        assert state[kind].keys() == expected[kind].keys()
        assert all(torch.equal(state[kind][n], expected[kind][n]) for n in expected[kind])


async def test_fetch_from_three_peers_spreads_shards_and_loads_the_exact_state(tmp_path: Path) -> None:
    snapshot = _snapshot()
    assert len(snapshot.manifest.shards) == 6
    hosts, _ = await _servers(3, snapshot)
    fetcher = await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
    seen = []
    try:
        holders = [_holder(h, snapshot) for h in hosts]
        manifest, state, report = await fetch_state(
            fetcher, "run", holders, expect=RUN, dest=tmp_path, config=ONE_STREAM, on_progress=seen.append
        )
        assert manifest.sha256 == snapshot.manifest.sha256
        _assert_same(state, _state())
        assert len(report.bytes_by_peer) == 3  # each peer served some shards
        assert report.fetched_bytes == snapshot.manifest.total_bytes and not report.corrupt_peers
        assert seen[-1].done_bytes == seen[-1].total_bytes and seen[-1].shards_done == 6
        # a second fetch finds every verified shard on disk
        _, again, report2 = await fetch_state(fetcher, "run", holders, expect=RUN, dest=tmp_path)
        assert report2.reused_shards == 6 and report2.fetched_bytes == 0
        _assert_same(again, _state())
    finally:
        for h in [*hosts, fetcher]:
            await h.close()


async def test_a_corrupt_peer_is_detected_avoided_and_its_shards_fetched_elsewhere(tmp_path: Path) -> None:
    good = _snapshot()
    tampered = {name: bytes(data) for name, data in good.shards.items()}
    for name in tampered:  # same length, one flipped byte in the tensor data
        data = bytearray(tampered[name])
        data[-1] ^= 0xFF
        tampered[name] = bytes(data)
    bad = Snapshot(good.manifest, tampered)
    hosts, servers = await _servers(2, good)
    servers[0].publish(bad)
    fetcher = await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
    try:
        holders = [_holder(h, good) for h in hosts]
        _, state, report = await fetch_state(fetcher, "run", holders, expect=RUN, dest=tmp_path, config=ONE_STREAM)
        _assert_same(state, _state())
        assert report.corrupt_peers == [str(hosts[0].peer_id)]
        assert report.bytes_by_peer == {str(hosts[1].peer_id): good.manifest.total_bytes}
        assert not await asyncio.to_thread(lambda: list(tmp_path.rglob("*.part*")))  # bad bytes never stay
    finally:
        for h in [*hosts, fetcher]:
            await h.close()


async def test_only_corrupt_peers_fail_the_fetch_without_loading(tmp_path: Path) -> None:
    good = _snapshot()
    bad = Snapshot(good.manifest, {n: b"\0" * len(d) for n, d in good.shards.items()})
    hosts, _ = await _servers(1, bad)
    fetcher = await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
    try:
        with pytest.raises(FetchError, match="corrupt peers") as failed:
            await fetch_state(fetcher, "run", [_holder(hosts[0], good)], expect=RUN, dest=tmp_path)
        assert failed.value.failed == {hosts[0].peer_id}  # the keeper does not ask it for this state again
    finally:
        for h in [*hosts, fetcher]:
            await h.close()


async def test_holders_that_are_gone_are_named_by_the_error() -> None:
    """Every holder of the chosen state unreachable (their advertisements outlive them): the
    FetchError names them all, so the node chooses among the live peers' states next."""
    snapshot = _snapshot()
    hosts, _ = await _servers(2, snapshot)
    holders = [_holder(h, snapshot) for h in hosts]
    for host in hosts:
        await host.close()
    fetcher = await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
    try:
        with pytest.raises(FetchError, match="sent its manifest") as failed:
            await fetch_state(fetcher, "run", holders, expect=RUN, config=FetchConfig(timeout=5))
        assert failed.value.failed == {h.peer_id for h in hosts}
    finally:
        await fetcher.close()


async def test_a_peer_dying_mid_fetch_is_replaced_by_the_others(tmp_path: Path) -> None:
    snapshot = _snapshot()
    hosts, _ = await _servers(3, snapshot)
    died = asyncio.Event()

    async def die_after_first_chunk(ctx, args, stream) -> None:  # the peer's process dies mid-upload
        await stream.write(memoryview(snapshot.shards[args["shard"]])[:1000])
        died.set()
        asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(hosts[0].close()))
        await asyncio.sleep(30)  # a dead peer sends nothing more (the close cancels this): not synchronisation

    hosts[0].remove_handler(protocol.SHARD)
    hosts[0].add_stream_handler(protocol.SHARD, die_after_first_chunk)
    fetcher = await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
    try:
        holders = [_holder(h, snapshot) for h in hosts]
        # a timeout far above the fetch's time: the death must be seen when the connection drops,
        # not waited out like a stall (the test below)
        config = FetchConfig(streams_per_peer=1, timeout=30)
        _, state, report = await fetch_state(fetcher, "run", holders, expect=RUN, dest=tmp_path, config=config)
        _assert_same(state, _state())
        assert died.is_set(), "the peer was never asked for a shard: nothing died mid-fetch"
        assert report.failed_peers == [str(hosts[0].peer_id)] and not report.corrupt_peers  # lost, not corrupt
        # the other two served all of it, the dying peer's shards included
        assert set(report.bytes_by_peer) == {str(hosts[1].peer_id), str(hosts[2].peer_id)}, report.bytes_by_peer
        assert sum(report.bytes_by_peer.values()) == report.fetched_bytes == snapshot.manifest.total_bytes
        assert report.elapsed_s < config.timeout / 2, f"{report.elapsed_s:.1f} s: the death was waited out"
    finally:
        for h in [*hosts, fetcher]:
            await h.close()


async def test_a_stalled_upload_times_out_and_its_shards_come_from_the_others(tmp_path: Path) -> None:
    snapshot = _snapshot()
    hosts, _ = await _servers(2, snapshot, faults=[ServeFaults(stall_after=1000)])  # 1000 bytes, then nothing
    fetcher = await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
    try:
        holders = [_holder(h, snapshot) for h in hosts]
        # the healthy peer is done long before the stalled download times out: its worker must wait
        # for that download (it once left after idling `timeout`, leaving the shard to nobody: 1 run in 2)
        config = FetchConfig(streams_per_peer=1, timeout=0.5)
        _, state, report = await fetch_state(fetcher, "run", holders, expect=RUN, dest=tmp_path, config=config)
        _assert_same(state, _state())
        assert report.failed_peers == [str(hosts[0].peer_id)]
        assert report.bytes_by_peer == {str(hosts[1].peer_id): snapshot.manifest.total_bytes}
    finally:
        for h in [*hosts, fetcher]:
            await h.close()


async def test_faults_corrupt_only_the_named_shards_and_slow_each_piece(tmp_path: Path) -> None:
    snapshot = _snapshot()
    names = sorted(snapshot.shards)
    faults = ServeFaults(corrupt=frozenset(names[:1]), chunk_bytes=4096, chunk_delay=0.001)
    hosts, servers = await _servers(1, snapshot, faults=[faults])
    client = await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
    try:
        for name in names[:2]:
            args = protocol.shard_args("run", snapshot.manifest.sha256, name)
            async with await client.open_stream(hosts[0].visible_maddrs[0], protocol.SHARD, args) as stream:
                await stream.end()
                received = bytearray()
                while (chunk := await stream.read(timeout=5)) is not None:
                    received += chunk
            assert len(received) == len(snapshot.shards[name])
            assert (bytes(received) == snapshot.shards[name]) is (name != names[0])
        assert snapshot.shards[names[0]] == _snapshot().shards[names[0]]  # the snapshot itself is untouched
        assert servers[0].uploads == 0
    finally:
        for h in [*hosts, client]:
            await h.close()


async def test_peers_that_advertise_the_state_later_join_the_fetch() -> None:
    snapshot = _snapshot()
    hosts, _ = await _servers(3, snapshot, faults=[ServeFaults(shard_delay=0.4)])  # alone: 6 x 0.4 s
    fetcher = await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
    asked = 0

    async def find_holders() -> list[Holder]:  # the DHT, read again: the other two advertise by now
        nonlocal asked
        asked += 1
        other = _holder(hosts[2], _snapshot(step=4))  # another state: never recruited
        return [_holder(h, snapshot) for h in hosts[:2]] + [other]

    try:
        _, state, report = await fetch_state(
            fetcher, "run", [_holder(hosts[0], snapshot)], expect=RUN,
            config=FetchConfig(streams_per_peer=1, timeout=5, recruit_every=0.1), find_holders=find_holders,
        )  # fmt: skip
        _assert_same(state, _state())
        assert asked >= 1
        assert set(report.bytes_by_peer) == {str(hosts[0].peer_id), str(hosts[1].peer_id)}, report.bytes_by_peer
    finally:
        for h in [*hosts, fetcher]:
            await h.close()


async def test_a_fetch_waits_briefly_for_peers_still_advertising_the_previous_step() -> None:
    peers = [Identity.from_seed(bytes([i]) * 32).peer_id for i in range(1, 4)]

    def holders(steps: list[int]) -> list[Holder]:
        return [Holder(p, s, f"sha{s}", ("/ip4/127.0.0.1/tcp/1",), 100) for p, s in zip(peers, steps, strict=True)]

    reads = [holders([6, 5, 5]), [], holders([6, 6, 5]), holders([6, 6, 6])]  # [] : a failed lookup

    async def find() -> list[Holder]:
        return reads.pop(0)

    settled = await settled_holders(holders([6, 5, 5]), 6, find, within=5.0, poll=0.01, min_bytes=100)
    assert [h.step for h in settled] == [6, 6, 5] and len(reads) == 1  # two donors are enough
    same = lambda: _same(holders([6, 5, 5]))  # noqa: E731
    gone = await settled_holders(holders([6, 5, 5]), 6, same, within=0.1, poll=0.01, min_bytes=100)
    assert [h.step for h in gone] == [6, 5, 5]  # a peer that never advertises it costs `within` at most


async def test_a_fetch_does_not_wait_for_peers_further_behind_nor_for_a_small_state() -> None:
    peers = [Identity.from_seed(bytes([i]) * 32).peer_id for i in range(1, 4)]

    def holders(steps: list[int], nbytes: int) -> list[Holder]:
        return [Holder(p, s, f"sha{s}", ("/ip4/127.0.0.1/tcp/1",), nbytes) for p, s in zip(peers, steps, strict=True)]

    async def never() -> list[Holder]:
        raise AssertionError("read again")

    stuck = await settled_holders(holders([6, 2, 2], 100), 6, never, within=5.0, poll=0.01, min_bytes=100)
    assert [h.step for h in stuck] == [6, 2, 2]  # peers stuck at step 2 are no reason to wait
    small = await settled_holders(holders([6, 5, 5], 99), 6, never, within=5.0, poll=0.01, min_bytes=100)
    assert [h.step for h in small] == [6, 5, 5]


async def _same(holders: list[Holder]) -> list[Holder]:
    return holders


async def test_a_busy_peer_is_asked_again(tmp_path: Path) -> None:
    snapshot = _snapshot()
    hosts, _ = await _servers(1, snapshot, max_uploads=1)
    fetcher = await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
    try:
        _, state, _ = await fetch_state(
            fetcher,
            "run",
            [_holder(hosts[0], snapshot)],
            expect=RUN,
            dest=tmp_path,
            config=FetchConfig(streams_per_peer=4),
        )
        _assert_same(state, _state())
    finally:
        for h in [*hosts, fetcher]:
            await h.close()


async def test_a_state_of_another_run_or_model_is_refused(tmp_path: Path) -> None:
    for other in (dataclasses.replace(RUN, run_id="other"), dataclasses.replace(RUN, model_config={"dim": 16})):
        snapshot = _snapshot(run=other)
        hosts, _ = await _servers(1, snapshot)
        fetcher = await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
        try:
            with pytest.raises(RefusedManifest, match=r"other|model"):
                await fetch_state(fetcher, "run", [_holder(hosts[0], snapshot)], expect=RUN, dest=tmp_path)
        finally:
            for h in [*hosts, fetcher]:
                await h.close()


async def test_a_manifest_that_does_not_hash_to_the_advertised_value_is_not_believed(tmp_path: Path) -> None:
    snapshot = _snapshot()
    hosts, _ = await _servers(1, snapshot)
    fetcher = await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
    try:
        lie = dataclasses.replace(_holder(hosts[0], snapshot), manifest=hashlib.sha256(b"x").hexdigest())
        with pytest.raises(FetchError, match="manifest"):
            await fetch_state(fetcher, "run", [lie], expect=RUN, dest=tmp_path)
    finally:
        for h in [*hosts, fetcher]:
            await h.close()


@pytest.mark.parametrize(
    ("method", "args"),
    [
        (protocol.MANIFEST, None),
        (protocol.MANIFEST, {"run": "other"}),
        (protocol.MANIFEST, {"run": "run", "sha256": "xyz"}),
        (protocol.MANIFEST, {"run": "run", "sha256": "0" * 64}),
        (protocol.SHARD, {"run": "run", "manifest": "0" * 64, "shard": "shard-00000.safetensors"}),
        (protocol.SHARD, {"run": "run", "manifest": "0" * 64, "shard": "../../etc/passwd"}),
        (protocol.SHARD, [1, 2]),
        (protocol.UPDATE, {"run": "run", "step": -1, "base": "0" * 64}),
        (protocol.UPDATE, {"run": "run", "step": True, "base": "0" * 64}),
        (protocol.UPDATE, {"run": "run", "step": 2**63, "base": "0" * 64}),
        (protocol.UPDATE, {"run": "run", "step": 0, "base": "XYZ"}),
        (protocol.UPDATE, {"run": "other", "step": 0, "base": "0" * 64}),
        (protocol.UPDATE, {"run": "run", "step": 0, "base": "0" * 64}),  # no such update kept
    ],
)
async def test_bad_requests_get_typed_errors(method: str, args: object) -> None:
    snapshot = _snapshot()
    hosts, _ = await _servers(1, snapshot)
    client = await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
    try:
        with pytest.raises(RemoteError) as info:
            if method == protocol.MANIFEST:
                await client.call(hosts[0].visible_maddrs[0], method, args, timeout=5)
            else:
                async with await client.open_stream(hosts[0].visible_maddrs[0], method, args, timeout=5) as stream:
                    await stream.end()
                    while await stream.read(timeout=5) is not None:
                        pass
        assert info.value.code in ("bad_request", "not_found")
    finally:
        for h in [*hosts, client]:
            await h.close()


def test_holders_are_decoded_strictly_and_the_most_advertised_newest_state_wins() -> None:
    from swarm.p2p.identity import Identity

    peers = [Identity.from_seed(bytes([i]) * 32).peer_id for i in range(1, 5)]
    a, b = "a" * 64, "b" * 64
    maddr = "/ip4/127.0.0.1/tcp/4001"
    holders = [
        decode_holder(owner_subkey(peers[0]), {"step": 5, "manifest": b, "maddrs": [maddr], "bytes": 10}),
        decode_holder(owner_subkey(peers[1]), {"step": 5, "manifest": a, "maddrs": [maddr], "bytes": 10}),
        decode_holder(owner_subkey(peers[2]), {"step": 5, "manifest": a, "maddrs": [maddr], "bytes": 10}),
        decode_holder(owner_subkey(peers[3]), {"step": 4, "manifest": b, "maddrs": [maddr], "bytes": 10}),
    ]
    assert all(h is not None for h in holders)
    step, sha, chosen = choose_state(holders)
    assert (step, sha) == (5, a) and {h.peer_id for h in chosen} == set(peers[1:3])
    assert str(peers[1]) in chosen[0].maddrs[0] or str(peers[2]) in chosen[0].maddrs[0]
    assert choose_state([]) is None
    for bad in (
        {"step": -1, "manifest": a, "maddrs": [maddr]},
        {"step": 5, "manifest": "A" * 64, "maddrs": [maddr]},
        {"step": 5, "manifest": a, "maddrs": []},
        {"step": 5, "manifest": a, "maddrs": ["nonsense"]},
        {"step": True, "manifest": a, "maddrs": [maddr]},
        [1],
    ):
        assert decode_holder(owner_subkey(peers[0]), bad) is None
    assert decode_holder("no-owner", {"step": 5, "manifest": a, "maddrs": [maddr]}) is None


async def test_without_a_directory_nothing_touches_the_disk(tmp_path: Path) -> None:
    snapshot = _snapshot()
    hosts, _ = await _servers(2, snapshot)
    fetcher = await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
    try:
        holders = [_holder(h, snapshot) for h in hosts]
        _, state, report = await fetch_state(fetcher, "run", holders, expect=RUN, dest=None)
        _assert_same(state, _state())
        assert report.fetched_bytes == snapshot.manifest.total_bytes and report.reused_shards == 0
    finally:
        for h in [*hosts, fetcher]:
            await h.close()


async def test_a_replaced_state_is_still_served_for_a_grace_period() -> None:
    old, new = _snapshot(3), _snapshot(4)
    hosts, servers = await _servers(1, old)
    client = await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
    try:
        servers[0].publish(new)
        maddr = hosts[0].visible_maddrs[0]
        reply = await client.call(maddr, protocol.MANIFEST, protocol.manifest_args("run", old.manifest.sha256))
        assert reply["sha256"] == old.manifest.sha256  # a fetch that picked it a moment ago can finish
        servers[0].previous_until = 0.0  # the grace period is over
        with pytest.raises(RemoteError, match="no longer served"):
            await client.call(maddr, protocol.MANIFEST, protocol.manifest_args("run", old.manifest.sha256))
    finally:
        for h in [*hosts, client]:
            await h.close()


@pytest.mark.parametrize(
    ("step", "holders", "own_step", "own_sha", "alone", "client", "expected"),
    [
        (7, 1, 5, "mine", False, False, "behind"),  # peers are ahead: always fetch
        (5, 1, 5, "mine", False, False, None),  # averaged in a group: our state is the group's
        (5, 2, 5, "theirs", True, False, None),  # alone, but we already hold their state
        (5, 2, 5, "mine", True, False, "missed its group"),  # alone while two agree on another
        (5, 1, 5, "mine", True, False, None),  # one server against one: no majority to follow
        (5, 1, 5, "mine", True, True, "missed its group"),  # a client follows even one server
        (4, 3, 5, "mine", True, True, None),  # an older state is taken only when every server is behind
    ],
)
def test_when_a_node_fetches(
    step: int, holders: int, own_step: int, own_sha: str, alone: bool, client: bool, expected: str | None
) -> None:
    why = fetch_reason(step, "theirs", holders, own_step, own_sha, alone_last_step=alone, client=client)
    assert why == expected


@pytest.mark.parametrize(
    ("alone", "client", "expected"),
    [
        (True, True, "ahead of every server"),  # its steps alone can never be served: it follows them
        (False, True, None),  # it averaged with a server: that server is about to publish our step
        (True, False, None),  # a server's own state can be fetched: the others catch up with it
    ],
)
def test_a_client_ahead_of_every_server_takes_their_state(alone: bool, client: bool, expected: str | None) -> None:
    why = fetch_reason(2, "theirs", 1, 5, "mine", alone_last_step=alone, client=client, servers_behind=True)
    assert why == expected
