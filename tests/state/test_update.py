"""A step's update (swarm/state/update.py): its exact encoding and its bounds; the state it makes
(DiLoCo.stepped_state, checkpoint.snapshot_like); serving it and taking it from holders, honest
and lying, over real sockets on 127.0.0.1 (update_fetch.py)."""

from __future__ import annotations

import random
import struct
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch

from swarm.dht.node import DHTNode
from swarm.model.checkpoint import RunInfo, copy_state, make_snapshot, snapshot_like
from swarm.model.diloco import DiLoCo, DiLoCoConfig
from swarm.model.llama import ModelConfig, build_model
from swarm.model.state_hash import state_sha256
from swarm.p2p import P2PConfig, P2PHost
from swarm.p2p.errors import RemoteError
from swarm.p2p.peer_id import PeerID
from swarm.state.config import KeeperConfig
from swarm.state.holders import Holder, advertise
from swarm.state.keeper import StateKeeper
from swarm.state.lineage_book import LineageBook, serve_lineage
from swarm.state.receipts import Receipt, RoundBody, sign
from swarm.state.server import KEPT_UPDATES, ServeFaults, StateServer, StepUpdate
from swarm.state.update import HEADER, UpdateError, decode_update, encode_update, max_body_length, split_update
from swarm.state.update_fetch import CaughtUp, by_update, fetch_update_body
from swarm_kernels import get_codec

SMALL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
RUN = RunInfo(run_id="run", model="small", model_config={"dim": 32}, seed=0)
LOCAL = P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))
CORRUPT_UPDATE = ServeFaults(corrupt=frozenset({"the update of step 0"}))  # a byte flipped on the wire; shards right


def on_grid(codec: str, n: int, block: int = 64, seed: int = 0) -> torch.Tensor:
    """Values a round of `codec` produces: random, encoded and decoded once."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 1e-3
    coder = get_codec(codec, block_size=block) if codec.startswith("int") else get_codec(codec)
    return coder.decode(coder.encode(x), n)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int32)


def with_negative_zero(n: int) -> torch.Tensor:
    x = on_grid("int8", n)
    x[5] = -0.0  # a round never makes one; here it must travel raw, and come back as -0.0
    return x


def off_grid_in(n: int, blocks: list[int]) -> torch.Tensor:
    """The round's grid, but one value in each of `blocks` (of 64) moved by one ulp: those travel raw."""
    x = on_grid("int8", n)
    for b in blocks:
        i = min(b * 64 + 3, n - 1)
        x[i] = torch.nextafter(x[i], torch.tensor(1.0))
    return x


@pytest.mark.parametrize(
    ("values", "codec", "most_bytes_per_element"),
    [
        (on_grid("int8", 10_000), "int8", 1.09),  # the round's grid: codes and scales, no raw block
        (on_grid("int8", 10_037), "int8", 1.09),  # a short last block
        (on_grid("int8", 4_096, block=256), "int8", 1.03),  # another block size, given right
        (on_grid("int4", 10_000), "int4", 0.6),
        (on_grid("fp16", 10_000), "fp16", 2.02),
        (torch.randn(10_000), "int8", 4.02),  # off the grid: plain fp32 is smaller than raw blocks
        (torch.randn(10_000), "none", 4.02),
        (on_grid("int8", 10_000), "bnb8", 4.02),  # a codec only CUDA decodes: sent plain
        (torch.zeros(1000), "int8", 1.1),
        (with_negative_zero(10_000), "int8", 1.2),  # one raw block of 64 fp32
        (off_grid_in(10_037, [0, 100, 156]), "int8", 1.2),  # three, the short last one among them
        (on_grid("int8", 1), "int8", 40.0),
    ],
)
def test_an_update_comes_back_bit_for_bit_and_small_on_the_rounds_grid(
    values: torch.Tensor, codec: str, most_bytes_per_element: float
) -> None:
    half = values.numel() // 2
    body = encode_update([values[:half], values[half:]], codec, 256 if values.numel() == 4_096 else 64)
    assert len(body) <= HEADER.size + most_bytes_per_element * values.numel() + 64
    assert len(body) <= max_body_length(values.numel())
    assert torch.equal(bits(decode_update(body, values.numel())), bits(values))


def _body(n: int = 1000) -> bytes:
    return encode_update([on_grid("int8", n)], "int8", 64)


def _header(body: bytes, **fields: object) -> bytes:
    parts = dict(zip(("magic", "codec", "block", "numel", "raw"), HEADER.unpack_from(body), strict=True))
    parts.update(fields)
    return HEADER.pack(*parts.values()) + body[HEADER.size :]


def _mask_of_two() -> bytes:
    """A body whose mask says 2 for a block (only 0 and 1 are defined), its count unchanged."""
    body = bytearray(encode_update([with_negative_zero(1000)], "int8", 64))
    mask = HEADER.size + get_codec("int8", block_size=64).encoded_nbytes(1000)
    body[mask : mask + 2] = b"\2\0" if body[mask] == 0 else b"\0\2"  # block 0 is the raw one
    return bytes(body)


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"", "shorter than"),
        (_body()[:20], "shorter than"),
        (_header(_body(), magic=b"XXXX"), "bad magic"),
        (_header(_body(), codec=b"int9\0\0\0\0"), "unknown codec"),
        (_header(_body(), numel=999), "999 elements"),
        (_header(_body(), block=0), "block size"),
        (_header(_body(), block=1 << 21), "block size"),
        (_header(_body(), raw=1000), "raw blocks"),
        (_header(_body(), raw=1), "bytes, its header says"),  # raw blocks it does not carry
        (_body()[:-1], "bytes, its header says"),
        (_body() + b"\0", "bytes, its header says"),
        (_header(encode_update([torch.randn(1000)], "none", 64), block=32), "block size"),
        # a negative scale: the int8 spec refuses it before decoding
        (_body()[: HEADER.size] + struct.pack("<f", -1.0) + _body()[HEADER.size + 4 :], "malformed"),
        (_mask_of_two(), "mask"),
    ],
)
def test_a_malformed_update_is_refused_with_a_clear_error(body: bytes, problem: str) -> None:
    with pytest.raises(UpdateError, match=problem):
        decode_update(body, 1000)


def test_an_update_is_cut_back_into_its_tensors_and_a_wrong_total_refused() -> None:
    flat = torch.arange(10.0)
    a, b = split_update(flat, [torch.Size([2, 3]), torch.Size([4])])
    assert a.shape == (2, 3) and b.tolist() == [6.0, 7.0, 8.0, 9.0]
    with pytest.raises(UpdateError):
        split_update(flat, [torch.Size([3])])


def _diloco(fragments: int = 1) -> DiLoCo:
    return DiLoCo(build_model(SMALL, seed=3), DiLoCoConfig(inner_steps=2, outer_lr=0.7, fragments=fragments))


def _average(diloco: DiLoCo, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) * 1e-3 for shape in diloco.round_shapes()]


@pytest.mark.parametrize("fragments", [1, 3])
def test_the_stepped_state_is_the_one_apply_outer_makes_and_nothing_changes_before(fragments: int) -> None:
    diloco = _diloco(fragments)
    for _ in range(fragments + 1):  # a few steps in: the momentum and another fragment than the first
        averaged = _average(diloco, seed=diloco.outer_step)
        before = diloco.state_sha256()
        stepped = diloco.stepped_state(averaged)
        assert diloco.state_sha256() == before
        diloco.apply_outer(averaged)
        assert state_sha256(stepped) == diloco.state_sha256()
    with pytest.raises(ValueError, match="NaN"):
        diloco.stepped_state([torch.full(s, float("nan")) for s in diloco.round_shapes()])


def test_a_state_is_serialized_into_any_manifests_shards() -> None:
    state = copy_state(_diloco().state_dict())
    for shard_bytes in (1 << 10, 20_000, 64 << 20):
        made = make_snapshot(state, RUN, shard_bytes)
        assert snapshot_like(state, made.manifest).manifest.sha256 == made.manifest.sha256
    other = copy_state(state)
    next(iter(other["params"].values()))[0] += 1.0
    assert snapshot_like(other, made.manifest).manifest.sha256 != made.manifest.sha256


class Donors:
    """A base state (step 0), the state of step 1 its true update makes, and hosts serving that
    state with an update each: honest, of another Δ̄ (a liar), or corrupted on the wire."""

    def __init__(self) -> None:
        self.diloco = _diloco()
        self.base = self.diloco.state_sha256()
        shapes = self.diloco.round_shapes()
        self.averaged = split_update(on_grid("int8", sum(s.numel() for s in shapes), seed=1), shapes)
        self.expected = self.diloco.stepped_state(self.averaged)
        self.snapshot = make_snapshot(copy_state(self.expected), RUN, 20_000)
        self.hosts: list[P2PHost] = []

    async def serve(self, kind: str = "honest", run_id: str = "run") -> Holder:
        host = await P2PHost(config=LOCAL).start()
        self.hosts.append(host)
        server = StateServer(host, run_id, faults=CORRUPT_UPDATE if kind == "corrupt" else None)
        server.publish(self.snapshot)
        averaged = _average(self.diloco, seed=9) if kind == "liar" else self.averaged
        server.publish_update(StepUpdate(0, self.base, encode_update(averaged, "int8", 64)))
        # the state's lineage: a round of one, the donor's, from the base state (its genesis)
        body = RoundBody(run_id, b"", 0, bytes(32), (host.peer_id,), (1.0,), bytes.fromhex(self.base),
                         bytes.fromhex(state_sha256(self.expected)))  # fmt: skip
        receipt = Receipt(body, {host.peer_id: sign(body, host.identity)})
        serve_lineage(host, run_id, lambda: [receipt])
        m = self.snapshot.manifest
        return Holder(host.peer_id, m.step, m.sha256, tuple(host.visible_maddrs), m.total_bytes)

    async def take(self, holders: list[Holder], seed: int = 0) -> tuple[CaughtUp | None, frozenset[PeerID]]:
        client = await P2PHost(config=LOCAL).start()
        self.hosts.append(client)

        async def stepped(averaged: list[torch.Tensor]) -> dict:
            return self.diloco.stepped_state(averaged)

        shapes = self.diloco.round_shapes()
        return await by_update(client, "run", holders, self.snapshot.manifest, base=self.base,
                               numel=sum(s.numel() for s in shapes), shapes=shapes, stepped=stepped, timeout=5.0,
                               rng=random.Random(seed))  # fmt: skip

    async def close(self) -> None:
        for host in self.hosts:
            await host.close()


@pytest.fixture
async def donors() -> AsyncIterator[Donors]:
    made = Donors()
    try:
        yield made
    finally:
        await made.close()


def _asking_first() -> int:
    """A seed with which by_update asks the first of two holders first."""
    for seed in range(100):
        order = [0, 1]
        random.Random(seed).shuffle(order)
        if order[0] == 0:
            return seed
    raise AssertionError("no such seed")


async def test_the_state_is_computed_from_an_honest_holders_update_and_liars_are_named(donors: Donors) -> None:
    liar, corrupt, honest = await donors.serve("liar"), await donors.serve("corrupt"), await donors.serve()
    caught, failed = await donors.take([liar, honest], seed=_asking_first())
    assert caught is not None and caught.peer == honest.peer_id and failed == {liar.peer_id}
    assert state_sha256(caught.state) == state_sha256(donors.expected)
    assert caught.snapshot.manifest.sha256 == donors.snapshot.manifest.sha256
    assert len(caught.body) < donors.snapshot.manifest.total_bytes / 7  # int8 Δ̄ against fp32 θ and momentum
    caught, failed = await donors.take([liar, corrupt])  # no honest holder: nothing is adopted
    assert caught is None and failed == {liar.peer_id, corrupt.peer_id}


async def test_holders_without_the_update_are_passed_over_not_blamed(donors: Donors) -> None:
    honest = await donors.serve()
    bare = await P2PHost(config=LOCAL).start()
    donors.hosts.append(bare)
    StateServer(bare, "run").publish(donors.snapshot)  # it holds the state, not the update (it fetched it)
    m = donors.snapshot.manifest
    without = Holder(bare.peer_id, m.step, m.sha256, tuple(bare.visible_maddrs), m.total_bytes)
    for seed in range(4):
        caught, failed = await donors.take([without, honest], seed=seed)
        assert caught is not None and failed == frozenset()


async def test_an_update_longer_than_its_header_says_is_cut_off(donors: Donors) -> None:
    host = await P2PHost(config=LOCAL).start()
    donors.hosts.append(host)
    server = StateServer(host, "run")
    body = encode_update(donors.averaged, "int8", 64)
    server.publish_update(StepUpdate(0, donors.base, body + b"\0" * 100_000))
    client = await P2PHost(config=LOCAL).start()
    donors.hosts.append(client)
    holder = Holder(host.peer_id, 1, "0" * 64, tuple(host.visible_maddrs), 0)
    numel = sum(s.numel() for s in donors.diloco.round_shapes())
    with pytest.raises(UpdateError, match="more than"):
        await fetch_update_body(client, "run", holder, 0, donors.base, numel, 5.0)
    with pytest.raises(UpdateError, match="elements"):  # an update of another size: refused at its header
        await fetch_update_body(client, "run", holder, 0, donors.base, numel - 1, 5.0)
    with pytest.raises(RemoteError) as info:
        await fetch_update_body(client, "run", holder, 1, donors.base, numel, 5.0)
    assert info.value.code == "not_found"


async def test_a_server_keeps_the_last_updates_only() -> None:
    host = await P2PHost(config=LOCAL).start()
    try:
        server = StateServer(host, "run")
        for step in range(5):
            server.publish_update(StepUpdate(step, f"{step:064x}", b"x"))
        assert sorted(s for s, _ in server.updates) == list(range(5 - KEPT_UPDATES, 5))
    finally:
        await host.close()


@pytest.mark.parametrize(("kind", "by_update_expected"), [("honest", True), ("liar", False), ("corrupt", False)])
async def test_the_keeper_takes_the_update_and_falls_back_to_the_whole_state_when_it_lies(
    donors: Donors, kind: str, by_update_expected: bool
) -> None:
    """A StateKeeper one step behind, over a real DHT: from an honest holder it takes the update
    (a few bytes); from a holder whose update does not lead to the state it advertises (another
    Δ̄, or bytes corrupted on the wire), it fetches the whole state instead and never adopts the
    lie."""
    bootstrap = await P2PHost(config=LOCAL).start()
    donors.hosts.append(bootstrap)
    dhts = [await DHTNode(host=bootstrap).start()]
    try:
        holder = await donors.serve(kind)
        host = donors.hosts[-1]
        dhts.append(await DHTNode(host=host, initial_peers=bootstrap.visible_maddrs).start())
        assert await advertise(dhts[-1], "run", donors.snapshot.manifest, host.visible_maddrs, time.time() + 600)
        node = await P2PHost(config=LOCAL).start()
        donors.hosts.append(node)
        dhts.append(await DHTNode(host=node, initial_peers=bootstrap.visible_maddrs).start())
        diloco = _diloco()  # the base state: step 0, as the donors' was
        lineage = LineageBook(node, dhts[-1], "run", b"", serve=True)
        lineage.start(0, bytes.fromhex(donors.base))
        keeper = StateKeeper(node, dhts[-1], RUN, in_trainer=_call, serve=True, checkpoint_dir=None,
                             config=KeeperConfig(shard_bytes=20_000), lineage=lineage)  # fmt: skip
        try:
            fetched = await keeper.catch_up(diloco, alone_last_step=False)
        finally:
            await keeper.close()
            await lineage.close()
        assert fetched is not None and holder.step == 1
        _, report = fetched
        assert report.by_update is by_update_expected
        assert diloco.state_sha256() == state_sha256(donors.expected)
        if by_update_expected:
            assert report.fetched_bytes < donors.snapshot.manifest.total_bytes / 7
            assert keeper.server is not None and (0, donors.base) in keeper.server.updates  # it serves it on
    finally:
        for dht in dhts:
            await dht.close()


async def _call(fn: Callable[..., Any], *args: Any) -> Any:  # the keeper's in_trainer, in the loop's thread
    return fn(*args)
