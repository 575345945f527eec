"""Bounded logging of what peers do wrong. OncePerPeer: a peer's bad input once per (peer, kind),
so that a flood of bad records from one identity cannot flood the log, while the first of each
is still seen with its peer. RateLimitedLog: a few lines per kind and period, for floods from
throwaway sources."""

from __future__ import annotations

import logging
import time
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


class RateLimitedLog:
    """At most `burst` lines per `period` seconds per kind; the next line allowed says how many
    were held back. For floods from throwaway sources (connections refused, handshakes
    failed), where once-per-peer does not bound anything."""

    def __init__(self, logger: logging.Logger, level: int = logging.WARNING, burst: int = 5, period: float = 10.0):
        self.logger, self.level, self.burst, self.period = logger, level, burst, period
        self._windows: dict[str, tuple[float, int, int]] = {}  # kind -> (window start, logged, held back)

    def log(self, kind: str, message: str, *args: Any) -> bool:
        now = time.monotonic()
        start, logged, held = self._windows.get(kind, (now, 0, 0))
        if now - start >= self.period:
            start, logged = now, 0
        if logged >= self.burst:
            self._windows[kind] = (start, logged, held + 1)
            return False
        if held:
            message += f" ({held} more like it held back)"
        self._windows[kind] = (start, logged + 1, 0)
        self.logger.log(self.level, message, *args)
        return True
