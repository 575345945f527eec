"""Claims held to the swarm's pace (swarm/data/pace.py): a table of records judged by a reader,
then peers in a real DHT on 127.0.0.1 that claim hundreds of chunks with two ids (all done at
once, and two live claims re-dated at every store) while honest claimers train: the liars' done
marks count only at their bounded pace, their held chunks are trained by others, and a record
forged under an honest node's subkey is refused by the DHT."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest

from swarm.data.chunks import ChunkPlan
from swarm.data.claims import ClaimRecord, encode_claim
from swarm.data.pace import MIN_RATE, PACE_SLACK, Limits, Seen, held_to_pace
from swarm.dht.errors import RecordError
from swarm.dht.records import owner_subkey
from swarm.dht.run_keys import chunks_key
from swarm.p2p.identity import Identity
from tests.data.test_claims import _run, _swarm

NOW = 1_000_000.0
PLAN = ChunkPlan.of([1000] * 100, chunk_tokens=1000)  # 100 chunks of 1000 tokens
OWNER = Identity.from_seed(b"\x09" * 32).peer_id


def bits(*chunks: int, upto: int = 0) -> np.ndarray:
    out = np.zeros(PLAN.n, dtype=bool)
    out[list(chunks)] = True
    out[:upto] = True
    return out


@dataclass
class Case:
    name: str
    rate: float  # what the record says
    started: float  # ditto
    done: np.ndarray
    live: tuple[tuple[int, float], ...] = ()
    rates: tuple[float, ...] = (10_000.0, 10_000.0)  # the other records' (ours first)
    first_seen: float = NOW  # when we first read the record in its epoch
    first_claimed: dict[int, float] = field(default_factory=dict)
    counted: int = 0  # done marks that count
    live_kept: tuple[int, ...] = ()


CASES = [
    Case("an honest pace: every mark counts", 10_000.0, NOW - 100, bits(upto=90), counted=90),
    Case("all done at once, just begun: MAX_LIVE chunks", 1e9, NOW, bits(upto=100), counted=2),
    Case("a rate far past the median counts PACE_SLACK times it", 1e9, NOW - 2, bits(upto=100), counted=2 + 80),
    Case("an epoch begun long ago counts from the median start", 1000.0, 1.0, bits(upto=100), counted=2 + 40,
         rates=(1000.0, 1000.0)),
    Case("seen there by us long ago: from then", 10_000.0, 1.0, bits(upto=100), counted=100, first_seen=NOW - 1000),
    Case("no rate said: MIN_RATE's pace", 0.0, NOW - 10, bits(upto=100), counted=2 + 20),  # 2 x MIN_RATE x 10 s
    Case("a fresh claim is held", 10_000.0, NOW - 10, bits(), live=((5, NOW - 1),), live_kept=(5,)),
    Case("a claim past its hold lapses", 10_000.0, NOW - 10, bits(), live=((5, NOW - 31),)),
    Case("a claim re-dated at each store keeps its first date", 10_000.0, NOW - 10, bits(), live=((5, NOW - 1),),
         first_claimed={5: NOW - 100}),
    Case("a slow claimant is held for its slowness", 10.0, NOW - 10, bits(), live=((5, NOW - 300),), live_kept=(5,),
         rates=(10.0, 10.0)),
    Case("slower than a PACE_SLACK**2 part of the median: held as that", 0.0, NOW - 10, bits(), live=((5, NOW - 300),),
         rates=(10_000.0, 10_000.0)),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_held_to_pace(case: Case) -> None:
    record = ClaimRecord(OWNER, 0, case.live, NOW + 30, {0: case.done}, 0, case.rate, case.started)
    others = [ClaimRecord(OWNER, 0, (), NOW + 30, {0: bits()}, 0, r, NOW - 20) for r in case.rates[1:]]
    limits = Limits.of([record, *others], own_rate=case.rates[0], own_epoch=0, own_started=NOW - 20)
    held = held_to_pace(record, limits, PLAN, Seen({0: case.first_seen}, case.first_claimed), 20.0, NOW)
    assert int(held.done[0].sum()) == case.counted
    assert held.done[0].tolist() == (case.done & (np.cumsum(case.done) <= case.counted)).tolist()  # lowest first
    assert tuple(c for c, _ in held.live) == case.live_kept


@pytest.mark.timeout(120)
async def test_liars_with_two_ids_claiming_hundreds_of_chunks_skip_little_and_hold_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("WARNING", logger="swarm.data.claimer")
    seq = 4
    plan = ChunkPlan.of([seq * 250 + 1] * 60, chunk_tokens=seq * 250 + 1)  # 60 chunks of 250 rows
    nodes = await _swarm(5)
    honest, liars = nodes[:3], nodes[3:]
    stop = asyncio.Event()
    all_but_hoarded = np.ones(plan.n, dtype=bool)  # the liars work together: one holds what the other leaves
    all_but_hoarded[[50, 51]] = False

    async def lie() -> None:
        # the liars come once the honest nodes publish: a reader trusts the median of what it
        # reads, which holds while most records are honest (a swarm of liars alone is no swarm)
        await asyncio.sleep(1.5)
        while not stop.is_set():
            now = round(time.time(), 3)
            everything = ClaimRecord(liars[0].peer_id, 0, (), now + 1.5, {0: all_but_hoarded}, 10**9, 1e9, 1.0)
            hoarder = ClaimRecord(liars[1].peer_id, 0, ((50, now), (51, now)), now + 1.5,
                                  {0: np.zeros(plan.n, dtype=bool)}, 0, 0.0, 1.0)  # fmt: skip
            for dht, record in ((liars[0], everything), (liars[1], hoarder)):
                value = encode_claim(record, plan.n, dht.id_nonce)
                assert await dht.store(chunks_key("run"), value, now + 60, subkey=owner_subkey(dht.peer_id))
            await asyncio.sleep(0.3)

    liar_task = asyncio.create_task(lie())
    try:
        started = time.monotonic()
        parts = await _run(honest, plan, seconds=60.0, ttl=1.5, until_epoch=1)
        elapsed = time.monotonic() - started
        # a forged record: the liar signs a record under an honest node's subkey; it is refused
        forged = encode_claim(ClaimRecord(honest[0].peer_id, 0, (), time.time() + 1.5,
                                          {0: np.ones(plan.n, dtype=bool)}), plan.n, honest[0].id_nonce)  # fmt: skip
        with pytest.raises(RecordError, match="can write this record"):
            await liars[0].store(chunks_key("run"), forged, time.time() + 60, subkey=owner_subkey(honest[0].peer_id))
    finally:
        stop.set()
        await liar_task
        await asyncio.gather(*(n.close() for n in nodes))
    assert all(cursor.epoch >= 1 for _, cursor, _ in parts), "the first epoch did not end"
    trained = Counter(c for _, cursor, _ in parts for e, c in cursor.finished if e == 0)
    # the hoarder's chunks were trained by honest nodes once its claims outlasted their hold
    assert {50, 51} <= set(trained)
    # the liar who marked everything done at once skipped at most what its bounded pace allows:
    # PACE_SLACK times the capped rate over the epoch, plus MAX_LIVE chunks
    rates = [cursor.rate() for _, cursor, _ in parts]
    cap = PACE_SLACK * max(MIN_RATE, float(np.median(rates)))
    bound = (PACE_SLACK * cap * (elapsed + 1.0)) / (seq * 250 + 1) + 2
    skipped = plan.n - len(trained)
    assert skipped <= bound, (skipped, bound, rates)
    assert len(trained) >= 10, f"honest nodes trained only {len(trained)} of {plan.n} chunks"  # not ended at once
    said = [r.getMessage() for r in caplog.records if "more than its pace allows" in r.getMessage()]
    assert said and str(liars[0].peer_id) in said[0]
