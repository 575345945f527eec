"""Two nodes that reach for one chunk at once, in a real DHT on 127.0.0.1, on an injected clock.
The interleaving that loses races under load is made exact: a node's store waits (its event loop
lost the CPU) while its rival reads, claims, trains and stores. Neither node may train a chunk
the other trained in the same epoch."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from swarm.data.chunks import ChunkPlan
from swarm.data.claimer import CONFIRM_AFTER, ChunkClaimer, ClaimerConfig
from swarm.data.claims import ClaimRecord, encode_claim
from swarm.data.cursor import ChunkCursor, DataStall
from swarm.dht import DHTNode, store_retry
from swarm.dht.records import owner_subkey
from swarm.dht.run_keys import chunks_key
from tests.data.test_claims import SEQ, Reads
from tests.data.test_pace import Clock
from tests.dht.conftest import LOCAL
from tests.dht.refusing import refusing_dht

ROWS = 3  # rows of SEQ tokens in each chunk


class PausedStores(DHTNode):
    """A real DHT node whose stores wait, once paused, until the test releases them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate: asyncio.Event | None = None
        self.waiting = asyncio.Event()

    def pause(self) -> None:
        self.gate, self.waiting = asyncio.Event(), asyncio.Event()

    def release(self) -> None:
        assert self.gate is not None
        self.gate.set()

    async def store(self, *args: Any, **kwargs: Any) -> int:
        if self.gate is not None and not self.gate.is_set():
            self.waiting.set()
            await asyncio.wait_for(self.gate.wait(), 30)
        return await super().store(*args, **kwargs)


class Node:
    def __init__(self, dht: DHTNode, plan: ChunkPlan, clock: Clock, ttl: float) -> None:
        self.reads = Reads()
        self.cursor = ChunkCursor(plan, self.reads, seq_len=SEQ, name="tokens:test", clock=clock)
        self.claimer = ChunkClaimer(dht, "run", self.cursor, ClaimerConfig(claim_ttl=ttl))

    def train(self, rows: int) -> None:
        """What its training thread reads meanwhile (it never waits: a missing chunk ends it)."""
        for _ in range(rows):
            try:
                self.cursor.next_batch(1, timeout=0)
            except DataStall:
                return

    def trained(self, epoch: int) -> set[int]:
        return {c for e, c in self.cursor.finished if e == epoch}


async def _pair() -> tuple[PausedStores, DHTNode]:
    first = await PausedStores(p2p_config=LOCAL).start()
    try:
        second = await DHTNode(p2p_config=LOCAL, initial_peers=first.visible_maddrs).start()
    except BaseException:
        await first.close()
        raise
    return first, second


async def _paused_cycle(dht: PausedStores, node: Node) -> asyncio.Future[None]:
    """Start a claim cycle of `node` and return once it read the claims and waits to store."""
    dht.pause()
    task = asyncio.ensure_future(node.claimer.cycle())
    waiting = asyncio.ensure_future(dht.waiting.wait())
    await asyncio.wait({task, waiting}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    assert dht.waiting.is_set(), "the cycle ended without a store"
    return task


@pytest.mark.timeout(60)
async def test_a_chunk_the_rival_trained_while_we_claimed_it_is_never_trained_again() -> None:
    """A picks both chunks, then its store waits; B (which read before A stored) claims both,
    confirms them, trains one and stores. A's confirming read finds that one done, not claimed:
    A must not take it. The other one B still claims, later than A: the tie-break names A, which
    holds it for a second read; by then B trained it and moved on to the next epoch: A must not
    take it either."""
    plan = ChunkPlan.of([SEQ * ROWS + 1] * 2, chunk_tokens=SEQ * ROWS + 1)  # 2 chunks of ROWS rows
    clock = Clock(round(time.time(), 3))
    a_dht, b_dht = await _pair()
    a, b = Node(a_dht, plan, clock, 10.0), Node(b_dht, plan, clock, 10.0)
    try:
        a_cycle = await _paused_cycle(a_dht, a)  # A read no claim and picked both chunks
        clock.t += 0.5
        await b.claimer.cycle()  # B reads before A stored: both chunks are B's
        assert {c for c, _ in b.cursor.held()} == {0, 1}
        b.train(ROWS)
        clock.t += 0.1
        await b.claimer.cycle()  # B's record: its first chunk done, the other still claimed
        await _release(a_dht, a_cycle)  # A stores its claims and reads them back
        a.train(2 * ROWS)
        assert not a.trained(0), "A trained a chunk its confirming read showed done by B"
        b.train(ROWS)
        clock.t += 0.1
        await b.claimer.cycle()  # B finished epoch 0 and claims in epoch 1
        clock.t += CONFIRM_AFTER
        await a.claimer.cycle()  # A's second read of the chunk it held on the tie-break
        a.train(2 * ROWS)
    finally:
        await asyncio.gather(a_dht.close(), b_dht.close())
    assert b.trained(0) == {0, 1}
    assert not a.trained(0), f"A trained {sorted(a.trained(0))}, which B trained in the same epoch"
    assert a.claimer.yields == 2


@pytest.mark.timeout(60)
async def test_a_node_whose_claims_lapsed_checks_them_after_it_renews() -> None:
    """A holds the only chunk; its loop stalls past the claim's lifetime. A's cycle reads (no
    rival yet), then its renewal waits; B reads A's lapsed claim, claims the chunk, confirms it.
    A's renewal lands: A must find B's claim before it trains a row of the chunk again."""
    plan = ChunkPlan.of([SEQ * ROWS + 1], chunk_tokens=SEQ * ROWS + 1)  # 1 chunk
    clock = Clock(round(time.time(), 3))
    a_dht, b_dht = await _pair()
    a, b = Node(a_dht, plan, clock, 2.0), Node(b_dht, plan, clock, 2.0)
    try:
        await a.claimer.cycle()
        assert a.cursor.held() and a.cursor.held()[0][0] == 0
        a.train(1)  # one row of it, then the stall
        clock.t += 5.0  # past the claim's lifetime (2 s): A's claim lapsed
        a_cycle = await _paused_cycle(a_dht, a)
        await b.claimer.cycle()
        assert b.cursor.held() and b.cursor.held()[0][0] == 0, "B did not take the lapsed chunk"
        await _release(a_dht, a_cycle)
        rows_before = len(a.reads.starts)
        a.train(ROWS)
        b.train(ROWS)
    finally:
        await asyncio.gather(a_dht.close(), b_dht.close())
    assert len(a.reads.starts) == rows_before, "A trained on in a chunk B claimed while A's claim had lapsed"
    assert b.trained(0) == {0} and not a.trained(0)


@pytest.mark.timeout(60)
async def test_a_claim_that_no_node_stored_is_not_trained(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every replica refuses the store of a new claim: no peer can see it, so a peer may claim
    the chunk too; the node must not train it on the strength of a read that could not show it."""
    monkeypatch.setattr(store_retry, "STORE_BACKOFF", 0.0)
    plan = ChunkPlan.of([SEQ * ROWS + 1] * 2, chunk_tokens=SEQ * ROWS + 1)
    async with refusing_dht(refuse=store_retry.STORE_TRIES) as dht:
        node = Node(dht.client, plan, Clock(round(time.time(), 3)), 10.0)
        await node.claimer.cycle()  # every try of its store refused
        assert node.cursor.held() == (), "a claim stored nowhere reached the cursor"
        await node.claimer.cycle()  # stored this time, and read back
        assert {c for c, _ in node.cursor.held()} == {0, 1}


@pytest.mark.timeout(60)
async def test_a_backdated_claim_takes_no_chunk_under_way() -> None:
    """A peer with a costly id stores claims dated before ours on both chunks we confirmed and
    train: a confirmed claim is kept while it is renewed, so the earlier date wins nothing (its
    claims count, held to its pace, only on chunks nobody holds)."""
    plan = ChunkPlan.of([SEQ * ROWS + 1] * 2, chunk_tokens=SEQ * ROWS + 1)
    clock = Clock(round(time.time(), 3))
    honest_dht, thief = await _pair()
    honest = Node(honest_dht, plan, clock, 10.0)
    try:
        await honest.claimer.cycle()
        assert {c for c, _ in honest.cursor.held()} == {0, 1}
        honest.train(1)
        at = min(at for _, at in honest.cursor.held()) - 5.0
        record = ClaimRecord(thief.peer_id, 0, ((0, at), (1, at)), clock.t + 10.0, {}, 0, 0.0, 0.0)
        value = encode_claim(record, plan.n, thief.id_nonce)
        assert await thief.store(chunks_key("run"), value, clock.t + 60, subkey=owner_subkey(thief.peer_id))
        clock.t += 1.0
        await honest.claimer.cycle()
        # read, and its claims counted live
        assert [(r.owner, {c for c, _ in r.live}) for r in honest.claimer.records] == [(thief.peer_id, {0, 1})]
        honest.train(2 * ROWS)
    finally:
        await asyncio.gather(honest_dht.close(), thief.close())
    assert honest.trained(0) == {0, 1}


async def _release(dht: PausedStores, cycle: asyncio.Future[None]) -> None:
    dht.release()
    await asyncio.wait_for(cycle, 20)
