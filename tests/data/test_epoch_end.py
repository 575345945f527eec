"""At an epoch's end no chunk may be free for a node: every one left is held by a peer. Its claimer
says so to the cursor (`none_free`), and a training thread whose peers wait for it stops waiting
for data when its `give_up` says so: the rows read so far come back as a short batch, or
NoChunkFree. Otherwise the cursor waits as before (a chunk may still come)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from swarm.data.chunks import ChunkPlan
from swarm.data.claimer import ChunkClaimer, ClaimerConfig
from swarm.data.cursor import GIVE_UP_RECHECK, ChunkCursor, DataStall, NoChunkFree
from tests.data.test_claims import SEQ, Reads, _swarm

ROWS = 3  # rows of SEQ tokens in each chunk

# (no chunk free, the caller gives up, rows of a chunk left before the wait) -> what next_batch(2) does
CASES = [
    (False, True, 0, DataStall),  # a chunk may still be claimed: wait for it, whatever the caller says
    (True, False, 0, DataStall),  # none free, but nobody waits for us: wait (a holder finishes its chunk)
    (True, True, 0, NoChunkFree),  # none free and our peers wait: stop at once
    (True, True, 1, 1),  # ... with a row read already: a batch of that one row, no row lost
    (False, False, 1, DataStall),
]


@pytest.mark.parametrize(("none_free", "give_up", "left", "outcome"), CASES)
def test_a_cursor_with_no_chunk_free_gives_up_only_when_asked_and_keeps_its_rows(
    none_free: bool, give_up: bool, left: int, outcome: type[Exception] | int
) -> None:
    reads = Reads()
    cursor = ChunkCursor(ChunkPlan.of([SEQ * ROWS + 1] * 2, chunk_tokens=SEQ * ROWS + 1), reads, seq_len=SEQ)
    cursor.offer(0, 0, 0.0)
    cursor.next_batch(ROWS - left, timeout=1)
    cursor.set_none_free(none_free)
    began = time.monotonic()
    if isinstance(outcome, int):
        inputs, _ = cursor.next_batch(2, timeout=5, give_up=lambda: give_up)
        assert len(inputs) == outcome and reads.starts[-1] == (ROWS - 1) * SEQ
    else:
        with pytest.raises(outcome):
            cursor.next_batch(2, timeout=0.3, give_up=lambda: give_up)
    assert cursor.done.tolist() == [True, False]
    assert time.monotonic() - began < (1.0 if outcome is not DataStall else 3.0)


def test_a_waiting_cursor_gives_up_soon_after_the_caller_does() -> None:
    """The caller's answer changes while the cursor waits (its peers finish their inner steps)."""
    cursor = ChunkCursor(ChunkPlan.of([SEQ * ROWS + 1]), Reads(), seq_len=SEQ)
    cursor.set_none_free(True)
    asked = threading.Event()
    threading.Timer(0.2, asked.set).start()
    began = time.monotonic()
    with pytest.raises(NoChunkFree):
        cursor.next_batch(2, timeout=30, give_up=asked.is_set)
    assert time.monotonic() - began < 0.2 + 2 * GIVE_UP_RECHECK


@pytest.mark.timeout(60)
async def test_the_claimer_tells_the_cursor_while_peers_hold_every_chunk_left() -> None:
    plan = ChunkPlan.of([SEQ * ROWS + 1] * 2, chunk_tokens=SEQ * ROWS + 1)  # 2 chunks: a peer holds both
    nodes = await _swarm(2)
    try:
        cursors = [ChunkCursor(plan, Reads(), seq_len=SEQ, name="tokens:test") for _ in nodes]
        config = ClaimerConfig(claim_ttl=10.0)
        holder, waiter = (ChunkClaimer(dht, "run", c, config) for dht, c in zip(nodes, cursors, strict=True))
        await holder.cycle()
        assert len(cursors[0].held()) == 2 and not cursors[0].none_free
        await waiter.cycle()
        assert not cursors[1].held() and cursors[1].none_free
        await holder.close()  # its claims released: both chunks are free again
        await waiter.cycle()
        assert cursors[1].held() and not cursors[1].none_free
        await asyncio.to_thread(cursors[1].next_batch, 1, 5)
    finally:
        await asyncio.gather(*(n.close() for n in nodes))
