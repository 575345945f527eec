"""Chunk claims in a real DHT on 127.0.0.1 (swarm/data/claims.py, claimer.py): records are
bounded and need a proven id; 6 nodes in one loop train every chunk of an epoch exactly once;
a dead claimant's chunk is claimed again; a restarted node resumes from its saved position."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from swarm.data.chunks import ChunkPlan, pack_done
from swarm.data.claimer import ChunkClaimer, ClaimerConfig
from swarm.data.claims import MAX_LIVE, decode_claim
from swarm.data.cursor import ChunkCursor, CursorClosed
from swarm.dht import DHTNode
from swarm.dht.id_proof import solve
from swarm.dht.records import owner_subkey
from swarm.p2p.identity import Identity
from tests.averaging.test_ready import failing_nonce
from tests.dht.conftest import LOCAL

SEQ = 4


class Reads:
    """A token stream that records which rows were read (the tokens themselves do not matter)."""

    def __init__(self) -> None:
        self.starts: list[int] = []

    def windows(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        self.starts += starts.tolist()
        return torch.zeros((len(starts), length), dtype=torch.int64)

    def prefetch(self, shard: int) -> None:
        pass


def test_a_claim_record_counts_only_well_formed_bounded_and_proven() -> None:
    bits, n, now = 6, 16, time.time()
    owner = Identity.from_seed(b"\x05" * 32).peer_id
    good = {"epoch": 0, "live": [[3, now - 1]], "until": now + 30, "n": n, "tokens": 10,
            "done": [[0, pack_done(np.zeros(n, dtype=bool))]], "proof": solve(owner, bits)}  # fmt: skip
    assert decode_claim(owner_subkey(owner), good, n=n, id_bits=bits, now=now) is not None
    bad = {
        "no proof": {"proof": None},
        "a failing proof": {"proof": failing_nonce(owner, bits)},
        "more live claims than MAX_LIVE": {"live": [[c, now] for c in range(MAX_LIVE + 1)]},
        "one chunk claimed twice": {"live": [[3, now], [3, now]]},
        "a chunk outside the plan": {"live": [[n, now]]},
        "a claim dated in the future": {"live": [[3, now + 3600]]},
        "a lapse far ahead": {"until": now + 3600},
        "another plan": {"n": n + 1},
        "a bitmap of another size": {"done": [[0, pack_done(np.zeros(n + 8, dtype=bool))]]},
        "a bitmap that is no zlib": {"done": [[0, b"garbage"]]},
        "done marks of a far epoch": {"done": [[5, pack_done(np.zeros(n, dtype=bool))]]},
        "a negative epoch": {"epoch": -1},
        "a bool for a number": {"tokens": True},
    }
    for name, change in bad.items():
        assert decode_claim(owner_subkey(owner), {**good, **change}, n=n, id_bits=bits, now=now) is None, name
    assert decode_claim("not-owned", good, n=n, id_bits=bits, now=now) is None
    # a zlib bomb: a small value that would inflate far beyond the bitmap is cut at the bitmap's size
    import zlib

    bomb = zlib.compress(b"\x00" * (64 << 20))
    assert decode_claim(owner_subkey(owner), {**good, "done": [[0, bomb]]}, n=n, id_bits=bits, now=now) is None


async def _swarm(count: int) -> list[DHTNode]:
    first = await DHTNode(p2p_config=LOCAL).start()
    nodes = [first]
    for _ in range(count - 1):
        nodes.append(await DHTNode(p2p_config=LOCAL, initial_peers=first.visible_maddrs).start())
    return nodes


def _train(cursor: ChunkCursor, stop: threading.Event, batch: int = 2) -> None:
    while not stop.is_set():
        try:
            cursor.next_batch(batch, timeout=60)
        except CursorClosed:
            return
        time.sleep(0.01)


Part = tuple[Reads, ChunkCursor, ChunkClaimer]


async def _run(nodes: list[DHTNode], plan: ChunkPlan, seconds: float, tmp: Path | None = None,
               ttl: float = 1.5, until_epoch: int | None = None) -> list[Part]:  # fmt: skip
    """Train for `seconds`, or (until_epoch) until every node is in that epoch, at most `seconds`."""
    parts = []
    for i, dht in enumerate(nodes):
        reads = Reads()
        cursor = ChunkCursor(plan, reads, seq_len=SEQ, name="tokens:test")
        position = tmp / f"node{i}.json" if tmp is not None else None
        parts.append((reads, cursor, ChunkClaimer(dht, "run", cursor, ClaimerConfig(claim_ttl=ttl, position=position))))
    stop = threading.Event()
    for _, _, claimer in parts:
        await claimer.start()
    # a thread each, as a node has (the default executor would run only a few of them at a time)
    threads = [threading.Thread(target=_train, args=(cursor, stop), daemon=True) for _, cursor, _ in parts]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            if until_epoch is not None and all(c.epoch >= until_epoch for _, c, _ in parts):
                break
    finally:
        stop.set()
        for _, cursor, claimer in parts:
            await claimer.close()
            cursor.close()
        for thread in threads:
            await asyncio.to_thread(thread.join, 10)
    return parts


def _chunk_of(plan: ChunkPlan, start: int) -> int:
    return int(np.searchsorted(np.array(plan.ends), start, side="right"))


@pytest.mark.timeout(90)
async def test_6_nodes_train_every_chunk_of_an_epoch_exactly_once() -> None:
    plan = ChunkPlan.of([SEQ * 20 + 1] * 24, chunk_tokens=SEQ * 10 + 1)  # 48 chunks of 10 rows
    nodes = await _swarm(6)
    try:
        # claims live 10 s: training threads on a small machine can hold the event loop back
        # for a second or more, and a claim that lapses before it is renewed is free to others
        parts = await _run(nodes, plan, seconds=60.0, ttl=10.0, until_epoch=1)
    finally:
        await asyncio.gather(*(n.close() for n in nodes))
    assert all(cursor.epoch >= 1 for _, cursor, _ in parts), "the first epoch did not end in 60 s"
    finished = Counter(item for _, cursor, _ in parts for item in cursor.finished)
    assert {c for e, c in finished if e == 0} == set(range(plan.n))  # the first epoch: every chunk
    twice = [item for item, count in finished.items() if count > 1]
    assert not twice, f"(epoch, chunk) finished by several nodes: {twice}"
    rows = Counter(start for reads, _, _ in parts for start in reads.starts)
    epochs = max(cursor.epoch for _, cursor, _ in parts) + 1
    assert max(rows.values()) <= epochs  # no row read twice in one epoch


@pytest.mark.timeout(60)
async def test_a_dead_claimants_chunk_is_claimed_again_and_epochs_roll_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="swarm.data.claimer")
    plan = ChunkPlan.of([SEQ * 10 + 1] * 12, chunk_tokens=SEQ * 10 + 1)  # 12 chunks
    nodes = await _swarm(2)
    try:
        dead_cursor = ChunkCursor(plan, Reads(), seq_len=SEQ, name="tokens:test")
        dead = ChunkClaimer(nodes[0], "run", dead_cursor, ClaimerConfig(claim_ttl=1.0))
        await dead.cycle()  # claims two chunks, then dies without releasing them (kill -9)
        held = {c for c, _ in dead_cursor.held()}
        assert len(held) == MAX_LIVE
        parts = await _run(nodes[1:], plan, seconds=40.0, ttl=1.0, until_epoch=1)  # quick, unless the machine is busy
    finally:
        await asyncio.gather(*(n.close() for n in nodes))
    reads, cursor, _ = parts[0]
    read = {_chunk_of(plan, s) for s in reads.starts}
    assert held <= read and read == set(range(plan.n))  # the dead node's chunks too, after they lapsed
    assert cursor.epoch >= 1
    said = [r.getMessage() for r in caplog.records if "is over" in r.getMessage()]
    assert said and "epoch 0 is over (every chunk trained: 12 of 12 chunks" in said[0], said


@pytest.mark.timeout(60)
async def test_a_restarted_node_resumes_at_its_position(tmp_path: Path) -> None:
    plan = ChunkPlan.of([SEQ * 1000 + 1] * 4, chunk_tokens=SEQ * 1000 + 1)  # 4 long chunks
    nodes = await _swarm(1)
    try:
        ((first, cursor, _),) = await _run(nodes, plan, seconds=1.0, tmp=tmp_path)
        stopped_at = max(first.starts)
        again = Reads()
        resumed = ChunkCursor(plan, again, seq_len=SEQ, name="tokens:test")
        claimer = ChunkClaimer(nodes[0], "run", resumed, ClaimerConfig(claim_ttl=1.5, position=tmp_path / "node0.json"))
        await claimer.start()
        await asyncio.to_thread(resumed.next_batch, 1, 10)
        await claimer.close()
    finally:
        await asyncio.gather(*(n.close() for n in nodes))
    assert again.starts[0] == stopped_at + SEQ  # the next row after the last one read
    assert resumed.done.tolist() == cursor.done.tolist()


def test_the_cursor_reads_rows_in_order_across_chunks_and_refuses_to_wait_forever() -> None:
    from swarm.data.cursor import DataStall

    plan = ChunkPlan.of([SEQ * 3 + 1, SEQ * 2 + 1])  # 3 and 2 rows
    reads = Reads()
    cursor = ChunkCursor(plan, reads, seq_len=SEQ)
    cursor.offer(0, 1, 0.0)
    cursor.offer(0, 0, 0.0)
    cursor.next_batch(4, timeout=1)
    assert reads.starts == [13, 13 + SEQ, 0, SEQ] and cursor.done.tolist() == [False, True]
    cursor.next_batch(1, timeout=1)
    assert cursor.done.tolist() == [True, True]
    with pytest.raises(DataStall):
        cursor.next_batch(1, timeout=0.05)
    value: Any = cursor.position()
    other = ChunkCursor(ChunkPlan.of([99]), Reads(), seq_len=SEQ)
    assert other.restore(value, 0.0) is False  # another plan's position
