"""InnerSteps: the permits between a node and the thread that runs its inner steps (swarm.join or DataTrainingThread).

The node (on its event loop) hands out permits; the caller's thread spends them:

    steps = InnerSteps(diloco)
    # node side (its event loop):  await steps.train(target); await steps.call(fn)
    # caller's thread, after its own forward and backward:
    steps.step(tokens, loss=loss)          # clip, optimizer step, count; spends one permit
    steps.wait_for_permit()                # False once the node is done
    steps.end_step()                       # instead of step: no data now while peers wait (waited_on)

Why permits: the node writes the model's parameters (the outer step, a fetched state) and the
caller's loop reads and writes them (forward, backward, the optimizer). They must never overlap.
The caller holds a permit from the moment `wait_for_permit` returns until its `step`, which covers
its forward and backward; the node touches the parameters only while no permit is out: `call`
runs the node's work on the model once the caller is back in `wait_for_permit` (or not stepping
at all), and holds it there until the work is done. An overlapped node (DiLoCo.begin_overlap)
lands a round that way between two inner steps. θ_outer, which the node reads at any time
(hashing, serving), is written only by the node.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from swarm.model.diloco import DiLoCo, InnerStats

logger = logging.getLogger(__name__)

HOLD_LOG_S = 60.0  # a hold waiting this long for the caller's inner step says so (and goes on waiting)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class InnerProgress:
    """What the node reads of the inner steps (its records, its pace, its events)."""

    inner_done: int
    target: int  # inner steps this step: H, or fewer for a node that arrived late
    sec_per_step: float  # moving average; 0.0 before the first step
    losses: tuple[float, ...]  # this step's
    inner_s: float  # seconds in inner steps, all steps


class SessionClosed(RuntimeError):
    """The swarm session has ended: no inner step may run."""


class InnerSteps:
    """Owns the permits, the progress the node reads (InnerProgress) and one worker thread for
    the node's own work on the model (`call`)."""

    def __init__(self, diloco: DiLoCo) -> None:
        self.diloco = diloco
        self._cond = threading.Condition()
        self._permits = 0  # inner steps the caller may still run this outer step
        self._stepping = False  # the caller holds a permit: it may be reading or writing the model
        self._writing = False  # the caller is in its optimizer step (step_after_backward)
        self._holds = 0  # node work on the model (call) waiting or running: no permit is handed out
        self._closed = False
        self._failure: BaseException | None = None
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None
        self._target = diloco.config.inner_steps
        self._inner_done = 0
        self._losses: list[float] = []
        self._sec_per_step = 0.0
        self._inner_s = 0.0
        self._mark = time.perf_counter()  # when the caller's current inner step began (its permit)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="swarm-model")
        # writer: the node's loop, from its peers' records while it watches a step's inner steps
        # (`train` clears it): a live peer of this outer step is done with its inner steps and
        # waits for ours. A caller with no data for its next inner step then ends the step
        # (end_step) rather than wait: that peer may hold the data, and train it only in its next step
        self.waited_on = False

    # --- the node's side (its event loop) ----------------------------------------------------

    def finish(self) -> None:
        """No more permits: a caller waiting for one, or stepping, is told (SessionClosed), and
        the node's `train` returns at once; `call` still works (the node may have a round to
        finish)."""
        with self._cond:
            self._closed = True
            self._release_waiter()
            self._cond.notify_all()

    def close(self) -> None:
        """finish, and stop the worker thread of `call`."""
        self.finish()
        self._executor.shutdown(wait=True)

    def fail(self, error: BaseException) -> None:
        """The caller's loop cannot go on (swarm-node's DataTrainingThread: a divergence): the node's
        `train` raises `error`, and no more permits are given."""
        with self._cond:
            self._failure = error
            self._permits = 0
            self._release_waiter()
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in the node's model thread, once the caller is between inner steps: from
        this call on no permit is handed out until fn returns, and fn waits for the step under way."""
        with self._cond:
            self._holds += 1
        claim = {"ran": False, "dropped": False}  # who releases the hold: the thread, or we if it never ran

        def between_steps() -> T:
            with self._cond:
                if claim["dropped"]:
                    raise asyncio.CancelledError
                claim["ran"] = True
            return self._between_steps(fn, args)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, between_steps)
        finally:
            with self._cond:
                if not claim["ran"]:
                    claim["dropped"] = True
                    self._release_hold()

    async def beside(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in the node's model thread while the inner steps go on: only for work that
        reads neither θ_inner nor the inner optimizer (θ_outer, a round's Δ, the codec)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def revoke(self) -> None:
        """Take back the permits not yet spent (between steps): the node's `train` returns."""
        await self.call(self._revoke)

    def _revoke(self) -> None:
        with self._cond:
            self._permits = 0
            self._release_waiter()

    def _between_steps(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        """fn(*args) once the caller holds no permit; the hold `call` took is released after."""
        try:
            with self._cond:
                while not self._cond.wait_for(self._caller_off_the_model, HOLD_LOG_S):
                    logger.warning("the node's work on the model waits for an inner step that has run %.0fs",
                                   time.perf_counter() - self._mark)  # fmt: skip
            return fn(*args)
        finally:
            with self._cond:
                self._release_hold()

    def _caller_off_the_model(self) -> bool:
        """The caller holds no permit, or cannot use it any more (the session ended, its loop
        failed: a loop that died holding one must not hang the node), and is not in its
        optimizer step."""
        return (not self._stepping or self._closed or self._failure is not None) and not self._writing

    def _release_hold(self) -> None:
        self._holds -= 1
        self._cond.notify_all()

    def start_step(self, target: int) -> None:
        with self._cond:
            self._target, self._inner_done, self._losses = target, self.diloco.inner_done, []

    async def train(self, target: int) -> None:
        """Let the caller run inner steps until `target` are done this outer step (or the session
        closes)."""
        loop = asyncio.get_running_loop()
        with self._cond:
            self._target, self._inner_done, self.waited_on = target, self.diloco.inner_done, False
            if self.diloco.inner_done == 0:
                self._losses = []
            if self._failure is not None:
                raise self._failure
            self._permits = target - self.diloco.inner_done
            if self._permits <= 0 or self._closed:
                self._permits = 0
                return
            done: asyncio.Future[None] = loop.create_future()
            self._waiter = (loop, done)
            self._mark = time.perf_counter()
            self._cond.notify_all()
        await done
        if self._failure is not None:
            raise self._failure

    def snapshot(self) -> InnerProgress:
        with self._cond:
            return InnerProgress(self._inner_done, self._target, self._sec_per_step, tuple(self._losses),
                                 self._inner_s)  # fmt: skip

    def seconds_left(self) -> float:
        p = self.snapshot()
        return max(0, p.target - p.inner_done) * p.sec_per_step if p.sec_per_step > 0 else float("inf")

    # --- the caller's side (its training thread) ---------------------------------------------

    def wait_for_permit(self, timeout: float | None = None) -> bool:
        """Block until the caller may run an inner step (True) or the session is over (False).
        Raises TimeoutError after `timeout` seconds."""
        with self._cond:
            if self._stepping:  # back here: the caller no longer touches the model
                self._stepping = False
                self._cond.notify_all()
            allowed = lambda: (self._permits > 0 and self._holds == 0) or self._closed or self._failure  # noqa: E731
            if not self._cond.wait_for(allowed, timeout):
                raise TimeoutError(f"no inner step allowed within {timeout:g}s")
            self._stepping = not (self._closed or self._failure)
            if self._stepping:  # the step's time starts now, not while a hold kept it waiting
                self._mark = time.perf_counter()
            return self._stepping

    def step(self, tokens: int, *, loss: Any = None) -> InnerStats:
        """The inner step the caller's forward and backward began: spends one permit. Raises
        SessionClosed, RuntimeError (no permit: call wait_for_permit first) and, with the step
        skipped and the permit kept, NonFiniteLossError."""
        with self._cond:
            if self._closed:
                self._stepping = False
                self._cond.notify_all()
                raise SessionClosed("the swarm session has ended")
            if self._permits <= 0:
                raise RuntimeError("no inner step is open: wait for the swarm's outer step first")
            self._writing = True
        try:
            stats = self.diloco.step_after_backward(tokens, loss=loss)  # the permit keeps the node off the model
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()
        now = time.perf_counter()
        with self._cond:
            took, self._mark = now - self._mark, now
            self._inner_done = self.diloco.inner_done
            self._losses.append(stats.loss)
            self._inner_s += took
            self._sec_per_step = took if self._sec_per_step == 0 else 0.8 * self._sec_per_step + 0.2 * took
            self._permits -= 1
            self._stepping = False
            self._cond.notify_all()
            if self._permits == 0:
                self._release_waiter()
        return stats

    def end_step(self) -> None:
        """Instead of `step`, holding a permit: the caller has no data for another inner step now
        (swarm-node's DataTrainingThread: no chunk is free while `waited_on`). It gives back the
        permits left, and the node's `train` returns with the inner steps done so far; the caller
        waits for the next outer step's permits (wait_for_permit)."""
        with self._cond:
            self._permits = 0
            self._stepping = False
            self._cond.notify_all()
            self._release_waiter()

    def _release_waiter(self) -> None:
        if self._waiter is not None:
            loop, done = self._waiter
            self._waiter = None
            if not loop.is_closed():
                loop.call_soon_threadsafe(_set_done, done)


def _set_done(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


def __getattr__(name: str) -> object:
    """UserSteps, this class's name until this release, with a DeprecationWarning."""
    if name == "UserSteps":
        warnings.warn(f"{__name__}.UserSteps is now InnerSteps; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)  # fmt: skip
        return InnerSteps
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
