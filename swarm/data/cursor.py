"""ChunkCursor: a node's position in the data, shared by its training thread and its claimer.

    cursor = ChunkCursor(plan, train_tokens, seq_len=256)
    inputs, targets = cursor.next_batch(batch_size=8, timeout=120)   # the training thread
    cursor.offer(epoch, chunk, at)                                   # the claimer: a chunk won

The training thread reads its chunk's rows in order (row r: tokens start + r*seq_len ..
start + (r+1)*seq_len, seq_len + 1 of them); a batch that empties a chunk goes on in the next
one the claimer offered. A chunk is done when its last row is handed out; the cursor then asks
the claimer (`on_need`) for another. The position (epoch, done chunks, the chunk under way and
the tokens read of it) is a small JSON value (`position`/`restore`) that the claimer keeps in
the checkpoint folder, so a restarted node continues where it stopped.

At an epoch's end a node may find no chunk free: every one left is held by a peer. Its
claimer says so (`none_free`), and a training thread whose peers wait for it (they are done with
their outer step's inner steps, and one of them may hold the chunk it waits for until their round
has formed) stops waiting when `give_up` says so: `next_batch` returns the rows read so far, or
raises NoChunkFree, and the node ends its step's inner steps with what it trained.

Rows are read only under a live claim: the claimer tells the cursor when its last stored claims
lapse (`renewed`), and a training thread that finds them lapsed (an event loop that stalled
longer than a claim's lifetime) waits for the claimer to renew or drop them, so it never trains
a chunk a peer may have claimed meanwhile. Times are the cursor's `clock` (unix seconds; tests
inject one), which the claimer shares.
"""

from __future__ import annotations

import base64
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from swarm.data.chunks import ChunkPlan, pack_done, unpack_done
from swarm.data.claims import MAX_RATE

logger = logging.getLogger(__name__)
POSITION_FORMAT = "swarm-data-position/1"
MAX_HELD = 16  # dated claims a saved position may hold (a node holds MAX_LIVE)
MAX_FINISHED = 1 << 16  # the chunks this process finished, newest last (tests and logs read them)
# seconds between looks at `give_up` while no chunk is free: the caller's answer changes without a
# word to the cursor (its peers' records), and only at an epoch's end does a thread wait like this
GIVE_UP_RECHECK = 0.5


class Windows(Protocol):
    def windows(self, starts: torch.Tensor, length: int) -> torch.Tensor: ...

    def prefetch(self, shard: int) -> None: ...  # a chunk in this shard was won: fetch it if it is remote


class DataStall(RuntimeError):
    """No chunk reached the training thread in time (the claimer failed or the DHT is stuck)."""


class NoChunkFree(RuntimeError):
    """No chunk is free for us (every one of the epoch is done or held by a live peer) and the
    caller gave up waiting for one."""


class CursorClosed(RuntimeError):
    """The node is closing: no more batches."""


class ChunkCursor:
    """The position in the data (one lock; the training thread reads, the claimer offers)."""

    def __init__(self, plan: ChunkPlan, train: Windows, *, seq_len: int, name: str = "",
                 clock: Callable[[], float] = time.time) -> None:  # fmt: skip
        if seq_len <= 0:
            raise ValueError("seq_len must be positive")
        self.plan, self.train, self.seq_len, self.name, self.clock = plan, train, seq_len, name, clock
        self._cond = threading.Condition()
        self.epoch = 0
        self.done = np.zeros(plan.n, dtype=bool)  # our own trained chunks of `epoch`
        self.seen = np.zeros(plan.n, dtype=bool)  # peers' done chunks of `epoch` we read
        self.previous: np.ndarray | None = None  # our done chunks of the epoch before
        self.current: tuple[int, int, float] | None = None  # (chunk, next row, claimed at)
        self.queue: list[tuple[int, float]] = []  # chunks won, not started
        self.last: int | None = None  # the chunk we finished last in `epoch`
        self.tokens = 0  # tokens we read in `epoch`
        self.started = clock()  # when we began `epoch`, at its first row (our word on it in our claim record)
        self._last_row = self.started  # when we read our last row (the end of our pace's measure)
        self._rate_before = 0.0  # our pace in the epoch before, until this one's is measured
        self.until: float | None = None  # when our stored claims lapse (None: no claimer has stored any)
        self.finished: deque[tuple[int, int]] = deque(maxlen=MAX_FINISHED)  # (epoch, chunk), as done here
        self.on_need: Callable[[], None] = lambda: None
        self.none_free = False  # the claimer's last pick found no chunk free for us (its writer)
        self._closed = False

    def next_batch(self, batch_size: int, timeout: float,
                   give_up: Callable[[], bool] = lambda: False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(inputs, targets), int64 [batch_size, seq_len]; DataStall after `timeout` seconds
        without a chunk to read, CursorClosed once closed. While no chunk is free for us
        (`none_free`), `give_up()` is asked every GIVE_UP_RECHECK seconds: when it says so, the
        rows read so far come back (fewer than batch_size), or NoChunkFree when there are none."""
        starts, deadline = [], time.monotonic() + timeout
        with self._cond:
            while len(starts) < batch_size:
                if self._closed:
                    raise CursorClosed("the node is closing")
                if self.current is None and not self._start_next():
                    if self.none_free and give_up():
                        if starts:
                            break
                        raise NoChunkFree("no data chunk is free: the epoch's last ones are held by peers")
                    self._wait_for_data(deadline, timeout, GIVE_UP_RECHECK if self.none_free else math.inf)
                    continue
                if not self._live():
                    self._wait_for_data(deadline, timeout, math.inf)
                    continue
                starts.append(self._take_row())
        windows = self.train.windows(torch.tensor(starts, dtype=torch.int64), self.seq_len + 1)
        return windows[:, :-1], windows[:, 1:]

    def _wait_for_data(self, deadline: float, timeout: float, at_most: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DataStall(f"no data chunk to train on within {timeout:.0f}s")
        self._cond.wait(min(left, at_most))

    def set_none_free(self, none_free: bool) -> None:
        """The claimer's last pick: True when it found no chunk free for us (every one of our
        epoch done or held by a live peer), False once it claims one again."""
        with self._cond:
            if none_free != self.none_free:
                self.none_free = none_free
                self._cond.notify_all()

    def _live_now(self) -> bool:
        return self.until is None or self.clock() < self.until

    def _live(self) -> bool:
        if self._live_now():
            return True
        self.on_need()  # our claims lapsed: the claimer renews them (or drops what a peer took)
        return False

    def _start_next(self) -> bool:
        while self.queue:
            chunk, at = self.queue.pop(0)
            if not self.done[chunk] and self.plan.rows(chunk, self.seq_len) > 0:
                self.current = (chunk, 0, at)
                return True
            self._finish(chunk)  # too short for one row: done without a read
        self.on_need()
        return False

    def _take_row(self) -> int:
        assert self.current is not None
        chunk, row, at = self.current
        self._last_row = self.clock()
        if self.tokens == 0:  # the epoch's first row: our pace is measured from here
            self.started = self._last_row
        self.tokens += self.seq_len
        self.current = (chunk, row + 1, at)
        if row + 1 >= self.plan.rows(chunk, self.seq_len):
            self._finish(chunk)
        return self.plan.starts[chunk] + row * self.seq_len

    def _finish(self, chunk: int) -> None:
        self.done[chunk], self.last = True, chunk
        self.finished.append((self.epoch, chunk))
        # a line a chunk (every few seconds at most, at 4 Mi tokens): a run's logs say who trained what
        logger.info("data: chunk %d of epoch %d done", chunk, self.epoch)
        if self.current is not None and self.current[0] == chunk:
            self.current = None
        self.on_need()

    # --- the claimer's side -------------------------------------------------------------------

    def rate(self) -> float:
        """Tokens/s we trained at in `epoch`: its tokens over the seconds from its first row to our
        last (a restart keeps the first and counts its pause; a wait for a chunk at the epoch's end
        does not slow it down). In its first second: the epoch before's (readers hold our marks of
        that epoch to it), 0 if none."""
        with self._cond:
            return self._rate()

    def _rate(self) -> float:
        seconds = self._last_row - self.started
        return self.tokens / seconds if seconds >= 1.0 else self._rate_before

    def renewed(self, until: float) -> None:
        """Our claims were stored again; they lapse at `until`."""
        with self._cond:
            lapsed = not self._live_now()
            self.until = until
            if lapsed:  # only then may a training thread wait on them (a waiting thread that wakes
                self._cond.notify_all()  # asks the claimer for a chunk, which would cycle again at once)

    def held(self) -> tuple[tuple[int, float], ...]:
        """Our live claims (chunk, claimed at): the chunk under way and those queued."""
        with self._cond:
            return self._held()

    def _held(self) -> tuple[tuple[int, float], ...]:
        now = [(self.current[0], self.current[2])] if self.current is not None else []
        return tuple(now + self.queue)

    def wants(self, room: int) -> bool:
        with self._cond:
            return (self.current is not None) + len(self.queue) < room

    def offer(self, epoch: int, chunk: int, at: float) -> None:
        """A chunk we won; in a later epoch only once we hold nothing of ours (claimer's rule)."""
        with self._cond:
            if epoch != self.epoch and not self._advance(epoch):
                return
            self.queue.append((chunk, at))
            self._cond.notify_all()
        # a remote dataset's shard downloads now, while the chunk before it trains
        self.train.prefetch(self.plan.shards[chunk])

    def advance(self, epoch: int) -> bool:
        """Begin `epoch` (every chunk of ours done, none held); False when that is not so."""
        with self._cond:
            return self._advance(epoch)

    def _advance(self, epoch: int) -> bool:
        if self.current is not None or self.queue or epoch <= self.epoch:
            return False
        self._rate_before = self._rate()
        self.previous, self.epoch, self.last, self.tokens = self.done, epoch, None, 0
        self.started = self._last_row = self.clock()
        self.done, self.seen = np.zeros_like(self.done), np.zeros_like(self.seen)
        return True

    def drop(self, chunks: frozenset[int]) -> None:
        """Claims a peer won: never start them (the one under way stops at its next row)."""
        with self._cond:
            self.queue = [(c, a) for c, a in self.queue if c not in chunks]
            if self.current is not None and self.current[0] in chunks:
                self.current = None

    def merge_seen(self, epoch: int, done: np.ndarray) -> None:
        with self._cond:
            if epoch == self.epoch:
                self.seen |= done

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # --- persistence ----------------------------------------------------------------------------

    def position(self) -> dict[str, Any]:
        with self._cond:
            current = [self.current[0], self.current[1] * self.seq_len] if self.current is not None else None
            return {"format": POSITION_FORMAT, "data": self.name, "n": self.plan.n, "epoch": self.epoch,
                    "current": current, "queue": [c for c, _ in self.queue], "tokens": self.tokens,
                    "last": self.last, "started": self.started, "rate_before": self._rate_before,
                    "claimed": [list(c) for c in self._held()],
                    "done": _b64(self.done), "seen": _b64(self.seen),
                    "previous": None if self.previous is None else _b64(self.previous)}  # fmt: skip

    def restore(self, value: Any, now: float) -> bool:
        """Continue from a saved position, its claims with their saved dates (`now` for one not
        dated) and not live until the claimer stores them again; False when it is not ours."""
        if not isinstance(value, dict) or value.get("format") != POSITION_FORMAT:
            return False
        if value.get("data") != self.name or value.get("n") != self.plan.n:
            return False
        done, seen = _unb64(value.get("done"), self.plan.n), _unb64(value.get("seen"), self.plan.n)
        epoch, current, queue = value.get("epoch"), value.get("current"), value.get("queue")
        if done is None or seen is None or not isinstance(epoch, int) or not isinstance(queue, list):
            return False
        chunks = [c for c in queue if isinstance(c, int) and 0 <= c < self.plan.n]
        dated = _dates(value.get("claimed"), now)
        with self._cond:
            self.epoch, self.done, self.seen = epoch, done, seen
            self.previous = _unb64(value.get("previous"), self.plan.n)
            self.tokens = value.get("tokens") if isinstance(value.get("tokens"), int) else 0
            started = value.get("started")
            if isinstance(started, int | float) and 0 < started <= now:
                self.started = float(started)
            self._last_row = now
            before = value.get("rate_before")
            if isinstance(before, int | float) and 0 <= before <= MAX_RATE:
                self._rate_before = float(before)
            self.until = -math.inf  # the saved claims count again once the claimer has checked them
            last = value.get("last")
            self.last = last if isinstance(last, int) and 0 <= last < self.plan.n else None
            self.current = None
            if isinstance(current, list) and len(current) == 2 and all(isinstance(x, int) for x in current):
                chunk, offset = current
                if (
                    0 <= chunk < self.plan.n
                    and 0 <= offset // self.seq_len < self.plan.rows(chunk, self.seq_len)
                    and not done[chunk]
                ):
                    self.current = (chunk, offset // self.seq_len, dated.get(chunk, now))
            self.queue = [(c, dated.get(c, now)) for c in chunks if not done[c]]
            self._cond.notify_all()
            held = ([self.current[0]] if self.current is not None else []) + [c for c, _ in self.queue]
        for chunk in held:
            self.train.prefetch(self.plan.shards[chunk])
        return True


def _dates(raw: Any, now: float) -> dict[int, float]:
    """The saved dates of our claims (chunk -> claimed at); a malformed or future one is left out."""
    if not isinstance(raw, list):
        return {}
    items = [x for x in raw[:MAX_HELD] if isinstance(x, list) and len(x) == 2]
    return {c: float(at) for c, at in items
            if isinstance(c, int) and isinstance(at, int | float) and 0 < at <= now}  # fmt: skip


def _b64(bits: np.ndarray) -> str:
    return base64.b64encode(pack_done(bits)).decode()


def _unb64(text: Any, n: int) -> np.ndarray | None:
    if not isinstance(text, str) or len(text) > n + 256:
        return None
    try:
        return unpack_done(base64.b64decode(text, validate=True), n)
    except ValueError:
        return None


def cursor_for(train: object, *, seq_len: int, name: str) -> ChunkCursor | None:
    """The cursor over a prepared folder's train shards (model.data.ShardedTokens), whose chunks
    the node claims; None for other data (the built-in corpus keeps its random windows)."""
    from swarm.model.data import ShardedTokens  # torch and the corpus code: only for a node

    if not isinstance(train, ShardedTokens):
        return None
    return ChunkCursor(ChunkPlan.of(train.lengths), train, seq_len=seq_len, name=name)
