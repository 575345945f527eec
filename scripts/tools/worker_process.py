"""A benchmark worker: a child process driven with one JSON line per command on its stdin,
answering with one JSON line, prefixed by a marker, on its stdout (other output is ignored)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from swarm.utils import process_control

ROOT = Path(__file__).resolve().parents[2]  # the repository: where `python -m scripts.<name>` works


def module_command(module: str, *args: str) -> list[str]:
    """`python -m scripts.<name> ARGS`: a benchmark run as a child (start it with cwd=ROOT)."""
    return [sys.executable, "-m", module, *args]


def reply(mark: str, obj: dict[str, Any]) -> None:
    """The worker side: one answer line."""
    sys.stdout.write(mark + json.dumps(obj) + "\n")
    sys.stdout.flush()


class WorkerProcess:
    """`python -m MODULE ARGS...` in its own session (so that close() can reach its children)."""

    def __init__(
        self, module: str, args: list[str], mark: str, name: str = "worker", prefix: list[str] | None = None
    ) -> None:
        """`prefix`: an argv prefix the child runs under (e.g. `ip netns exec NS`: a shaped link)."""
        self.mark, self.name = mark, name
        env = {"OMP_NUM_THREADS": "1", "HIVEMIND_LOGLEVEL": "ERROR",
               # a fixed mmap threshold: glibc returns freed tensor-sized buffers to the OS at once
               "MALLOC_MMAP_THRESHOLD_": "1048576", **os.environ}  # fmt: skip
        self.proc = process_control.start(
            [*(prefix or []), *module_command(module, *args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )
        self.alive = True

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def receive(self, timeout: float) -> dict[str, Any]:
        """The next answer; TimeoutError when none comes in `timeout` seconds, ChildExited when
        the worker exits first."""
        return process_control.read_json_line(self.proc, timeout, prefix=self.mark, what=self.name)

    def kill(self) -> None:
        """SIGKILL, no goodbye."""
        self.alive = False
        process_control.kill(self.proc)

    def close(self, grace: float = 60.0) -> None:
        """Close its stdin (the worker's signal to finish) and wait; then kill its whole session."""
        if self.proc.poll() is None:
            process_control.close_stdin(self.proc)
            process_control.stop(self.proc, grace, term=None, group=True)


def sha256_hex(tensor: Any) -> str:
    """A result's SHA-256 (members compare them). Run it in a thread: a round's result is
    hundreds of MB, and the loop must keep answering peers still auditing the round."""
    from swarm_kernels import as_memoryview

    return hashlib.sha256(as_memoryview(tensor)).hexdigest()
