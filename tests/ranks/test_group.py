"""The ranks' process group in real processes on 127.0.0.1 (gloo): what a rank does when the
others are not what it expects. Every process is stopped by PID at the end, pass or fail."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarm.utils import process_control

pytestmark = pytest.mark.swarm

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    try:
        yield started
    finally:
        process_control.stop_all(started, 5.0)


def _start(procs: list[subprocess.Popen[str]], *argv: str) -> subprocess.Popen[str]:
    proc = process_control.start([sys.executable, "-m", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=ENV, cwd=ROOT)  # fmt: skip
    procs.append(proc)
    return proc


def _follower(procs: list[subprocess.Popen[str]], port: int, device: str) -> subprocess.Popen[str]:
    return _start(procs, "swarm.ranks.follower", "--rank", "1", "--world-size", "2", "--port", str(port), "--device",
                  device, "--backend", "gloo", "--timeout", "30")  # fmt: skip


@pytest.mark.timeout(120)
def test_ranks_on_mixed_device_types_refuse_with_one_line(procs: list[subprocess.Popen[str]]) -> None:
    leader = _start(procs, "tests.ranks.fake_leader", "mixed")
    port = process_control.read_json_line(leader, 60, what="rank 0")["port"]
    follower = _follower(procs, port, "meta")  # a device kind that is not rank 0's
    assert leader.wait(60) == 3
    assert follower.wait(60) == 1
    lines = follower.stderr.read().strip().splitlines() if follower.stderr else []
    assert lines[-1].startswith("swarm-node rank 1: the ranks of this node run on mixed device types (rank 0: cpu, "
                                "rank 1: other)"), lines  # fmt: skip
    assert "Traceback" not in "".join(lines)
    assert "mixed device types" in (leader.stderr.read() if leader.stderr else "")


@pytest.mark.timeout(120)
def test_a_follower_whose_rank_0_vanished_exits_with_one_line(procs: list[subprocess.Popen[str]]) -> None:
    leader = _start(procs, "tests.ranks.fake_leader", "vanish")
    port = process_control.read_json_line(leader, 60, what="rank 0")["port"]
    follower = _follower(procs, port, "cpu")
    assert leader.wait(60) == 0
    assert follower.wait(60) == 1  # the collective fails at once, or after the 30 s timeout at worst
    err = follower.stderr.read() if follower.stderr else ""
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("swarm-node rank 1: lost rank 0 of this node ("), err
