"""InnerLoop: a node's inner steps, in one worker thread (DESIGN invariant 6).

    loop = InnerLoop(diloco, data, peer_id, batch_size=8, seq_len=256)
    await loop.train(target)        # inner steps until `target` are done; raises NodeError on divergence
    await loop.call(diloco.pseudo_gradients)   # any other work on the model, in the same thread
    loop.snapshot()                 # what the event loop may read meanwhile (under a lock)

Every touch of the model goes through this one thread, so the event loop never blocks and the
model is never read while an inner step writes it. Batches come from node_generator(PeerID,
global inner step): every node trains on its own windows of the same corpus.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from swarm.model.data import TokenData, node_generator, sample_batch
from swarm.model.diloco import DiLoCo, NonFiniteLossError
from swarm.p2p.peer_id import PeerID

T = TypeVar("T")


class NodeError(RuntimeError):
    """The node cannot start or go on; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class InnerProgress:
    inner_done: int
    target: int  # inner steps this step: H, or fewer for a node that arrived late
    sec_per_step: float  # moving average; 0.0 before the first step
    losses: tuple[float, ...]  # this step's
    inner_s: float  # seconds in inner steps, all steps


@dataclass
class _Shared:
    lock: threading.Lock = field(default_factory=threading.Lock)
    inner_done: int = 0
    target: int = 0
    sec_per_step: float = 0.0
    losses: list[float] = field(default_factory=list)
    inner_s: float = 0.0


class InnerLoop:
    """Owns the worker thread and the progress it reports (see the module docstring)."""

    def __init__(self, diloco: DiLoCo, data: TokenData, peer_id: PeerID, *, batch_size: int, seq_len: int) -> None:
        self.diloco, self.data = diloco, data
        self.peer = peer_id.to_bytes()
        self.batch_size, self.seq_len = batch_size, seq_len
        self._shared = _Shared(target=diloco.config.inner_steps)
        self._stop = threading.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="swarm-train")

    def close(self) -> None:
        """Stop after the inner step under way and wait for the thread."""
        self._stop.set()
        self._executor.shutdown(wait=True)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def train(self, target: int) -> None:
        """Inner steps until `target` are done this step (or the loop is closed)."""
        with self._shared.lock:
            self._shared.target = target
            self._shared.inner_done = self.diloco.inner_done
            if self.diloco.inner_done == 0:
                self._shared.losses = []
        await self.call(self._run, target)

    def start_step(self, target: int) -> None:
        """A new outer step begins with `target` inner steps (0: it trains none)."""
        with self._shared.lock:
            self._shared.target, self._shared.inner_done, self._shared.losses = target, self.diloco.inner_done, []

    def snapshot(self) -> InnerProgress:
        s = self._shared
        with s.lock:
            return InnerProgress(s.inner_done, s.target, s.sec_per_step, tuple(s.losses), s.inner_s)

    def seconds_left(self) -> float:
        """Our own estimate of the time to finish this step's inner steps (inf: no timing yet)."""
        p = self.snapshot()
        return max(0, p.target - p.inner_done) * p.sec_per_step if p.sec_per_step > 0 else float("inf")

    def _run(self, target: int) -> None:
        diloco, shared = self.diloco, self._shared
        while diloco.inner_done < target and not self._stop.is_set():
            generator = node_generator(self.peer, diloco.global_inner_step)
            inputs, targets = sample_batch(self.data.train, self.batch_size, self.seq_len, generator)
            began = time.perf_counter()
            try:
                stats = diloco.inner_step(inputs, targets)
            except NonFiniteLossError as e:
                raise NodeError(f"training diverged ({e}): lower --lr or --outer-lr") from None
            took = time.perf_counter() - began
            with shared.lock:
                shared.inner_done = diloco.inner_done
                shared.losses.append(stats.loss)
                shared.inner_s += took
                shared.sec_per_step = took if shared.sec_per_step == 0 else 0.8 * shared.sec_per_step + 0.2 * took
