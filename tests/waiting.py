"""Waiting for something to have happened, not for a time that usually suffices.

A test that sleeps "long enough" for a handler to start or a record to be stored passes on a quiet
machine and fails on a loaded one (or passes without testing what it says). Wait on an
asyncio.Event the code under test sets, or on the task itself, when there is one; `until` is for
the rest: state that is only observable by looking at it (a counter, a routing table, a DHT read)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

POLL = 0.05  # seconds between looks


async def until(
    condition: Callable[[], T | Awaitable[T]], timeout: float, what: str = "the condition", *, poll: float = POLL
) -> T:
    """Look at `condition()` (a plain function or a coroutine function) every `poll` seconds until
    it returns something true, and return that; at once when it already holds. Fails the test
    (AssertionError naming `what`) if `timeout` seconds pass first, a look included."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            try:
                value = await asyncio.wait_for(value, max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                value = None
        if value:
            return value  # type: ignore[return-value]
        if loop.time() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(poll)
