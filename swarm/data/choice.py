"""Which chunk a node trains next, and who wins a chunk two nodes claimed: pure functions over
a snapshot of the claims read from the DHT (claims.py), tested with a table of cases.

    pick = pick_next(snapshot, n)        # Pick(epoch, chunk): claim chunk (None: nothing free now)
    rivals = contested(snapshot, epoch, chunks)   # of our new claims, those a peer claims too
    settle(snapshot, epoch, chunk, at, before)    # a new claim of ours after its read: TAKE, HOLD or YIELD

Rules, the same on every node:
- A chunk is taken in an epoch when it is known done (our own done set, which holds what we
  read before, or a record's done bitmap of that epoch) or claimed live by a peer (its `until`
  not passed). Records of other epochs claim nothing in ours.
- A free chunk is chosen by scanning forward (cyclically) from the chunk after the one we
  trained last, or, at an epoch's start and after we yielded a chunk, from a point hashed from
  our PeerID, the epoch and the yields so far: nodes start far apart and each trains a run of
  neighbours, so two rarely reach for the same chunk.
- The epoch is over when every chunk is known done: we continue in the next one, where peers'
  claims of that epoch count. While the last chunks are being trained by peers, nothing is
  free and we wait (at most a chunk's training time, or CLAIM_TTL when their claimant died and
  its claims lapse): a node that moved on instead would leave a dead claimant's chunks
  untrained in that epoch. Nor does a node start epoch e + 1 while a live peer (its claims not
  lapsed) is still in epoch e - 1: a record carries the done chunks of two epochs, and that
  peer needs ours of e - 1.
- A chunk we gave up (our claim outlasted the hold our pace gives it, pace.py) is not ours to
  pick while our readers may still count that claim: a peer takes it, or we do again later.
- Two nodes that claim one chunk at once (each stored its claim before it read the other's): a
  node stores a new claim and reads the claims again (`settle`). No peer claims the chunk and
  none marks it done: it is ours. A peer does (contested): the tie-break (`winner`: the earlier
  claim, equal times the smaller PeerID) names the same node on both sides; the loser yields at
  once, the winner holds the chunk untrained for one more read and takes it only if each rival's
  record, stored again since, no longer claims it. That second read matters because a node cannot
  know whether its rival saw it: a rival that read before our claim was stored kept the chunk
  whatever the tie-break says, and trains it; a second read that returns the rival's old record
  (a replica the new one has not reached) proves nothing, so it yields too.
- A chunk a peer marks done is never taken, at either read: a rival that read before our claim
  was stored may have trained the chunk and stored its record again before our read, and that
  record marks the chunk done instead of claiming it.
- A claim that was confirmed is kept while it is renewed: a later claim on it (a node that had
  not yet seen ours, or an attacker) is the one that yields.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from swarm.data.claims import ClaimRecord
from swarm.p2p.peer_id import PeerID


@dataclass(frozen=True, slots=True)
class ClaimsSeen:
    me: PeerID
    epoch: int  # the epoch we train
    done: np.ndarray  # bool[n]: chunks of `epoch` we know are done
    held: tuple[tuple[int, float], ...]  # our live claims (chunk, claimed at) in `epoch`
    records: tuple[ClaimRecord, ...]  # peers' decoded records (ours left out)
    now: float
    after: int | None = None  # the chunk we trained last in `epoch` (None: none yet, or we just yielded)
    salt: int = 0  # chunks we yielded so far: moves our start point
    avoid: frozenset[int] = frozenset()  # chunks of `epoch` we gave up a moment ago: not ours to pick now


@dataclass(frozen=True, slots=True)
class Pick:
    epoch: int
    chunk: int | None  # None: every chunk of this epoch and the next is taken; ask again later
    ended: bool = False  # the epoch before `epoch` is over: every chunk of it is done


def known_done(seen: ClaimsSeen, epoch: int) -> np.ndarray:
    done = seen.done.copy() if epoch == seen.epoch else np.zeros_like(seen.done)
    for record in seen.records:
        bits = record.done_in(epoch)
        if bits is not None:
            done |= bits
    return done


def claimed_by_peers(seen: ClaimsSeen, epoch: int) -> np.ndarray:
    taken = np.zeros_like(seen.done)
    for record in seen.records:
        if record.epoch == epoch:
            for chunk, _ in record.live_at(seen.now):
                taken[chunk] = True
    return taken


def start_point(me: PeerID, epoch: int, n: int, salt: int = 0) -> int:
    seed = epoch.to_bytes(8, "little") + salt.to_bytes(8, "little") + me.to_bytes()
    digest = hashlib.sha256(b"swarm.chunks:" + seed).digest()
    return int.from_bytes(digest[:8], "little") % n


def pick_next(seen: ClaimsSeen, n: int) -> Pick:
    epoch, ended = seen.epoch, False
    done = known_done(seen, epoch)
    if done.all():
        if any(r.epoch < epoch and r.until > seen.now for r in seen.records):
            return Pick(epoch, None)  # a live peer still needs our done chunks of the epoch before
        epoch, ended = epoch + 1, True
        done = known_done(seen, epoch)
    taken = done | claimed_by_peers(seen, epoch)
    if not ended:
        for chunk, _ in seen.held:
            taken[chunk] = True
        taken[list(seen.avoid)] = True
    free = np.flatnonzero(~taken)
    if not len(free):
        return Pick(epoch, None, ended)
    onward = not ended and seen.after is not None  # a run of neighbours, else a salted start
    start = (seen.after + 1) % n if onward else start_point(seen.me, epoch, n, seen.salt)  # type: ignore[operator]
    after = free[free >= start]
    return Pick(epoch, int(after[0] if len(after) else free[0]), ended)


def contested(seen: ClaimsSeen, epoch: int, chunks: frozenset[int]) -> frozenset[int]:
    """Of `chunks` (claims of ours in `epoch` not yet confirmed), those a peer claims live there."""
    rivals = claimed_by_peers(seen, epoch)
    return frozenset(c for c in chunks if rivals[c])


def winner(claims: list[tuple[PeerID, float]]) -> PeerID:
    """Of several live claims on one chunk: the earliest; equal times, the smaller PeerID."""
    return min(claims, key=lambda c: (c[1], c[0].to_bytes()))[0]


def rivals_of(seen: ClaimsSeen, epoch: int, chunk: int) -> dict[PeerID, tuple[float, float]]:
    """The peers that claim `chunk` live in `epoch`: owner -> (claimed at, its record's `until`)."""
    return {r.owner: (at, r.until) for r in seen.records if r.epoch == epoch
            for c, at in r.live_at(seen.now) if c == chunk}  # fmt: skip


TAKE, HOLD, YIELD = "take", "hold", "yield"


def settle(seen: ClaimsSeen, epoch: int, chunk: int, at: float, before: Mapping[PeerID, float] | None) -> str:
    """What becomes of a new claim of ours on `chunk` of `epoch`, dated `at`, after a read that
    began once a store of it was accepted: TAKE it, HOLD it untrained for one more read, or YIELD.
    `before`: None at the claim's first read; at its second, the rivals of the first, each with
    the `until` of the record in which it claimed the chunk (module docstring)."""
    if known_done(seen, epoch)[chunk]:
        return YIELD
    rivals = rivals_of(seen, epoch, chunk)
    if before is None:
        if not rivals:
            return TAKE
        claims = [(seen.me, at), *((owner, their_at) for owner, (their_at, _) in rivals.items())]
        return HOLD if winner(claims) == seen.me else YIELD
    if rivals:
        return YIELD
    # a rival gave the chunk up only if we read a record it stored after the one that claimed it
    latest = {r.owner: r.until for r in seen.records}
    return TAKE if all(latest.get(owner, -math.inf) > until for owner, until in before.items()) else YIELD
