"""Chunk claims in the DHT: what each node of a run publishes under `<run>/chunks`.

    {"epoch": the epoch it trains, "live": [[chunk, claimed at (unix)], ...] (at most MAX_LIVE),
     "until": unix time its live claims lapse, "done": [[epoch, zlib bitmap], ...] (its own
     trained chunks of its epoch and the one before), "n": chunks in the plan, "tokens": tokens
     it trained in its epoch, "rate": tokens/s it trains at, "started": unix time it began its
     epoch, "proof": the nonce of its costly DHT id}

in a subkey owned (signed) by the node. One store publishes all of it, so a claim costs one DHT
store. The record lives RECORD_TTL (its done chunks outlast a node that dies), its live claims
CLAIM_TTL: a claimant that stops renewing loses its chunks to others within CLAIM_TTL.

Records are untrusted input (decode_claim): a record counts only with its owner's proof of a
costly id (dht/id_proof.py), so a crowd of free key pairs claims nothing; a record with more
than MAX_LIVE live claims, a lapse further ahead than CLAIM_TTL, a claim dated in the future or
a bitmap of another plan is ignored whole. What a well-formed record claims is then held to its
pace (pace.py): its live claims lapse once it has had time enough to train them, and its done
marks count only as far as the swarm's pace allows since its epoch began.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from swarm.data.chunks import pack_done, unpack_done
from swarm.dht.run_keys import proven_map
from swarm.p2p.peer_id import PeerID

MAX_LIVE = 2  # the chunk a node trains and the one it will train next
CLAIM_TTL = 60.0  # seconds a live claim holds without renewal
RECORD_TTL = 3600.0  # seconds a record (and the done chunks it lists) outlives its last store
MAX_EPOCH = 1 << 32
MAX_CLOCK_SKEW = 30.0  # seconds a claim's dates may lie ahead of the reader's clock
MAX_TOKENS = 1 << 62
MAX_RATE = 1e9  # tokens/s a record may say it trains at (pace.py holds it to the swarm's median)


@dataclass(frozen=True, slots=True)
class ClaimRecord:
    owner: PeerID
    epoch: int
    live: tuple[tuple[int, float], ...]  # (chunk, unix time it was claimed), in this epoch
    until: float  # the live claims lapse then
    done: dict[int, np.ndarray]  # epoch -> its own trained chunks (this epoch and the one before)
    tokens: int = 0  # tokens it trained in this epoch
    rate: float = 0.0  # tokens/s it says it trains at (0: not yet known)
    started: float = 0.0  # unix time it says it began `epoch` (0: not said)

    def live_at(self, now: float) -> tuple[tuple[int, float], ...]:
        return self.live if self.until > now else ()

    def done_in(self, epoch: int) -> np.ndarray | None:
        return self.done.get(epoch)


def encode_claim(record: ClaimRecord, n: int, proof: bytes) -> dict[str, Any]:
    return {"epoch": record.epoch, "live": [[c, round(at, 3)] for c, at in record.live],
            "until": round(record.until, 3), "n": n,
            "done": [[e, pack_done(bits)] for e, bits in sorted(record.done.items())],
            "tokens": record.tokens, "rate": round(record.rate, 1), "started": round(record.started, 3),
            "proof": proof}  # fmt: skip


def decode_claim(subkey: Any, value: Any, *, n: int, id_bits: int, now: float) -> ClaimRecord | None:
    """A peer's claims, or None when malformed, of another plan or unproven (never raises)."""
    owned = proven_map(subkey, value, id_bits)
    if owned is None:
        return None
    owner, value = owned
    epoch, until, tokens = value.get("epoch"), value.get("until"), value.get("tokens", 0)
    if value.get("n") != n or not _int_in(epoch, 0, MAX_EPOCH) or not _int_in(tokens, 0, MAX_TOKENS):
        return None
    if not _number(until) or until > now + CLAIM_TTL + MAX_CLOCK_SKEW:
        return None
    rate, started = value.get("rate", 0.0), value.get("started", 0.0)
    if (
        not _number(rate)
        or not 0 <= rate <= MAX_RATE
        or not _number(started)
        or not 0 <= started <= now + MAX_CLOCK_SKEW
    ):
        return None
    live = _live(value.get("live"), n, now)
    done = _done(value.get("done"), epoch, n)
    if live is None or done is None:
        return None
    return ClaimRecord(owner, epoch, live, float(until), done, tokens, float(rate), float(started))


def _live(raw: Any, n: int, now: float) -> tuple[tuple[int, float], ...] | None:
    if not isinstance(raw, list | tuple) or len(raw) > MAX_LIVE:
        return None
    live = []
    for item in raw:
        if not isinstance(item, list | tuple) or len(item) != 2:
            return None
        chunk, at = item
        if not _int_in(chunk, 0, n - 1) or not _number(at) or at > now + MAX_CLOCK_SKEW or at < 0:
            return None
        live.append((chunk, float(at)))
    if len({c for c, _ in live}) != len(live):
        return None
    return tuple(live)


def _done(raw: Any, epoch: int, n: int) -> dict[int, np.ndarray] | None:
    if not isinstance(raw, list | tuple) or len(raw) > 2:
        return None
    done: dict[int, np.ndarray] = {}
    for item in raw:
        if not isinstance(item, list | tuple) or len(item) != 2 or item[0] not in (epoch, epoch - 1):
            return None
        bits = unpack_done(item[1], n)
        if bits is None or item[0] in done:
            return None
        done[item[0]] = bits
    return done


def _int_in(x: Any, low: int, high: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and low <= x <= high


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
