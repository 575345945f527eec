"""Stall: a member's process stopped (SIGSTOP) and woken again, in one event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from swarm.p2p.host import P2PHost


class Stall:
    """Hold every frame that reaches `host` on its open connections, as the kernel holds the
    bytes of a stopped process; `wake` delivers them in order, one per turn of the event loop
    (a process reads its buffers a piece at a time)."""

    def __init__(self, host: P2PHost) -> None:
        self.held: list[tuple[Callable[..., None], dict[str, Any], bytes]] = []
        self.protocols = [c.protocol for conns in host._pool.by_peer.values() for c in conns]
        assert self.protocols, "the stalled member must have live connections (a warm-up round)"
        self.handlers = [p.on_frame for p in self.protocols]
        for protocol, handler in zip(self.protocols, self.handlers, strict=True):
            protocol.on_frame = self._holder(handler)

    def _holder(self, handler: Callable[..., None]) -> Callable[..., None]:
        def hold(head: dict[str, Any], body: bytes | memoryview) -> None:
            self.held.append((handler, head, bytes(body)))

        return hold

    async def wake(self) -> None:
        for protocol, handler in zip(self.protocols, self.handlers, strict=True):
            protocol.on_frame = handler
        held, self.held = self.held, []
        for handler, head, body in held:
            handler(head, body)
            await asyncio.sleep(0)
