"""Choosing the event loop: uvloop where it is installed (Linux, macOS), asyncio's elsewhere.

Only entry points (CLI commands, benchmark scripts, test fixtures) call this; library code just
uses the running loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory(use_uvloop: bool = True) -> Callable[[], asyncio.AbstractEventLoop]:
    if use_uvloop:
        try:
            import uvloop
        except ImportError:  # Windows, or a minimal install
            pass
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool = True) -> T:
    """asyncio.run on uvloop when available."""
    loop = loop_factory(use_uvloop)()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(_cancel_leftovers_after(main))
    finally:
        asyncio.set_event_loop(None)
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def _cancel_leftovers_after(main: Coroutine[Any, Any, T]) -> T:
    try:
        return await main
    finally:
        current = asyncio.current_task()
        leftovers = [t for t in asyncio.all_tasks() if t is not current]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)


async def cancel_and_wait(task: asyncio.Future[Any], *, timeout: float = 10.0) -> None:
    """Cancel a long-lived task and wait until it is done. Cancels again while it runs: on
    Python < 3.12 asyncio.wait_for can swallow a cancellation that arrives as its inner future
    completes, and a loop around it then goes on forever. Gives up (with the task still
    running) after `timeout` seconds. A task that had failed is not re-raised here: its
    done-callback reports it when it happens."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not task.done() and loop.time() < deadline:
        task.cancel()
        await asyncio.wait({task}, timeout=min(0.5, max(0.0, deadline - loop.time())))


def exception_seen(task: asyncio.Future[Any]) -> None:
    """A done callback: marks the task's exception as retrieved. For tasks whose outcome their
    owner may never read (cancelled at a round's end, or out-raced by a faster answer), which
    asyncio would otherwise log as "Task exception was never retrieved", a death the soak
    counts as unseen."""
    if not task.cancelled():
        task.exception()
