"""The processes the tests start: the environment they get, and whether one has exited."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from swarm.netlab.lab import pid_alive

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
