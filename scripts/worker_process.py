"""A benchmark worker: a child process driven with one JSON line per command on its stdin,
answering with one JSON line, prefixed by a marker, on its stdout (other output is ignored)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any


def running(proc: Any) -> bool:
    """A psutil.Process that exists and is not a zombie (False for a pid that has been reused)."""
    import psutil  # the bench extra: only the hivemind scripts call this

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def status_kib(field: str, pid: int | str = "self") -> int:
    """A `VmRSS:`-style field of /proc/<pid>/status, in KiB (0 when the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def exit_on_sigterm() -> None:
    """The orchestrator's side: SIGTERM unwinds like Ctrl-C, so `finally` blocks stop workers."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def reply(mark: str, obj: dict[str, Any]) -> None:
    """The worker side: one answer line."""
    sys.stdout.write(mark + json.dumps(obj) + "\n")
    sys.stdout.flush()


class WorkerProcess:
    """`python SCRIPT ARGS...` in its own session (so that close() can reach its children)."""

    def __init__(self, script: str, args: list[str], mark: str, name: str = "worker") -> None:
        self.mark, self.name = mark, name
        env = {"OMP_NUM_THREADS": "1", "HIVEMIND_LOGLEVEL": "ERROR",
               # a fixed mmap threshold: glibc returns freed tensor-sized buffers to the OS at once
               "MALLOC_MMAP_THRESHOLD_": "1048576", **os.environ}  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, script, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        self.alive = True

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def receive(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"{self.name} did not answer within {timeout:.0f}s")
            line = self.proc.stdout.readline().decode()
            if not line:
                raise RuntimeError(f"{self.name} exited (code {self.proc.poll()})")
            if line.startswith(self.mark):
                return json.loads(line[len(self.mark) :])

    def kill(self) -> None:
        """SIGKILL, no goodbye."""
        self.alive = False
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait(10)

    def close(self, grace: float = 60.0) -> None:
        """Close its stdin (the worker's signal to finish) and wait; then kill its whole session."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
