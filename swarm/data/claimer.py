"""ChunkClaimer: a node's claims on data chunks in the DHT, renewed while it trains them.

    claimer = ChunkClaimer(dht, "run", cursor, ClaimerConfig(position=Path("ckpt/data-position.json")))
    await claimer.start()        # restores the saved position, then claims in the background
    ...
    await claimer.close()        # releases our live claims and saves the position

One cycle (every `renew` seconds, or at once when the cursor needs a chunk): read the run's
claim records, pick chunks until we hold MAX_LIVE (choice.pick_next), store our record (one DHT
store, claims.py), and read again: a new claim reaches the cursor only if no peer claims its
chunk in that second read (choice.contested); a contested one is yielded, or, when the
tie-break names us, held one more read (CONFIRM_AFTER seconds later) and taken if the rival's
claim is gone. A race is settled before the chunk is trained. Claims restored from a saved
position are checked at the first cycle.
The position goes to the checkpoint folder after every cycle. A failed
read decides from the records read last; a failed store is logged and tried at the next cycle.
When the epoch ends for us the node says so in one log line and continues in the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from swarm.data.choice import ClaimsSeen, Pick, contested, known_done, pick_next, rivals_of, winner
from swarm.data.claims import CLAIM_TTL, MAX_LIVE, RECORD_TTL, ClaimRecord, decode_claim, encode_claim
from swarm.data.cursor import ChunkCursor
from swarm.dht.node import DHTNode
from swarm.dht.records import owner_subkey
from swarm.dht.run_keys import chunks_key
from swarm.dht.run_records import record_entries
from swarm.dht.store_retry import store_or_warn
from swarm.utils.atomic import write_atomic
from swarm.utils.supervised import Supervised

logger = logging.getLogger(__name__)
MAX_POSITION_BYTES = 1 << 20
POSITION_FILE = "data-position.json"  # in the node's --checkpoint-dir
CONFIRM_AFTER = 1.0  # seconds before a contested claim that the tie-break gave us is read again


@dataclass(frozen=True, kw_only=True, slots=True)
class ClaimerConfig:
    claim_ttl: float = CLAIM_TTL  # a live claim lapses this long after its last renewal
    position: Path | None = None  # where the position is kept (None: not kept)

    def __post_init__(self) -> None:
        if not 1.0 <= self.claim_ttl <= CLAIM_TTL:
            raise ValueError(f"claim_ttl must be in 1..{CLAIM_TTL} seconds")

    @property
    def renew(self) -> float:
        return self.claim_ttl / 3


@dataclass(frozen=True, slots=True)
class DataProgress:
    """What the swarm has trained of the data, as far as our records tell."""

    epoch: int
    chunks_done: int  # of this epoch: ours and the peers' we read
    chunks: int
    tokens: int  # of this epoch: ours plus what the peers' records say


class ChunkClaimer:
    def __init__(self, dht: DHTNode, run_id: str, cursor: ChunkCursor, config: ClaimerConfig) -> None:
        self.dht, self.key, self.cursor, self.config = dht, chunks_key(run_id), cursor, config
        self.records: tuple[ClaimRecord, ...] = ()  # peers' records, as read last
        self.stores = 0  # DHT stores of our record so far (one per cycle)
        self.yields = 0  # new claims we gave up because a peer claimed the same chunk
        self._yielded = False  # at the last cycle: the next pick starts from a salted point
        self._unconfirmed: frozenset[int] = frozenset()  # restored claims, checked at the first cycle
        self._tentative: list[tuple[int, int, float]] = []  # contested claims the tie-break gave us
        self._lapses_at = math.inf  # when the live claims of our last stored record lapse
        self._save_lock = threading.Lock()
        self._wake = asyncio.Event()
        self._task: Supervised | None = None

    async def start(self) -> None:
        await self._restore()
        loop = asyncio.get_running_loop()
        self.cursor.on_need = lambda: loop.call_soon_threadsafe(self._wake.set)
        self._task = Supervised("chunk claims", self._forever).start()

    async def close(self) -> None:
        """Stop claiming, release our live claims (a final store without them), save the position."""
        if self._task is not None and (error := await self._task.close()) is not None:
            logger.warning("claiming data chunks had failed %d time(s), last: %r", self._task.failures, error)
        self.cursor.on_need = lambda: None
        await self._store(release=True)
        await self._save()

    async def _forever(self) -> None:
        while True:
            self._wake.clear()
            await self.cycle()
            wait = min(CONFIRM_AFTER, self.config.renew) if self._tentative else self.config.renew
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    async def cycle(self) -> None:
        await self._read()
        if time.time() >= self._lapses_at:  # renewed too late (a stalled loop, a sleeping laptop):
            # our claims lapsed meanwhile and a peer may have taken a chunk; it keeps it
            self._unconfirmed = frozenset(chunk for chunk, _ in self.cursor.held())
        if self._unconfirmed:
            self.cursor.drop(contested(self._seen(), self.cursor.epoch, self._unconfirmed))
            self._unconfirmed = frozenset()
        # a tentative claim is read again only CONFIRM_AFTER after it was made: its rivals need
        # that long to store their records without it (a cursor asking sooner wakes us sooner)
        now = time.time()
        due = [claim for claim in self._tentative if claim[2] + CONFIRM_AFTER <= now]
        self._tentative = [claim for claim in self._tentative if claim[2] + CONFIRM_AFTER > now]
        self._settle(due, second=True)
        pending = self._pick()
        await self._store(extra=pending)
        if pending:
            await self._read()
            self._settle(pending, second=False)
        await self._save()

    def _settle(self, claims: list[tuple[int, int, float]], *, second: bool) -> None:
        """Our new claims after a read: uncontested ones go to the cursor; contested ones are
        yielded, or (first read, the tie-break names us) held for one more read."""
        if not claims:
            return
        seen, gone = self._seen(extra=claims), 0
        for epoch, chunk, at in claims:
            rivals = rivals_of(seen, epoch, chunk)
            if not rivals:
                self.cursor.offer(epoch, chunk, at)
            elif not second and winner([(self.dht.peer_id, at), *rivals]) == self.dht.peer_id:
                self._tentative.append((epoch, chunk, at))
            else:
                gone += 1
        self.yields += gone
        self._yielded = gone > 0
        if gone:  # pick again soon, elsewhere: the cursor may be waiting
            self._wake.set()

    def progress(self) -> DataProgress:
        seen = self._seen()
        done = known_done(seen, seen.epoch)
        tokens = self.cursor.tokens + sum(r.tokens for r in self.records if r.epoch == seen.epoch)
        return DataProgress(seen.epoch, int(done.sum()), self.cursor.plan.n, tokens)

    def _seen(self, extra: Sequence[tuple[int, int, float]] = ()) -> ClaimsSeen:
        c = self.cursor
        held = c.held() + tuple((chunk, at) for epoch, chunk, at in [*self._tentative, *extra] if epoch == c.epoch)
        after = None if self._yielded else c.last
        return ClaimsSeen(self.dht.peer_id, c.epoch, c.done | c.seen, held, self.records, time.time(), after,
                          self.yields)  # fmt: skip

    def _pick(self) -> list[tuple[int, int, float]]:
        """New claims (epoch, chunk, at) until the cursor would hold MAX_LIVE chunks."""
        pending: list[tuple[int, int, float]] = []
        while self.cursor.wants(MAX_LIVE - len(pending) - len(self._tentative)):
            pick = pick_next(self._seen(pending), self.cursor.plan.n)
            busy = pending or self._tentative or self.cursor.held()
            if pick.epoch != self.cursor.epoch and busy:
                break  # a new epoch begins once we hold nothing of this one
            if pick.chunk is None:  # nothing free; an epoch all done by peers is begun without a chunk
                if pick.ended and self.cursor.advance(pick.epoch):
                    self._say_ended(pick)
                break
            if pick.ended:
                self._say_ended(pick)
            # the time as the record carries it: both sides of a race must compare the same numbers
            pending.append((pick.epoch, pick.chunk, round(time.time(), 3)))
            if pick.epoch != self.cursor.epoch:
                break
        return pending

    def _say_ended(self, pick: Pick) -> None:
        p = self.progress()
        logger.info("data: epoch %d is over (every chunk trained: %d of %d chunks, %d tokens); starting epoch %d",
                    pick.epoch - 1, p.chunks_done, p.chunks, p.tokens, pick.epoch)  # fmt: skip

    async def _read(self) -> None:
        entries = await record_entries(self.dht, self.key, "the run's chunk claims")
        if not entries:
            return
        n, bits, now = self.cursor.plan.n, self.dht.config.id_bits, time.time()
        records = [decode_claim(subkey, value, n=n, id_bits=bits, now=now) for subkey, value in entries]
        self.records = tuple(r for r in records if r is not None and r.owner != self.dht.peer_id)
        for record in self.records:
            bits_ = record.done_in(self.cursor.epoch)
            if bits_ is not None:
                self.cursor.merge_seen(self.cursor.epoch, bits_)

    async def _store(self, *, extra: Sequence[tuple[int, int, float]] = (), release: bool = False) -> None:
        c, now = self.cursor, time.time()
        claims = [*self._tentative, *extra]
        live = () if release else c.held() + tuple((chunk, at) for epoch, chunk, at in claims if epoch == c.epoch)
        epoch = c.epoch
        if not release and claims and claims[0][0] != c.epoch:  # the first claim of a new epoch
            epoch, live = claims[0][0], ((claims[0][1], claims[0][2]),)
        done = {epoch: c.done} if epoch == c.epoch else {epoch: np.zeros_like(c.done), c.epoch: c.done}
        if epoch == c.epoch and c.previous is not None:
            done[epoch - 1] = c.previous
        record = ClaimRecord(self.dht.peer_id, epoch, tuple(live), now + self.config.claim_ttl, done, c.tokens)
        value = encode_claim(record, c.plan.n, self.dht.id_nonce)
        self.stores += 1
        self._lapses_at = record.until
        await store_or_warn(self.dht, self.key, value, now + RECORD_TTL, owner_subkey(self.dht.peer_id),
                            kind="chunk claims", within=self.config.renew)  # fmt: skip

    async def _save(self) -> None:
        if self.config.position is not None:
            await asyncio.to_thread(self._write_position, self.config.position, self.cursor.position())

    def _write_position(self, path: Path, value: Any) -> None:
        # one writer at a time: a cycle cancelled by close() leaves its write running in its thread
        with self._save_lock:
            _write_json(path, value)

    async def _restore(self) -> None:
        path = self.config.position
        if path is None:
            return
        value = await asyncio.to_thread(_read_json, path)
        if value is None:
            return
        if self.cursor.restore(value, round(time.time(), 3)):
            self._unconfirmed = frozenset(chunk for chunk, _ in self.cursor.held())
            logger.info("data: resuming at epoch %d, %d chunks of ours done", self.cursor.epoch, self.cursor.done.sum())
        else:
            logger.warning("data: %s holds the position of other data: starting from scratch", path)


async def start_claiming(dht: DHTNode, run_id: str, cursor: ChunkCursor, checkpoint_dir: str | None) -> ChunkClaimer:
    """A node's claimer, started, its position kept in `checkpoint_dir` (None: not kept)."""
    position = Path(checkpoint_dir) / POSITION_FILE if checkpoint_dir else None
    claimer = ChunkClaimer(dht, run_id, cursor, ClaimerConfig(position=position))
    await claimer.start()
    return claimer


def _read_json(path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read(MAX_POSITION_BYTES))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("data: cannot read the position %s (%s): starting from scratch", path, e)
        return None


def _write_json(path: Path, value: Any) -> None:
    write_atomic(path, json.dumps(value).encode())
