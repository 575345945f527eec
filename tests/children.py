"""The processes the tests start: the environment they get, and whether one has exited."""

from __future__ import annotations

import os
from pathlib import Path

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
    except FileNotFoundError:
        return True
