"""Test rules (STYLE.md §13): port 0 only, a hard timeout on every test (pyproject), transport
tests on both event loops, and a test fails if an event loop's exception handler fires (an
exception nobody awaited, a callback that crashed)."""

from __future__ import annotations

import asyncio
import atexit
import functools
import inspect
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


# pytest-timeout's SIGALRM cannot stop an async test that awaits forever on uvloop: the handler's
# exception is raised inside one of the loop's callbacks, uvloop hands it to the loop's exception
# handler, and the test goes on waiting (a lineage attack test ran 793 s past its 300 s that way).
# So every async test also runs under asyncio.wait_for, IN_LOOP_MARGIN_S short of its timeout: it
# is cancelled, fails with TimeoutError, and its fixtures clean up as after any other failure.
IN_LOOP_MARGIN_S = 5.0


def in_loop_limit(marker_args: tuple[Any, ...] | None, ini_timeout: float) -> float | None:
    """Seconds an async test may run in its loop: its pytest-timeout (the marker's, else the
    ini's) less IN_LOOP_MARGIN_S; None where there is no limit worth one."""
    limit = float(marker_args[0]) if marker_args else ini_timeout
    return limit - IN_LOOP_MARGIN_S if limit > 2 * IN_LOOP_MARGIN_S else None


def _bounded(test: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    @functools.wraps(test)
    async def bounded(*args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.wait_for(test(*args, **kwargs), seconds)
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
            raise TimeoutError(f"the test ran past its {seconds:g} s in the event loop") from None

    return bounded


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        test = getattr(item, "obj", None)
        if not inspect.iscoroutinefunction(test):
            continue
        marker = item.get_closest_marker("timeout")
        limit = in_loop_limit(marker.args if marker else None, float(config.getini("timeout") or 0))
        if limit is not None:
            item.obj = _bounded(test, limit)  # type: ignore[attr-defined]


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
