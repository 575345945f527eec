"""EventSink: what a training node tells its watcher (the CLI's panel and metrics file), as
dicts with "event", "time" and "peer_id" (the list is in swarm/node.py's docstring)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from swarm.state.fetcher import FetchProgress, FetchReport
from swarm.user_steps import InnerProgress

logger = logging.getLogger(__name__)

Event = dict[str, Any]


class EventSink:
    def __init__(self, peer_id: str, on_event: Callable[[Event], None] | None) -> None:
        self.peer_id = peer_id
        self.on_event = on_event or (lambda event: None)
        self._last_fetch_event = 0.0

    def emit(self, kind: str, **fields: Any) -> None:
        event = {"event": kind, "time": round(time.time(), 3), "peer_id": self.peer_id, **fields}
        try:
            self.on_event(event)
        except Exception:  # a display bug must not stop training
            logger.exception("event handler failed on %s", kind)

    def progress(self, step: int, p: InnerProgress, inner_steps: int) -> None:
        losses = p.losses[-10:]
        self.emit("progress", outer_step=step, inner_step=p.inner_done, inner_steps=inner_steps,
                  train_loss=sum(losses) / len(losses) if losses else None)  # fmt: skip

    def fetched(self, step: int, why: str, report: FetchReport, state_sha256: str) -> None:
        self.emit(
            "fetch",
            outer_step=step,
            reason=why,
            bytes=report.fetched_bytes,
            seconds=round(report.elapsed_s, 3),
            peers=len(report.bytes_by_peer),
            corrupt_peers=report.corrupt_peers,
            state_sha256=state_sha256,
            MBps=round(report.fetched_bytes / 1e6 / report.elapsed_s, 1) if report.elapsed_s > 0 else None,
        )

    def fetch_progress(self, progress: FetchProgress) -> None:
        now = time.monotonic()
        if now - self._last_fetch_event < 1.0 and progress.done_bytes < progress.total_bytes:
            return
        self._last_fetch_event = now
        self.emit("fetch_progress", outer_step=progress.step, done_bytes=progress.done_bytes,
                  total_bytes=progress.total_bytes, MBps=round(progress.rate_MBps, 1),
                  peers=progress.peers)  # fmt: skip
