"""Test rules (STYLE.md §13): port 0 only, a hard timeout on every test (pyproject), transport
tests on both event loops, and a test fails if an event loop's exception handler fires (an
exception nobody awaited, a callback that crashed)."""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from swarm.dht.config import ID_BITS_ENV
from swarm.utils.eventloop import loop_factory

# DHT ids cost 2^id_bits hashes (swarm/dht/id_proof.py): ~1 s each by default, 1 ms in tests.
# Set before any DHTConfig is built; subprocesses (swarm-node, swarm-dht) inherit it.
os.environ.setdefault(ID_BITS_ENV, "8")
# A node keeps its key in $XDG_CONFIG_HOME/swarm (swarm/cli/node_identity.py): the tests' nodes keep
# theirs in a folder of this test session, never in the user's own.
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="swarm-tests-config-")
atexit.register(shutil.rmtree, os.environ["XDG_CONFIG_HOME"], True)

_loop_errors: list[dict[str, Any]] = []


def _checked(factory: Callable[[], asyncio.AbstractEventLoop]) -> Callable[[], asyncio.AbstractEventLoop]:
    def make() -> asyncio.AbstractEventLoop:
        loop = factory()
        loop.set_exception_handler(lambda _loop, context: _loop_errors.append(context))
        return loop

    return make


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[..., Any]]:
    uv = loop_factory(use_uvloop=True)
    factories = {"uvloop": _checked(uv)} if uv is not asyncio.new_event_loop else {}
    if not factories or "tests/p2p/" in str(item.path).replace("\\", "/"):
        factories["asyncio"] = _checked(asyncio.new_event_loop)
    return factories


@pytest.fixture(autouse=True)
def loop_errors_fail_the_test() -> Iterator[None]:
    _loop_errors.clear()
    yield
    errors, _loop_errors[:] = list(_loop_errors), []
    assert not errors, f"the event loop's exception handler fired: {errors}"


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Any]:
    """Real swarm-node processes of one test (tests/node/conftest.py's Swarm), every one stopped
    at the end. Imported here, not at the top: most tests never start a node (nor import torch)."""
    from tests.node.conftest import Swarm

    s = Swarm(tmp_path)
    try:
        yield s
    finally:
        s.close()
