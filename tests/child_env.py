"""The environment of the processes the tests start."""

from __future__ import annotations

import os

# SWARM_INITIAL_PEERS: a user's own swarm must not be joined. COLUMNS and LINES: pytest-xdist's
# workers set them (80 x 24), and a child's tables would then be cut to 80 columns.
_LEFT_OUT = ("SWARM_INITIAL_PEERS", "COLUMNS", "LINES")


def child_env(**extra: str) -> dict[str, str]:
    """os.environ without what would change what a child does or prints, plus `extra`."""
    return {k: v for k, v in os.environ.items() if k not in _LEFT_OUT} | extra
