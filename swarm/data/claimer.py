"""ChunkClaimer: a node's claims on data chunks in the DHT, renewed while it trains them.

    claimer = ChunkClaimer(dht, "run", cursor, ClaimerConfig(position=Path("ckpt/data-position.json")))
    await claimer.start()        # restores the saved position, then claims in the background
    ...
    await claimer.close()        # releases our live claims and saves the position

One cycle (every `renew` seconds, or at once when the cursor needs a chunk): read the run's
claim records, pick chunks until we hold MAX_LIVE (choice.pick_next), store our record (one DHT
store, claims.py), and read again: a new claim reaches the cursor only if, in that second read,
no peer claims its chunk or marks it done (choice.settle); a contested one is yielded, or, when
the tie-break names us, held one more read (CONFIRM_AFTER seconds later) and taken if the
rival's newer record gave it up. A race is settled before the chunk is trained. Only a read
that began after a store of the claim was accepted settles it: a claim whose store no node
accepted, or whose read failed or did not return our own record as stored, is given up (a
peer that read without it may have claimed the chunk). Claims restored from a saved position,
and ours that lapsed before we renewed them (a stalled loop), are checked the same way, by the
read after the store that renews them; the cursor reads no row of them until then.
The peers' records count as far as their pace allows (pace.py); we hold ourselves to the same
rule: a chunk of ours whose claim nears the end of its hold (training stalled that long) is given
up before any reader counts it free, and not picked again until they have read us without it.
Times are the cursor's clock (tests inject one).
The position goes to the checkpoint folder after every cycle. A failed
read picks from the records read last; a failed store is logged and tried at the next cycle
(CONFIRM_AFTER later when it held new claims); the cursor counts our claims live only until
the last store that was accepted says they lapse.
When the epoch ends for us the node says so in one log line and continues in the next one.
While no chunk is free for us (every one of the epoch done or held by a live peer) the cursor
knows it (`none_free`): a training thread whose peers wait for it ends its outer step's inner
steps rather than wait for a chunk that one of them may hold (cursor.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from swarm.data.choice import HOLD, TAKE, ClaimsSeen, Pick, contested, known_done, pick_next, rivals_of, settle
from swarm.data.claims import CLAIM_TTL, MAX_LIVE, RECORD_TTL, ClaimRecord, decode_claim, encode_claim
from swarm.data.cursor import ChunkCursor
from swarm.data.pace import Limits, Seen, held_to_pace, hold_rate, overdue
from swarm.dht.node import DHTNode
from swarm.dht.records import owner_subkey
from swarm.dht.run_keys import chunks_key
from swarm.dht.run_records import record_entries
from swarm.dht.store_retry import store_or_warn
from swarm.p2p.peer_id import PeerID
from swarm.utils.atomic import write_atomic
from swarm.utils.supervised import Supervised

logger = logging.getLogger(__name__)
MAX_POSITION_BYTES = 1 << 20
POSITION_FILE = "data-position.json"  # in the node's --checkpoint-dir
CONFIRM_AFTER = 1.0  # seconds before a contested claim that the tie-break gave us is read again
WAITING_POLL = 2.0  # seconds between reads while we wait for peers to train the epoch's last chunks


@dataclass(frozen=True, kw_only=True, slots=True)
class ClaimerConfig:
    # a live claim lapses this long after its last renewal; a node whose training stalls gives its
    # chunk up about two lifetimes after it claimed it (pace.overdue), so a stall holds peers that long
    claim_ttl: float = CLAIM_TTL
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
        self.records: tuple[ClaimRecord, ...] = ()  # peers' records, as read last and held to their pace
        self.limits = Limits.of((), own_rate=0.0, own_epoch=cursor.epoch, own_started=cursor.started)
        self.over_pace: set[tuple[PeerID, int]] = set()  # (peer, epoch) whose done marks ran ahead of its pace
        self.given_up: dict[tuple[int, int], float] = {}  # (epoch, chunk) of ours past its hold -> when
        self._first_claimed: dict[tuple[PeerID, int, int], float] = {}  # (peer, epoch, chunk): first claim date seen
        self._first_seen: dict[tuple[PeerID, int], float] = {}  # (peer, epoch): when we first read its marks there
        self._last_read: dict[PeerID, tuple[int, float]] = {}  # peer -> (its epoch, when) at our last read of it
        self._left_before: dict[tuple[PeerID, int], float] = {}  # (peer, epoch): last read in an earlier one
        self._waiting = False  # at the last cycle: nothing free, peers train this epoch's last chunks
        self.clock = cursor.clock
        self.stores = 0  # DHT stores of our record so far (one per cycle)
        self.yields = 0  # new claims we gave up because a peer claimed the same chunk
        self._yielded = False  # at the last cycle: the next pick starts from a salted point
        self._unconfirmed: frozenset[int] = frozenset()  # restored or lapsed claims: checked after the next store
        self._tentative: list[tuple[int, int, float]] = []  # contested claims the tie-break gave us
        self._against: dict[tuple[int, int], dict[PeerID, float]] = {}  # (epoch, chunk) tentative -> rivals' untils
        self._unsure = False  # at the last cycle: claims went unsettled (a failed store or read)
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
            # a contested claim is read again soon, and so are the claims while peers train the
            # epoch's last chunks: their done marks free us for the next epoch
            soon = self._tentative or self._unsure
            wait = CONFIRM_AFTER if soon else WAITING_POLL if self._waiting else self.config.renew
            wait = min(wait, self.config.renew)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    async def cycle(self) -> None:
        read = await self._read()
        if self.clock() >= self._lapses_at:  # renewed too late (a stalled loop, a sleeping laptop):
            # our claims lapsed meanwhile and a peer may have taken a chunk; it keeps it
            self._unconfirmed = frozenset(chunk for chunk, _ in self.cursor.held())
        self._drop_done_by_peers()
        self._give_up_overdue()
        # a tentative claim is read again only CONFIRM_AFTER after it was made: its rivals need
        # that long to store their records without it (a cursor asking sooner wakes us sooner)
        now = self.clock()
        due = [claim for claim in self._tentative if claim[2] + CONFIRM_AFTER <= now]
        self._tentative = [claim for claim in self._tentative if claim[2] + CONFIRM_AFTER > now]
        self._settle(due, read=read, second=True)
        pending = self._pick()
        until = await self._store(extra=pending)
        checked = False
        if pending or self._unconfirmed:
            # a peer that read before this store may hold any of these chunks: only a read that
            # begins after it, and returns it, can tell
            checked = until is not None and await self._read(own_until=until)
            if checked and self._unconfirmed:
                self.cursor.drop(contested(self._seen(), self.cursor.epoch, self._unconfirmed))
                self._unconfirmed = frozenset()
                self._drop_done_by_peers()
            self._settle(pending, read=checked, second=False)
        self._unsure = (bool(pending or self._unconfirmed) and not checked) or (bool(due) and not read)
        if until is not None and not self._unconfirmed:
            self._lapses_at = until
            self.cursor.renewed(until)
        await self._save()

    def _drop_done_by_peers(self) -> None:
        """A chunk of ours that a peer's record marks done (it took the chunk while our claim had
        lapsed, or once our readers stopped counting it) is never trained by us as well."""
        seen = self._seen()
        theirs = known_done(dataclasses.replace(seen, done=np.zeros_like(seen.done)), seen.epoch)
        taken = frozenset(chunk for chunk, _ in self.cursor.held() if theirs[chunk])
        if taken:
            self.cursor.drop(taken)
            logger.info("data: chunks %s of epoch %d, ours, were trained by a peer: dropped", sorted(taken), seen.epoch)

    def _give_up_overdue(self) -> None:
        """Drop our chunks whose claims near the end of their hold (pace.overdue): our training
        stalled that long, and a reader will soon count the chunk free and claim it."""
        c, now = self.cursor, self.clock()
        late = overdue(c.held(), hold_rate(c.rate(), self.limits), c.plan, self.config.claim_ttl, now)
        if not late:
            return
        c.drop(late)
        for chunk in sorted(late):
            self.given_up[(c.epoch, chunk)] = now
            logger.warning("data: giving up chunk %d of epoch %d: its claim outlasted the time our pace allows "
                           "(training stalled); a peer trains it", chunk, c.epoch)  # fmt: skip

    def _settle(self, claims: list[tuple[int, int, float]], *, read: bool, second: bool) -> None:
        """Our new claims after a read (`read`: it worked, after a store of them): taken ones go
        to the cursor, held ones wait for one more read (choice.settle); the rest are yielded,
        and those the read could not settle given up."""
        if not claims:
            return
        seen, gone = self._seen(extra=claims), 0
        for epoch, chunk, at in claims:
            before = self._against.pop((epoch, chunk), {}) if second else None
            verdict = settle(seen, epoch, chunk, at, before) if read else None
            if verdict == TAKE:
                self.cursor.offer(epoch, chunk, at)
            elif verdict == HOLD:
                self._tentative.append((epoch, chunk, at))
                rivals = rivals_of(seen, epoch, chunk)
                self._against[(epoch, chunk)] = {owner: until for owner, (_, until) in rivals.items()}
            elif verdict is not None:
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
        now = self.clock()
        # a chunk we gave up stays free for peers until each has read our record without it
        avoid = frozenset(chunk for (e, chunk), at in self.given_up.items()
                          if e == c.epoch and now < at + self.config.claim_ttl)  # fmt: skip
        return ClaimsSeen(self.dht.peer_id, c.epoch, c.done | c.seen, held, self.records, now, after, self.yields,
                          avoid)  # fmt: skip

    def _pick(self) -> list[tuple[int, int, float]]:
        """New claims (epoch, chunk, at) until the cursor would hold MAX_LIVE chunks."""
        pending: list[tuple[int, int, float]] = []
        self._waiting = False
        while self.cursor.wants(MAX_LIVE - len(pending) - len(self._tentative)):
            pick = pick_next(self._seen(pending), self.cursor.plan.n)
            busy = pending or self._tentative or self.cursor.held()
            if pick.epoch != self.cursor.epoch and busy:
                break  # a new epoch begins once we hold nothing of this one
            if pick.chunk is None:  # nothing free; an epoch all done by peers is begun without a chunk
                if pick.ended and self.cursor.advance(pick.epoch):
                    self._say_ended(pick)
                self._waiting = not busy
                break
            if pick.ended:
                self._say_ended(pick)
            # the time as the record carries it: both sides of a race must compare the same numbers
            pending.append((pick.epoch, pick.chunk, round(self.clock(), 3)))
            if pick.epoch != self.cursor.epoch:
                break
        # a training thread with nothing to read learns that waiting is all it can do (cursor.py)
        self.cursor.set_none_free(self._waiting)
        return pending

    def _say_ended(self, pick: Pick) -> None:
        p = self.progress()
        logger.info("data: epoch %d is over (every chunk trained: %d of %d chunks, %d tokens); starting epoch %d",
                    pick.epoch - 1, p.chunks_done, p.chunks, p.tokens, pick.epoch)  # fmt: skip

    async def _read(self, own_until: float | None = None) -> bool:
        """Read the peers' records (kept as read last when the read fails). True when it worked
        and, with `own_until`, returned our own record as stored with that `until` or later."""
        entries = await record_entries(self.dht, self.key, "the run's chunk claims")
        if not entries:
            return False
        n, bits, now, me = self.cursor.plan.n, self.dht.config.id_bits, self.clock(), self.dht.peer_id
        records = [r for r in (decode_claim(subkey, value, n=n, id_bits=bits, now=now) for subkey, value in entries)
                   if r is not None]  # fmt: skip
        self.records = self._held_to_pace([r for r in records if r.owner != me], now)
        for record in self.records:
            bits_ = record.done_in(self.cursor.epoch)
            if bits_ is not None:
                self.cursor.merge_seen(self.cursor.epoch, bits_)
        return own_until is None or any(r.owner == me and r.until >= own_until for r in records)

    def _held_to_pace(self, records: list[ClaimRecord], now: float) -> tuple[ClaimRecord, ...]:
        """The peers' records as far as their pace allows (pace.py); a peer whose done marks run
        ahead of it is logged once per epoch."""
        c = self.cursor
        self.limits = limits = Limits.of(records, own_rate=c.rate(), own_epoch=c.epoch, own_started=c.started)
        claimed = {(r.owner, r.epoch, chunk): at for r in records for chunk, at in r.live_at(now)}
        # a claimant that re-dates its claim keeps the first date we saw; memory of claims still read only
        self._first_claimed = {key: min(at, self._first_claimed.get(key, at)) for key, at in claimed.items()}
        present = {(r.owner, e) for r in records for e in r.done}
        self._first_seen = {key: self._first_seen.get(key, now) for key in present}
        for r in records:  # a peer that moved to a later epoch since our last read began it after that read
            epoch, at = self._last_read.get(r.owner, (r.epoch, now))
            if epoch < r.epoch:
                self._left_before[(r.owner, r.epoch)] = at
            self._last_read[r.owner] = (r.epoch, now)
        owners = {r.owner for r in records}
        self._left_before = {k: at for k, at in self._left_before.items() if k[0] in owners}
        self._last_read = {o: v for o, v in self._last_read.items() if o in owners}
        judged = []
        for record in records:
            first_seen = {e: t for (o, e), t in self._first_seen.items() if o == record.owner}
            mine = {ch: at for (o, e, ch), at in self._first_claimed.items() if (o, e) == (record.owner, record.epoch)}
            left = {e: t for (o, e), t in self._left_before.items() if o == record.owner}
            held = held_to_pace(record, limits, c.plan, Seen(first_seen, mine, left), self.config.claim_ttl, now)
            for epoch, bits in record.done.items():
                if int(held.done[epoch].sum()) < int(bits.sum()) and (record.owner, epoch) not in self.over_pace:
                    self.over_pace.add((record.owner, epoch))
                    logger.warning("data: peer %s marks %d chunks done in epoch %d, more than its pace allows: "
                                   "the rest are trained again", record.owner, int(bits.sum()), epoch)  # fmt: skip
            judged.append(held)
        return tuple(judged)

    async def _store(self, *, extra: Sequence[tuple[int, int, float]] = (), release: bool = False) -> float | None:
        """Store our record; the `until` it says (as stored) when a node accepted it, else None."""
        c, now = self.cursor, self.clock()
        claims = [*self._tentative, *extra]
        live = () if release else c.held() + tuple((chunk, at) for epoch, chunk, at in claims if epoch == c.epoch)
        epoch = c.epoch
        if not release and claims and claims[0][0] != c.epoch:  # the first claim of a new epoch
            epoch, live = claims[0][0], ((claims[0][1], claims[0][2]),)
        done = {epoch: c.done} if epoch == c.epoch else {epoch: np.zeros_like(c.done), c.epoch: c.done}
        if epoch == c.epoch and c.previous is not None:
            done[epoch - 1] = c.previous
        started = c.started if epoch == c.epoch else now
        record = ClaimRecord(self.dht.peer_id, epoch, tuple(live), now + self.config.claim_ttl, done, c.tokens,
                             c.rate(), started)  # fmt: skip
        value = encode_claim(record, c.plan.n, self.dht.id_nonce)
        self.stores += 1
        accepted = await store_or_warn(self.dht, self.key, value, now + RECORD_TTL, owner_subkey(self.dht.peer_id),
                                       kind="chunk claims", within=self.config.renew)  # fmt: skip
        return float(value["until"]) if accepted else None

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
        if self.cursor.restore(value, round(self.clock(), 3)):
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
