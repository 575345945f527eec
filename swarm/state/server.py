"""StateServer: answers `state.manifest` and `state.shard` (protocol.py) from the snapshot of
the last finished outer step, and `state.update` from the last steps' updates (update.py).

    server = StateServer(host, run_id, max_uploads=4)
    server.publish(snapshot)     # after each outer step; the previous one stays for `grace` seconds
    server.publish_update(StepUpdate(step, base, body))   # the update that step applied

Serving never touches the training state: a snapshot is an immutable copy (bytes) made once per
outer step, and each call holds a reference to the snapshot it started with. At most
`max_uploads` shards are streamed at once; more callers get `busy` and try another peer.

Fault injection, for tests and benchmarks only: `StateServer(..., faults=ServeFaults(...))` serves
like a slow, lying or stalled donor would (scripts/tools/state_seeder.py, tests/state/conftest.py), so
that fetchers can be tested against one without overriding the server's methods. A training node
never sets it. A lying *manifest* needs no hook: publish a snapshot made with another RunInfo.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from swarm.model.checkpoint import Snapshot
from swarm.p2p.errors import Busy, NotFound, P2PError
from swarm.p2p.handlers import CallContext
from swarm.p2p.host import P2PHost
from swarm.p2p.stream import Stream
from swarm.state import protocol

logger = logging.getLogger(__name__)

KEPT_UPDATES = 2  # the last steps' updates served (a node is one step behind, or its group just moved on)


@dataclass(frozen=True, slots=True)
class StepUpdate:
    """The update outer step `step` applied to the state whose state_sha256 is `base` (hex):
    update.py's body of the group's averaged Δ̄."""

    step: int
    base: str
    body: bytes | bytearray  # never written once published


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeFaults:
    """How a StateServer misbehaves on purpose: each field is one fault, off by default. Shards
    are then sent in pieces of `chunk_bytes` (the fault-free path sends each in one write)."""

    shard_delay: float = 0.0  # seconds before a shard's first byte (a busy or distant donor)
    chunk_delay: float = 0.0  # seconds after each piece sent (a slow uplink)
    chunk_bytes: int = 256 << 10
    corrupt: bool | frozenset[str] = False  # flip a byte of every shard (True) or of these shard names
    stall_after: int | None = None  # bytes of a shard sent before the upload stops for good (a hung donor)

    def __post_init__(self) -> None:
        if self.shard_delay < 0 or self.chunk_delay < 0 or self.chunk_bytes < 1:
            raise ValueError("delays must be >= 0 seconds and chunk_bytes >= 1")
        if self.stall_after is not None and self.stall_after < 0:
            raise ValueError(f"stall_after must be >= 0 bytes, got {self.stall_after}")

    def corrupts(self, name: str) -> bool:
        return self.corrupt is True or (isinstance(self.corrupt, frozenset) and name in self.corrupt)


class StateServer:
    """Serves a node's last snapshots to peers: owns the `state.manifest` and `state.shard`
    handlers on the host, the current and the previous snapshot (kept `grace` seconds), and the
    upload slots. `publish(snapshot)` after each outer step; `close` removes the handlers.
    `faults`: misbehave on purpose (ServeFaults; tests and benchmarks only)."""

    def __init__(
        self,
        host: P2PHost,
        run_id: str,
        *,
        max_uploads: int = 4,
        timeout: float = 60.0,
        grace: float = 30.0,
        faults: ServeFaults | None = None,
    ) -> None:
        if max_uploads < 1:
            raise ValueError("max_uploads must be >= 1")
        self.host, self.run_id, self.max_uploads, self.timeout = host, run_id, max_uploads, timeout
        self.grace, self.faults = grace, faults
        self.snapshot: Snapshot | None = None
        self.previous: Snapshot | None = None
        self.previous_until = 0.0
        self.updates: dict[tuple[int, str], StepUpdate] = {}  # (step, base) -> the last KEPT_UPDATES
        self.uploads = 0
        self.bytes_sent = 0
        host.add_handler(protocol.MANIFEST, self._rpc_manifest)
        host.add_stream_handler(protocol.SHARD, self._rpc_shard)
        host.add_stream_handler(protocol.UPDATE, self._rpc_update)

    def publish(self, snapshot: Snapshot) -> None:
        """Serve `snapshot` from now on; the one it replaces stays available for `grace` seconds,
        so that fetches that picked it just before this outer step can finish."""
        if self.snapshot is not None:
            self.previous, self.previous_until = self.snapshot, time.monotonic() + self.grace
        self.snapshot = snapshot

    def publish_update(self, update: StepUpdate) -> None:
        """Serve `update` from now on, with the one before it (older ones are dropped)."""
        self.updates[(update.step, update.base)] = update
        while len(self.updates) > KEPT_UPDATES:
            del self.updates[min(self.updates)]

    def close(self) -> None:
        self.host.remove_handler(protocol.MANIFEST)
        self.host.remove_handler(protocol.SHARD)
        self.host.remove_handler(protocol.UPDATE)

    async def _rpc_manifest(self, ctx: CallContext, args: Any) -> dict[str, Any]:
        wanted = protocol.parse_manifest_args(args, self.run_id)
        snapshot = self._snapshot(wanted)
        return {"manifest": snapshot.manifest.to_json(), "sha256": snapshot.manifest.sha256}

    async def _rpc_shard(self, ctx: CallContext, args: Any, stream: Stream) -> None:
        sha, name = protocol.parse_shard_args(args, self.run_id)
        snapshot = self._snapshot(sha)
        data = snapshot.shards.get(name)
        if data is None:
            raise NotFound(f"{protocol.SHARD}: no shard {name} in state {sha[:12]}")
        await self._upload(ctx, stream, name, data)

    async def _rpc_update(self, ctx: CallContext, args: Any, stream: Stream) -> None:
        step, base = protocol.parse_update_args(args, self.run_id)
        update = self.updates.get((step, base))
        if update is None:
            raise NotFound(f"{protocol.UPDATE}: no update of step {step} from state {base[:12]}")
        await self._upload(ctx, stream, f"the update of step {step}", update.body)

    async def _upload(self, ctx: CallContext, stream: Stream, name: str, data: bytes | bytearray) -> None:
        """Stream `data` within an upload slot (Busy when none is free)."""
        if self.uploads >= self.max_uploads:
            raise Busy(f"{self.uploads} uploads in progress")
        self.uploads += 1
        try:
            if self.faults is None:
                await stream.write(memoryview(data), timeout=self.timeout)
            else:
                await _send_with_faults(stream, name, data, self.faults, self.timeout)
            await stream.end()
            self.bytes_sent += len(data)
        except (P2PError, asyncio.TimeoutError) as e:  # the fetcher left or stalled: its loss alone
            logger.info("upload of %s to %s stopped: %s", name, ctx.peer_id, e)
        finally:
            self.uploads -= 1

    def _snapshot(self, sha: str | None) -> Snapshot:
        snapshot = self.snapshot
        if snapshot is None:
            raise NotFound("no state to serve yet")
        if sha is None or snapshot.manifest.sha256 == sha:
            return snapshot
        previous = self.previous
        if previous is not None and previous.manifest.sha256 == sha and time.monotonic() < self.previous_until:
            return previous
        self.previous = None if time.monotonic() >= self.previous_until else self.previous  # let it go
        raise NotFound(f"state {sha[:12]} is no longer served (now step {snapshot.manifest.step})")


async def _send_with_faults(
    stream: Stream, name: str, data: bytes | bytearray, faults: ServeFaults, timeout: float
) -> None:
    """Send one shard as `faults` say: late, slowly, with a flipped byte, or only its start."""
    if faults.shard_delay:
        await asyncio.sleep(faults.shard_delay)
    view = memoryview(data)
    if faults.corrupts(name) and data:
        flipped = bytearray(data)  # a copy: the snapshot itself stays right for other fetchers
        flipped[len(flipped) // 2] ^= 0xFF
        view = memoryview(flipped)
    end = len(view) if faults.stall_after is None else min(len(view), faults.stall_after)
    for start in range(0, end, faults.chunk_bytes):
        await stream.write(view[start : min(start + faults.chunk_bytes, end)], timeout=timeout)
        if faults.chunk_delay:
            await asyncio.sleep(faults.chunk_delay)
    if end < len(view):  # stalled: no more bytes, no end, until the fetcher gives up (its cancel ends this)
        await asyncio.get_running_loop().create_future()
