"""Fixtures for the codec tests: the C++ extension (built once, in the user's cache)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from swarm_kernels import _cpu


@pytest.fixture(scope="session")
def cpu_ext() -> str:
    """Skips where no C++ compiler exists; a compiler whose build fails is a test failure."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the cpu path falls back to the reference here")
    t0 = time.monotonic()
    ok = _cpu.available()
    assert ok, f"the C++ extension did not build: {_cpu.build_error()}"
    print(f"swarm_kernels CPU extension ready in {time.monotonic() - t0:.1f} s ({_cpu.simd()})")
    return "cpu"


@pytest.fixture(params=["reference", "cpu"])
def impl(request: pytest.FixtureRequest) -> str:
    if request.param == "cpu":
        request.getfixturevalue("cpu_ext")
    return request.param


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    """torch.set_num_threads, with the thread count restored after the test."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)
