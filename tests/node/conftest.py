"""swarm-node in real processes on 127.0.0.1: a bootstrap `swarm-dht serve` and nodes, each
stopped by PID (SIGTERM, then SIGKILL) when the test ends, pass or fail."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from swarm.model.data import TokenData, load_data
from swarm.utils import process_control
from swarm.utils.process_control import console_script
from tests.children import child_env
from tests.node.inprocess import LocalSwarm

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
ENV = child_env(OMP_NUM_THREADS="1")
# small and quick: the debug model, short windows, one torch thread per node (2-core machines)
FAST_SETTINGS = ("--model", "debug", "--batch-size", "2", "--seq-len", "64")  # the run settings of FAST
FAST = (*FAST_SETTINGS, "--threads", "1", "--eval-windows", "8")


class Swarm:
    """The processes of one test."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[str]] = []
        self.bootstrap: str | None = None

    def start_bootstrap(self, *args: str) -> str:
        """`swarm-dht serve` (with `args`: e.g. --relay off); its first multiaddr."""
        err = open(self.workdir / "bootstrap.err", "w")  # noqa: SIM115 (the child holds it)
        proc = process_control.start(
            [console_script("swarm-dht"), "serve", "--json", "--host-maddrs", LOOPBACK, *args],
            stdout=subprocess.PIPE, stderr=err, text=True, env=ENV,
        )  # fmt: skip
        self.procs.append(proc)
        self.bootstrap = self.ready_line("bootstrap", proc, 30)["maddrs"][0]
        return self.bootstrap

    def node(self, name: str, *args: str, initial: bool = True) -> subprocess.Popen[str]:
        """Start `swarm-node` with FAST settings, its metrics in <name>.jsonl, output in <name>.out/.err."""
        peers = ["--initial-peers", self.bootstrap] if initial and self.bootstrap else []
        out = open(self.workdir / f"{name}.out", "w")  # noqa: SIM115
        err = open(self.workdir / f"{name}.err", "w")  # noqa: SIM115
        command = [console_script("swarm-node"), "--host-maddrs", LOOPBACK, *peers, *FAST,
                   "--metrics-file", str(self.metrics_path(name)), "-v", *args]  # fmt: skip
        proc = process_control.start(command, stdout=out, stderr=err, text=True, env=ENV)
        self.procs.append(proc)
        return proc

    def ready_line(self, name: str, proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
        """The JSON line `name` prints once it serves; the test fails with its stderr if none comes."""
        try:
            return process_control.read_json_line(proc, timeout, what=name)
        except (TimeoutError, process_control.ChildExited) as e:
            pytest.fail(f"{e}; its stderr:\n{self.stderr(name)[-4000:]}")

    def metrics_path(self, name: str) -> Path:
        return self.workdir / f"{name}.jsonl"

    def events(self, name: str, kind: str | None = None) -> list[dict[str, Any]]:
        path = self.metrics_path(name)
        if not path.exists():
            return []
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [e for e in events if kind is None or e["event"] == kind]

    def stderr(self, name: str) -> str:
        return (self.workdir / f"{name}.err").read_text()

    def exit_code(self, name: str, proc: subprocess.Popen[str], timeout: float) -> int:
        """The exit code of node `name`; a node that does not exit in time fails the test with the
        end of its stderr (what it was doing)."""
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} did not exit within {timeout:g}s; its stderr ends:\n{self.stderr(name)[-4000:]}")

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.2)

    def close(self) -> None:
        process_control.stop_all(self.procs, 15.0)


@pytest.fixture(scope="module")
def data() -> TokenData:
    return load_data("stdlib")


@pytest.fixture
async def local(data: TokenData) -> AsyncIterator[LocalSwarm]:
    """Many SwarmNodes in this test's event loop (inprocess.py); every one stopped at the end."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many trainer threads on 2 cores
    swarm = LocalSwarm(data)
    try:
        yield swarm
    finally:
        await swarm.close()
        torch.set_num_threads(threads)
