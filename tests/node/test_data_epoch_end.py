"""A node with no data chunk free at an epoch's end, while peers of its outer step wait for it: its
training thread ends the step's inner steps with what it trained (InnerSteps.end_step), so the
group forms, instead of waiting for a chunk that a waiting peer holds and trains only in its next
step (a stall of about two claim lifetimes per holder, before this). With a peer still training,
it waits for the data as before: the holder finishes the chunk, and the next epoch begins."""

from __future__ import annotations

import asyncio
import time
from typing import cast

import pytest
import torch
from torch import nn

from swarm.data.chunks import ChunkPlan
from swarm.data.cursor import GIVE_UP_RECHECK, ChunkCursor
from swarm.model.data import TokenData
from swarm.model.diloco import DiLoCo, DiLoCoConfig
from swarm.node.inner_steps import InnerSteps
from swarm.node.loop import peers_wait_for_us
from swarm.node.plan import Facts
from swarm.node.training_thread import DataTrainingThread
from swarm.p2p.identity import Identity
from tests.data.test_claims import SEQ, Reads
from tests.node.test_plan import H, facts, peer

WAIT_CASES = [
    ("nobody else", facts(), False),
    ("a peer of our step still training", facts(peer(5, 4)), False),
    ("a peer of our step done with its inner steps", facts(peer(5, 4, i=0), peer(5, H, i=1)), True),
    ("a client of our step done: it waits too", facts(peer(5, H, client=True)), True),
    ("a done peer whose record is stale (dead)", facts(peer(5, H, age=30.0)), False),
    ("a peer done with the step before ours", facts(peer(4, H)), False),
    ("a peer done with a later step", facts(peer(6, H)), False),
]


@pytest.mark.parametrize(("what", "f", "waits"), WAIT_CASES, ids=[c[0] for c in WAIT_CASES])
def test_peers_wait_for_us(what: str, f: Facts, waits: bool) -> None:
    assert peers_wait_for_us(f) is waits, what


def _loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(inputs).pow(2).mean() + 1.0


@pytest.mark.timeout(30)
async def test_a_node_with_no_chunk_free_ends_its_inner_steps_once_its_peers_wait() -> None:
    rows = 3  # a chunk: 3 rows, so a batch of 2 rows ends across two chunks
    plan = ChunkPlan.of([SEQ * rows + 1] * 2, chunk_tokens=SEQ * rows + 1)
    cursor = ChunkCursor(plan, Reads(), seq_len=SEQ)
    cursor.offer(0, 0, 0.0)  # ours; chunk 1 is a peer's, which it trains in its next step
    cursor.set_none_free(True)  # as our claimer says: nothing else is free
    torch.manual_seed(0)
    diloco = DiLoCo(nn.Embedding(8, 1), DiLoCoConfig(inner_steps=4), loss_fn=_loss,
                    inner_optimizer=lambda p: torch.optim.SGD(p, lr=0.1))  # fmt: skip
    steps = InnerSteps(diloco)
    data = cast(TokenData, None)  # the chunks' rows come from the cursor
    thread = DataTrainingThread(steps, data, Identity.generate().peer_id, batch_size=2, seq_len=SEQ, cursor=cursor)
    thread.start()
    try:
        steps.start_step(4)
        training = asyncio.ensure_future(steps.train(4))
        await asyncio.sleep(2 * GIVE_UP_RECHECK)  # the cursor asks the thread twice meanwhile
        assert not training.done() and diloco.inner_done == 1  # rows 0-1; row 2 waits for a next chunk
        steps.waited_on = True  # the loop read a peer of our step done with its inner steps
        began = time.monotonic()
        await asyncio.wait_for(training, 5)
        assert time.monotonic() - began < 2.0
        # row 2 was trained, as a batch of one: no row of our chunk is lost
        assert diloco.inner_done == 2 and diloco.tokens_since_outer == 3 * SEQ and cursor.done.tolist() == [True, False]
        # the next outer step: no peer waits for us yet, and the data comes (the holder's chunk,
        # its claim given back): the thread trains on
        steps.start_step(4)
        training = asyncio.ensure_future(steps.train(diloco.inner_done + 1))
        await asyncio.sleep(0)
        assert not steps.waited_on
        cursor.offer(0, 1, 0.0)
        cursor.set_none_free(False)
        await asyncio.wait_for(training, 5)
        assert diloco.inner_done == 3
    finally:
        steps.close()
        cursor.close()
        await asyncio.to_thread(thread.join, 10)
