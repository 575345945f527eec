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
