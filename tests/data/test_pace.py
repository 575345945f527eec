"""Claims held to the swarm's pace (swarm/data/pace.py): tables of records judged by a reader and
of our own claims given up, then nodes in a real DHT on 127.0.0.1 stepped on an injected clock
(each tick: the clock moves DT, every honest node runs one claim cycle and trains RATE tokens/s
for DT), so that a loaded machine slows the test down but changes none of its decisions:

- liars with two ids (all chunks done at once; two live claims re-dated at every store) skip at
  most what their bounded pace allows and hold nothing for good; a forged record is refused;
- an honest node whose training stalls for longer than its claims' hold gives its chunk up and a
  peer trains it, and one whose whole process stalls for several claim lifetimes trains nothing
  until its claims are checked again: every chunk is trained exactly once, and no honest node's
  done marks are ever distrusted."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest

from swarm.data.chunks import ChunkPlan
from swarm.data.claimer import ChunkClaimer, ClaimerConfig
from swarm.data.claims import ClaimRecord, encode_claim
from swarm.data.cursor import ChunkCursor, DataStall
from swarm.data.pace import MIN_RATE, PACE_SLACK, Limits, Seen, held_to_pace, hold_rate, overdue
from swarm.dht import DHTNode
from swarm.dht.errors import RecordError
from swarm.dht.records import owner_subkey
from swarm.dht.run_keys import chunks_key
from swarm.p2p.identity import Identity
from tests.data.test_claims import SEQ, Reads, _swarm

NOW = 1_000_000.0
PLAN = ChunkPlan.of([1000] * 100, chunk_tokens=1000)  # 100 chunks of 1000 tokens
OWNER = Identity.from_seed(b"\x09" * 32).peer_id
TTL = 20.0  # the table's claim lifetime: a claim of 1000 tokens at 10k tokens/s holds 0.4 + 3 x 20 s


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
    left_before: float | None = None  # when we last read it in the epoch before (None: never)
    others_started: float = NOW - 20  # the other records' (and our) epoch starts
    counted: int = 0  # done marks that count
    live_kept: tuple[int, ...] = ()


CASES = [
    Case("an honest pace: every mark counts", 10_000.0, NOW - 100, bits(upto=90), counted=90),
    Case("all done at once, just begun: MAX_LIVE chunks", 1e9, NOW, bits(upto=100), counted=2),
    Case("a rate far past the median counts PACE_SLACK times it", 1e9, NOW - 2, bits(upto=100), counted=2 + 80),
    Case("as fast as we are, though the median is slow: every mark", 8000.0, NOW - 5, bits(upto=40), counted=40,
         rates=(5000.0, 500.0, 500.0)),
    Case("an epoch begun long ago counts from the median start", 1000.0, 1.0, bits(upto=100), counted=2 + 40,
         rates=(1000.0, 1000.0)),
    Case("seen there by us long ago: from then", 10_000.0, 1.0, bits(upto=100), counted=100, first_seen=NOW - 1000),
    Case("no rate said: MIN_RATE's pace", 0.0, NOW - 10, bits(upto=100), counted=2 + 20),  # 2 x MIN_RATE x 10 s
    Case("moved to this epoch after our last read of it: all since then, though most began it later", 1000.0,
         NOW - 20, bits(upto=40), rates=(1000.0, 1000.0, 1000.0), left_before=NOW - 21, others_started=NOW - 0.1,
         counted=40),
    Case("... and not seen before in it: from the median start", 1000.0, NOW - 20, bits(upto=40),
         rates=(1000.0, 1000.0, 1000.0), others_started=NOW - 0.1, counted=2),
    Case("a liar's start long ago counts from our last read of it in the epoch before", 1000.0, 1.0, bits(upto=40),
         left_before=NOW - 5, counted=2 + 10),
    Case("a fresh claim is held", 10_000.0, NOW - 10, bits(), live=((5, NOW - 1),), live_kept=(5,)),
    Case("a claim held through a stall of nearly 3 claim lifetimes", 10_000.0, NOW - 10, bits(),
         live=((5, NOW - 60),), live_kept=(5,)),
    Case("a claim past its hold lapses", 10_000.0, NOW - 10, bits(), live=((5, NOW - 61),)),
    Case("a claim re-dated at each store keeps its first date", 10_000.0, NOW - 10, bits(), live=((5, NOW - 1),),
         first_claimed={5: NOW - 100}),
    Case("a slow claimant is held for its slowness", 10.0, NOW - 10, bits(), live=((5, NOW - 300),), live_kept=(5,),
         rates=(10.0, 10.0)),
    Case("slower than a PACE_SLACK**2 part of the median: held as that", 0.0, NOW - 10, bits(), live=((5, NOW - 300),)),
    Case("nodes not training yet do not slow the median down", 0.0, NOW - 10, bits(), live=((5, NOW - 100),),
         rates=(10_000.0, 0.0, 0.0, 0.0)),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_held_to_pace(case: Case) -> None:
    record = ClaimRecord(OWNER, 0, case.live, NOW + 30, {0: case.done}, 0, case.rate, case.started)
    others = [ClaimRecord(OWNER, 0, (), NOW + 30, {0: bits()}, 0, r, case.others_started) for r in case.rates[1:]]
    limits = Limits.of([record, *others], own_rate=case.rates[0], own_epoch=0, own_started=case.others_started)
    left = {} if case.left_before is None else {0: case.left_before}
    held = held_to_pace(record, limits, PLAN, Seen({0: case.first_seen}, case.first_claimed, left), TTL, NOW)
    assert int(held.done[0].sum()) == case.counted
    assert held.done[0].tolist() == (case.done & (np.cumsum(case.done) <= case.counted)).tolist()  # lowest first
    assert tuple(c for c, _ in held.live) == case.live_kept


OVERDUE = [
    # (our claims (chunk, at), our rate, the median, given up): hold 0.4 + 60 s at 10k tokens/s
    ("fresh claims are kept", ((1, NOW - 1), (2, NOW)), 10_000.0, 10_000.0, set()),
    ("a claim lifetime before its readers let it go: given up", ((1, NOW - 41), (2, NOW - 1)), 10_000.0, 10_000.0,
     {1}),
    ("a slow node's hold is long", ((1, NOW - 41),), 100.0, 100.0, set()),
    ("slower than the median allows: held as that", ((1, NOW - 42),), 100.0, 10_000.0, {1}),
]  # fmt: skip


@pytest.mark.parametrize("case", OVERDUE, ids=[c[0] for c in OVERDUE])
def test_our_own_claims_are_given_up_before_our_readers_count_them_free(case: tuple) -> None:
    _, held, rate, median, late = case
    limits = Limits.of([], own_rate=median, own_epoch=0, own_started=NOW - 100)
    assert overdue(held, hold_rate(rate, limits), PLAN, TTL, NOW) == late
    judged = held_to_pace(ClaimRecord(OWNER, 0, held, NOW + 2 * TTL, {}, 0, rate, NOW - 100), limits, PLAN,
                          Seen({}, {}), TTL, NOW + TTL)  # fmt: skip
    assert {c for c, _ in held} - {c for c, _ in judged.live} <= late  # what a reader lets go, we gave up


# --- nodes in a real DHT, stepped on an injected clock ----------------------------------------------

DT = 0.5  # seconds of the injected clock per tick
RATE = 800  # tokens/s each honest node trains (SEQ-token rows)
CLAIM_TTL = 1.5


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class Honest:
    reads: Reads
    cursor: ChunkCursor
    claimer: ChunkClaimer
    stalled: range = range(0)  # ticks whose claim cycles and training it misses (its whole process)
    idle: range = range(0)  # ticks whose training it misses (its claims are still renewed)
    rows_before: int = 0  # the rows it had read when its stall began


def _honest(dhts: list[DHTNode], plan: ChunkPlan, clock: Clock) -> list[Honest]:
    parts = []
    for dht in dhts:
        reads = Reads()
        cursor = ChunkCursor(plan, reads, seq_len=SEQ, name="tokens:test", clock=clock)
        parts.append(Honest(reads, cursor, ChunkClaimer(dht, "run", cursor, ClaimerConfig(claim_ttl=CLAIM_TTL))))
    return parts


def _train(cursor: ChunkCursor, rows: int) -> None:
    for _ in range(rows):
        try:
            cursor.next_batch(1, timeout=0)
        except DataStall:  # no chunk under a live claim: the thread would wait for the claimer
            return


async def _tick(clock: Clock, parts: list[Honest], tick: int) -> None:
    clock.t += DT
    for part in parts:
        if tick in (part.stalled.start, part.idle.start):
            part.rows_before = len(part.reads.starts)
        if tick in part.stalled:
            continue
        # the training thread runs first: after a stall it may wake before the claimer does
        if tick not in part.idle:
            _train(part.cursor, int(RATE * DT) // SEQ)
        await part.claimer.cycle()


async def _step_until_epoch_1(clock: Clock, parts: list[Honest], ticks: int) -> int:
    for tick in range(ticks):
        await _tick(clock, parts, tick)
        if all(p.cursor.epoch >= 1 for p in parts):
            return tick
    raise AssertionError(f"the first epoch did not end in {ticks} ticks: {[p.cursor.done.sum() for p in parts]}")


def _trained_once(parts: list[Honest]) -> Counter[int]:
    trained = Counter(c for p in parts for e, c in p.cursor.finished if e == 0)
    twice = {c: n for c, n in trained.items() if n > 1}
    assert not twice, f"chunks of epoch 0 trained by several honest nodes: {twice}"
    return trained


def _distrusted(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "more than its pace allows" in r.getMessage()]


@pytest.mark.timeout(120)
async def test_liars_with_two_ids_claiming_hundreds_of_chunks_skip_little_and_hold_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="swarm.data.claimer")
    plan = ChunkPlan.of([SEQ * 250 + 1] * 60, chunk_tokens=SEQ * 250 + 1)  # 60 chunks of 250 rows
    nodes = await _swarm(5)
    clock = Clock(round(time.time(), 3))
    honest, liars = _honest(nodes[:3], plan, clock), nodes[3:]
    all_but_hoarded = np.ones(plan.n, dtype=bool)  # the liars work together: one holds what the other leaves
    all_but_hoarded[[50, 51]] = False
    begun = clock.t
    try:
        for tick in range(200):
            if tick >= 3:  # once the honest nodes publish: a reader trusts the median of what it reads
                now = round(clock.t, 3)
                everything = ClaimRecord(
                    liars[0].peer_id, 0, (), now + CLAIM_TTL, {0: all_but_hoarded}, 10**9, 1e9, 1.0
                )
                hoarder = ClaimRecord(liars[1].peer_id, 0, ((50, now), (51, now)), now + CLAIM_TTL,
                                      {0: np.zeros(plan.n, dtype=bool)}, 0, 0.0, 1.0)  # fmt: skip
                for dht, record in ((liars[0], everything), (liars[1], hoarder)):
                    value = encode_claim(record, plan.n, dht.id_nonce)
                    assert await dht.store(chunks_key("run"), value, now + 60, subkey=owner_subkey(dht.peer_id))
            await _tick(clock, honest, tick)
            if all(p.cursor.epoch >= 1 for p in honest):
                break
        elapsed = clock.t - begun
        # a forged record: the liar signs a record under an honest node's subkey; it is refused
        forged = encode_claim(ClaimRecord(nodes[0].peer_id, 0, (), clock.t + CLAIM_TTL,
                                          {0: np.ones(plan.n, dtype=bool)}), plan.n, nodes[0].id_nonce)  # fmt: skip
        with pytest.raises(RecordError, match="can write this record"):
            await liars[0].store(chunks_key("run"), forged, clock.t + 60, subkey=owner_subkey(nodes[0].peer_id))
    finally:
        for part in honest:
            await part.claimer.close()
        await asyncio.gather(*(n.close() for n in nodes))
    assert all(p.cursor.epoch >= 1 for p in honest), f"the first epoch did not end in {elapsed:.0f} s"
    trained = _trained_once(honest)
    assert {50, 51} <= set(trained)  # the hoarder's chunks, once its claims outlasted their hold
    # the liar who marked everything done at once skipped at most what its bounded pace allows:
    # PACE_SLACK times the capped rate over the epoch, plus MAX_LIVE chunks
    cap = PACE_SLACK * max(MIN_RATE, RATE)
    bound = PACE_SLACK * cap * elapsed / (SEQ * 250 + 1) + 2
    assert plan.n - len(trained) <= bound, (plan.n - len(trained), bound)
    assert len(trained) >= 10, f"honest nodes trained only {len(trained)} of {plan.n} chunks"  # not ended at once
    said = _distrusted(caplog)
    assert said and all(str(liars[0].peer_id) in s for s in said), said  # the liar, never an honest node


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stall", ["training", "process"])
async def test_an_honest_node_that_stalls_loses_no_chunk_and_trains_none_twice(
    stall: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`training`: node 0's training thread stalls for 13 ticks while its claimer renews, until
    just past its claims' hold (4 chunks' time at its pace plus 3 claim lifetimes, 7.8 s from
    the claims' date): it gives its chunks up a claim lifetime before the others take them and
    train them (kept, it would finish one of them as a peer does). `process`: its claimer
    stalls too, 20 ticks (nearly 7 claim lifetimes): its claims lapse, the others take its
    chunks, and on waking it drops them before its training thread reads a row of them."""
    caplog.set_level(logging.INFO, logger="swarm.data.claimer")
    plan = ChunkPlan.of([SEQ * 250 + 1] * 12, chunk_tokens=SEQ * 250 + 1)  # 12 chunks of 250 rows
    nodes = await _swarm(3)
    clock = Clock(round(time.time(), 3))
    parts = _honest(nodes, plan, clock)
    if stall == "training":
        parts[0].idle = range(4, 17)
    else:
        parts[0].stalled = range(4, 24)
    try:
        await _step_until_epoch_1(clock, parts, 200)
    finally:
        for part in parts:
            await part.claimer.close()
        await asyncio.gather(*(n.close() for n in nodes))
    trained = _trained_once(parts)
    assert set(trained) == set(range(plan.n))  # every chunk once
    assert not _distrusted(caplog)  # no honest node's done marks were counted short
    mine = {c for e, c in parts[0].cursor.finished if e == 0}
    taken = {c for p in parts[1:] for e, c in p.cursor.finished if e == 0}
    read = _chunks_read(parts[0], plan)
    held_at_stall = set(read) - mine
    assert held_at_stall and held_at_stall <= taken  # what it had begun, a peer trained whole
    # and after its stall it read no row of a chunk a peer read: no chunk is trained in part twice
    assert not set(read[parts[0].rows_before :]) & {c for p in parts[1:] for c in _chunks_read(p, plan)}
    gave_up = [r.getMessage() for r in caplog.records if "giving up chunk" in r.getMessage()]
    assert bool(gave_up) == (stall == "training"), gave_up


def _chunks_read(part: Honest, plan: ChunkPlan) -> list[int]:
    return [int(np.searchsorted(np.array(plan.ends), s, side="right")) for s in part.reads.starts]


def test_the_pace_a_node_publishes_survives_its_epochs_end_and_its_restart() -> None:
    plan = ChunkPlan.of([SEQ * 400 + 1] * 2, chunk_tokens=SEQ * 400 + 1)  # 2 chunks of 400 rows
    clock = Clock(NOW)
    cursor = ChunkCursor(plan, Reads(), seq_len=SEQ, name="tokens:test", clock=clock)
    cursor.offer(0, 0, NOW)
    cursor.offer(0, 1, NOW)
    for _ in range(800):  # 800 tokens/s from the first row, then a wait for the epoch's end
        cursor.next_batch(1, timeout=0)
        clock.t += SEQ / 800
    clock.t += 100.0
    assert cursor.rate() == pytest.approx(800, rel=0.01)  # the wait does not slow it down
    assert cursor.advance(1)
    assert cursor.rate() == pytest.approx(800, rel=0.01)  # the new epoch: the last one's, until measured
    cursor.offer(1, 0, clock.t)
    cursor.next_batch(1, timeout=0)
    saved = cursor.position()
    clock.t += 50.0  # a restart: the pause counts, the dates are kept
    again = ChunkCursor(plan, Reads(), seq_len=SEQ, name="tokens:test", clock=clock)
    assert again.restore(saved, clock.t)
    assert again.started == cursor.started and again.held() == cursor.held()
    assert again.rate() == pytest.approx(SEQ / 50.0)
    with pytest.raises(DataStall):  # its claims count again only once its claimer has stored them
        again.next_batch(1, timeout=0)
    again.renewed(clock.t + CLAIM_TTL)
    again.next_batch(1, timeout=0)
