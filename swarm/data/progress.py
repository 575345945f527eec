"""EpochProgress: how far the swarm has gone through its data, from the run's chunk claim records.

    progress = read_progress(entries, id_bits=6, max_records=1000, now=time.time())   # a reader's view
    progress = node_progress(claimer, now)            # a node's: its peers' records, read last, and its own
    progress.epoch, progress.share, progress.tokens   # the epoch, its share done, the tokens trained in it

`swarm-dht inspect`, the run's dashboard and a node's metrics all show this one value. The
records are untrusted and are held to what the claim reader (claimer.py) holds them to: at most
`max_records` of them are read (the key's subkey limit), a record counts only with its owner's
proof of a costly id, and claims.decode_claim drops a malformed one whole. On top of that:
- the plan is the chunk count most records say (a record of another plan counts for nothing);
- the epoch is the records' upper median: a minority cannot move it, however far ahead it says
  it is (at an epoch's end the swarm shows the old epoch, all done, until half have moved on);
- a record's tokens count at most CHUNK_TOKENS for each chunk it says it trained or holds in
  the epoch: a record cannot claim a billion tokens for two chunks.
What no reader can check is a record's done marks themselves: a costly identity that says it
trained every chunk moves the share as far as the claim reader lets it move the epoch.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from swarm.data.chunks import CHUNK_TOKENS
from swarm.data.claims import ClaimRecord, decode_claim

if TYPE_CHECKING:
    from swarm.data.claimer import ChunkClaimer


@dataclass(frozen=True, slots=True)
class EpochProgress:
    epoch: int  # the epoch the swarm trains (epochs count from 0)
    chunks_done: int  # of that epoch, known done
    chunks: int  # in the plan (one epoch)
    tokens: int  # trained in that epoch, as the records say (each capped)
    nodes: int  # records counted
    claiming: int  # of them, with live claims

    @property
    def share(self) -> float:
        """The share of the epoch done, 0..1."""
        return self.chunks_done / self.chunks if self.chunks else 0.0

    def wire(self) -> dict[str, int | float]:
        """As JSON (an event's fields, the dashboard's, inspect's --json)."""
        return {"epoch": self.epoch, "chunks_done": self.chunks_done, "chunks": self.chunks,
                "share": self.share, "tokens": self.tokens, "nodes": self.nodes,
                "claiming": self.claiming}  # fmt: skip


def read_progress(entries: Sequence[tuple[Any, Any]], *, id_bits: int, max_records: int,
                  now: float) -> EpochProgress | None:  # fmt: skip
    """The progress from a read of `<run>/chunks` ((subkey, value) entries as stored); None when
    no record counts."""
    entries = entries[:max_records]
    plans = Counter(v["n"] for _, v in entries if isinstance(v, dict) and _positive_int(v.get("n")))
    if not plans:
        return None
    n = max(plans, key=lambda k: (plans[k], k))  # the plan most records say (a tie: the larger)
    records = [decode_claim(subkey, value, n=n, id_bits=id_bits, now=now) for subkey, value in entries]
    return progress_of([r for r in records if r is not None], n, now)


def progress_of(records: Iterable[ClaimRecord], n: int, now: float) -> EpochProgress | None:
    """The progress from decoded records of one plan of `n` chunks (pure); None without records."""
    records = list(records)
    if not records:
        return None
    epochs = sorted(r.epoch for r in records)
    epoch = epochs[len(epochs) // 2]
    done = np.zeros(n, dtype=bool)
    for record in records:  # a record of the next epoch still carries its done chunks of this one
        bits = record.done_in(epoch)
        if bits is not None and len(bits) == n:
            done |= bits
    tokens = sum(credited_tokens(r, now) for r in records if r.epoch == epoch)
    claiming = sum(1 for r in records if r.live_at(now))
    return EpochProgress(epoch, int(done.sum()), n, tokens, len(records), claiming)


def credited_tokens(record: ClaimRecord, now: float) -> int:
    """A record's tokens of its epoch, at most a whole chunk for each chunk it trained or holds."""
    bits = record.done_in(record.epoch)
    chunks = (int(bits.sum()) if bits is not None else 0) + len(record.live_at(now))
    return min(record.tokens, chunks * CHUNK_TOKENS)


def node_progress(claimer: ChunkClaimer, now: float | None = None) -> EpochProgress:
    """A node's view: the peers' records its claimer read last, and its own position (its cursor)."""
    now = time.time() if now is None else now
    cursor = claimer.cursor
    held = cursor.held()  # under the cursor's lock; the rest are read as they are (a display's figures)
    done = {cursor.epoch: cursor.done.copy()}
    if cursor.previous is not None:
        done[cursor.epoch - 1] = cursor.previous.copy()
    own = ClaimRecord(claimer.dht.peer_id, cursor.epoch, held, math.inf, done, cursor.tokens)
    progress = progress_of([*claimer.records, own], cursor.plan.n, now)
    assert progress is not None  # our own record is there
    return progress


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0
