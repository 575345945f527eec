"""The suite's own rule (tests/conftest.py): an async test that awaits forever is cancelled a few
seconds short of its pytest-timeout, which uvloop would otherwise swallow."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.conftest import IN_LOOP_MARGIN_S, _bounded, in_loop_limit


@pytest.mark.parametrize(
    ("marker_args", "ini", "expected"),
    [
        ((300,), 120.0, 300 - IN_LOOP_MARGIN_S),  # the marker's timeout wins
        (None, 120.0, 120 - IN_LOOP_MARGIN_S),  # else the ini's
        ((), 120.0, 120 - IN_LOOP_MARGIN_S),  # a marker without a number: the ini's
        ((8,), 120.0, None),  # too short to leave a margin: pytest-timeout alone
        (None, 0.0, None),  # no timeout at all
    ],
)
def test_the_in_loop_limit_is_the_tests_timeout_less_the_margin(
    marker_args: tuple[int, ...] | None, ini: float, expected: float | None
) -> None:
    assert in_loop_limit(marker_args, ini) == expected


async def test_a_test_that_awaits_forever_fails_with_a_timeout_error() -> None:
    async def waits_forever() -> None:
        await asyncio.Event().wait()

    began = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ran past its 0\.2 s"):
        await _bounded(waits_forever, 0.2)()
    assert time.monotonic() - began < 5
