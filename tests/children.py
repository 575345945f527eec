"""The processes the tests start: the environment they get, and whether one has exited."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from swarm.netlab.lab import pid_alive
from swarm.utils import process_control

# SWARM_INITIAL_PEERS: a user's own swarm must not be joined. COLUMNS and LINES: pytest-xdist's
# workers set them (80 x 24), and a child's tables would then be cut to 80 columns.
_LEFT_OUT = ("SWARM_INITIAL_PEERS", "COLUMNS", "LINES")


def child_env(**extra: str) -> dict[str, str]:
    """os.environ without what would change what a child does or prints, plus `extra`."""
    return {k: v for k, v in os.environ.items() if k not in _LEFT_OUT} | extra


def exited(pid: int) -> bool:
    """The process has exited. A zombie counts: it runs nothing and has left its namespace, and
    one whose parent is gone is reaped by init a moment later, not at once."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:  # gone, or no /proc: ask the kernel (there a zombie counts as running)
        return not pid_alive(pid)


def still_running(pids: Iterable[int], timeout: float = 5.0) -> list[int]:
    """Those of `pids` that have not exited after up to `timeout` seconds (none: at once)."""
    pids, deadline = list(pids), time.monotonic() + timeout
    while (running := [pid for pid in pids if not exited(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return running


def run_to_end(
    argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """subprocess.run(argv, capture_output=True, text=True) through process_control.start: a
    swarm-node command line is forked from the server that has torch imported, not exec'd, so
    it costs a fraction of a CPU-second instead of 3 (its exit code and output are the same).
    Past `timeout` it is killed and subprocess.TimeoutExpired raised, as subprocess.run does."""
    proc = process_control.start(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=dict(env) if env is not None else None)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        process_control.kill(proc, reap_s=None)
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
