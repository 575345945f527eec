"""OncePerPeer: log a peer's bad input once per (peer, kind), so that a flood of bad records from
one identity cannot flood the log, while the first of each is still seen with its peer."""

from __future__ import annotations

import logging
from typing import Any

MAX_REMEMBERED = 4096  # (peer, kind) pairs kept; beyond it the memory starts over (bounded state)


class OncePerPeer:
    def __init__(self, logger: logging.Logger, level: int = logging.WARNING) -> None:
        self.logger, self.level = logger, level
        self._seen: set[tuple[str, str]] = set()

    def log(self, peer: Any, kind: str, message: str, *args: Any) -> bool:
        """Log `message % args` (prefixed with the peer) unless this peer was already logged for
        `kind`; True when it was logged now."""
        key = (str(peer), kind)
        if key in self._seen:
            return False
        if len(self._seen) >= MAX_REMEMBERED:
            self._seen.clear()
        self._seen.add(key)
        self.logger.log(self.level, "peer %s: " + message, str(peer), *args)
        return True
