"""Supervised: a long-lived background task that cannot die unseen.

    refresher = Supervised("state advertisement", keeper_refresh_forever).start()
    ...
    error = await refresher.close()     # None, or the last exception it raised

An unexpected exception (a bug, not a cancellation) is logged with its traceback and the task is
started again after a backoff that doubles up to `max_backoff`, so one bad round does not stop
republishing for the rest of the run; `failures` and `last_error` say what happened, and `close`
returns the last error for its owner to report. A task that returns normally is done.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from swarm.utils.eventloop import cancel_and_wait

logger = logging.getLogger(__name__)


class Supervised:
    """Owns one asyncio task running `make()` again after each unexpected failure."""

    def __init__(
        self, name: str, make: Callable[[], Awaitable[None]], *, backoff: float = 1.0, max_backoff: float = 60.0
    ) -> None:
        if not 0 < backoff <= max_backoff:
            raise ValueError("need 0 < backoff <= max_backoff")
        self.name, self._make = name, make
        self.backoff, self.max_backoff = backoff, max_backoff
        self.failures = 0
        self.last_error: BaseException | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> Supervised:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        return self

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def close(self) -> BaseException | None:
        """Cancel the task and wait for it; the last exception it raised (None: never)."""
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        return self.last_error

    async def _run(self) -> None:
        delay: float | None = None
        while True:
            try:
                await self._make()
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                delay = self.backoff if delay is None else min(2 * delay, self.max_backoff)
                self.failures += 1
                self.last_error = e
                logger.error("background task %r failed (%d time(s)); starting it again in %.1fs",
                             self.name, self.failures, delay, exc_info=e)  # fmt: skip
            await asyncio.sleep(delay)
