"""Fixtures of the state tests: state donors in the test's event loop (scripts/tools/state_seeder.py's
Seeder: a host, a DHT node and a StateServer with ServeFaults), and in-process nodes to fetch
from them (tests/node/inprocess.py). A donor as a separate process (`python
scripts/tools/state_seeder.py`) is for what needs one: scripts/bench/state.py measures a newcomer's
memory and speed against real processes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest

from scripts.tools.state_seeder import Seeder, SeedSpec
from tests.node.conftest import data, local  # noqa: F401 (the node tests' fixtures, for newcomers)

StartSeeder = Callable[..., Awaitable[Seeder]]


@pytest.fixture
async def seeder() -> AsyncIterator[StartSeeder]:
    """seeder(spec, initial_peers, faults=ServeFaults(...) | None, max_uploads=4): a donor that
    advertises and serves spec's state; every donor is closed when the test ends."""
    started: list[Seeder] = []

    async def start(spec: SeedSpec, initial_peers: Sequence[str], **kwargs: Any) -> Seeder:
        donor = await Seeder.start(spec, initial_peers, **kwargs)
        started.append(donor)
        return donor

    try:
        yield start
    finally:
        for donor in started:
            await donor.close()
