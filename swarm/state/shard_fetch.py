"""ShardFetch: the shards of one chosen manifest, downloaded from its holders in parallel and verified.

Each holder gets `config.streams_per_peer` workers. Shard i prefers holder (i + r) mod n for a
random r, so each shard comes from a different peer where possible; an idle holder takes any shard
still waiting. A shard is kept only when its length and SHA-256 match the manifest (hashed in a
thread); a peer that sends a bad one is avoided for the rest of the fetch, and the shard goes back to
the queue. With a directory, verified shards are also written there by one writer thread (write,
then rename), and shards found there verified are not fetched again: an interrupted fetch resumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from swarm.dht.errors import DHTError
from swarm.model.checkpoint import CheckpointError, Manifest, ShardInfo, read_file
from swarm.p2p.errors import P2PError, RemoteError
from swarm.p2p.host import P2PHost
from swarm.p2p.peer_id import PeerID
from swarm.state import protocol
from swarm.state.config import FetchConfig
from swarm.state.fetch_outcome import CorruptShard, FetchError, FetchProgress, FetchReport
from swarm.state.holders import Holder

logger = logging.getLogger(__name__)

BUSY_PAUSE = 0.3  # seconds before a busy peer is asked again
MAX_BUSY = 200  # busy answers in a row before a peer counts as failed (about a minute)


class ShardFetch:
    def __init__(
        self,
        host: P2PHost,
        run_id: str,
        manifest: Manifest,
        peers: list[Holder],
        directory: Path | None,
        config: FetchConfig,
        on_progress: Callable[[FetchProgress], None] | None,
        rng: random.Random,
    ) -> None:
        self.host, self.run_id, self.manifest, self.peers = host, run_id, manifest, peers
        self.directory, self.config, self.timeout = directory, config, config.timeout
        self.on_progress = on_progress
        self.offset = rng.randrange(len(peers))
        self.pending: list[int] = []  # shard indices still to fetch
        self.tried: dict[int, set[PeerID]] = {}
        self.avoided: set[PeerID] = set()
        self.changed = asyncio.Event()
        self.done_bytes = 0  # of verified shards
        self.streaming = 0  # received so far by downloads under way
        self.in_flight = 0
        self.done_shards = 0
        self.started = time.perf_counter()
        self.report = FetchReport(manifest.step, manifest.sha256, manifest.total_bytes)
        self.buffers: dict[int, bytearray] = {}  # verified shards
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="swarm-fetch-write") if directory else None
        self._writes: list[asyncio.Future[None]] = []

    async def writes_done(self) -> None:
        """Wait for the shards queued for disk (a failed write only costs resuming)."""
        results = await asyncio.gather(*self._writes, return_exceptions=True)
        for error in (r for r in results if isinstance(r, BaseException)):
            logger.warning("could not keep a fetched shard on disk: %s", error)
        if self._writer is not None:
            self._writer.shutdown(wait=False)

    async def run(self, find_holders: Callable[[], Awaitable[Sequence[Holder]]] | None) -> None:
        for i, info in enumerate(self.manifest.shards):
            kept = None
            if self.directory is not None:
                kept = await asyncio.to_thread(_verified_on_disk, self.directory / info.name, info)
            if kept is not None:
                self.buffers[i] = kept
                self.done_bytes += info.nbytes
                self.done_shards += 1
                self.report.reused_shards += 1
            else:
                self.pending.append(i)
        self._progress()
        if not self.pending:
            return
        workers: set[asyncio.Future[None]] = set()
        for peer in self.peers:
            self._start_workers(peer, workers)
        recruiter = None
        if find_holders is not None:
            recruiter = asyncio.ensure_future(self._recruit(find_holders, self.config.recruit_every, workers))
        try:
            while workers:  # the recruiter may add some meanwhile
                done, _ = await asyncio.wait(set(workers), return_when=asyncio.FIRST_COMPLETED)
                workers -= done
                for worker in done:
                    worker.result()
        finally:
            for task in [*workers, *([recruiter] if recruiter is not None else [])]:
                task.cancel()
        if self.pending:
            names = ", ".join(self.manifest.shards[i].name for i in self.pending[:3])
            raise FetchError(
                f"could not fetch {len(self.pending)} shard(s) of step {self.manifest.step} ({names}): "
                f"corrupt peers {self.report.corrupt_peers}, failed peers {self.report.failed_peers}",
                frozenset(self.avoided),
            )

    def _start_workers(self, peer: Holder, workers: set[asyncio.Future[None]]) -> None:
        for _ in range(self.config.streams_per_peer):
            workers.add(asyncio.ensure_future(self._worker(peer)))

    async def _recruit(
        self, find_holders: Callable[[], Awaitable[Sequence[Holder]]], every: float, workers: set[asyncio.Future[None]]
    ) -> None:
        """Add the peers that advertise this state after the fetch started."""
        while self.pending or self.in_flight:
            await asyncio.sleep(every)
            try:
                found = await asyncio.wait_for(find_holders(), self.timeout)
            except (P2PError, DHTError, asyncio.TimeoutError) as e:  # asyncio's: not the builtin on 3.10
                logger.info("could not read the state's holders again: %s", e)
                continue
            known = {p.peer_id for p in self.peers} | self.avoided
            for holder in found:
                if holder.manifest == self.manifest.sha256 and holder.peer_id not in known and holder.maddrs:
                    known.add(holder.peer_id)
                    self.peers.append(holder)
                    self._start_workers(holder, workers)
                    logger.info("peer %s now also serves this fetch", holder.peer_id)

    def _pick(self, peer: Holder) -> int | None:
        """A pending shard for this peer: its own first, then any it has not tried."""
        n = len(self.peers)
        mine = self.peers.index(peer)
        candidates = [i for i in self.pending if peer.peer_id not in self.tried.get(i, set())]
        for i in candidates:
            if (i + self.offset) % n == mine:
                return i
        return candidates[0] if candidates else None

    async def _worker(self, peer: Holder) -> None:
        busy = 0
        while (self.pending or self.in_flight) and peer.peer_id not in self.avoided:
            index = self._pick(peer)
            if index is None:  # nothing for us now; a download under way may still fail and come back
                if not self.in_flight:
                    return
                # keep waiting while one is under way (each is bounded by its own timeout): a worker
                # that left after `timeout` of idling left nobody to take a shard whose stalled
                # download timed out at that very moment, and the fetch failed
                self.changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), self.timeout)
                continue
            self.pending.remove(index)
            info = self.manifest.shards[index]
            self.in_flight += 1
            try:
                self.buffers[index] = await self._download(peer, info)
            except CorruptShard as e:
                logger.warning("peer %s sent a corrupt %s: %s; avoiding it", peer.peer_id, info.name, e)
                self._give_back(index, peer, avoid=True)
                _add_once(self.report.corrupt_peers, str(peer.peer_id))
                return
            except RemoteError as e:
                if e.code == "busy" and busy < MAX_BUSY:
                    busy += 1
                    self.pending.insert(0, index)
                    self.changed.set()
                    await asyncio.sleep(BUSY_PAUSE)
                    continue
                self._fail(index, peer, e)
                return
            except (P2PError, TimeoutError, OSError) as e:
                self._fail(index, peer, e)
                return
            finally:
                self.in_flight -= 1
            busy = 0
            self.done_bytes += info.nbytes
            self.done_shards += 1
            self.report.fetched_bytes += info.nbytes
            key = str(peer.peer_id)
            self.report.bytes_by_peer[key] = self.report.bytes_by_peer.get(key, 0) + info.nbytes
            self.changed.set()
            self._progress()

    def _fail(self, index: int, peer: Holder, error: BaseException) -> None:
        logger.info("peer %s failed to send a shard: %s", peer.peer_id, error)
        _add_once(self.report.failed_peers, str(peer.peer_id))
        self._give_back(index, peer, avoid=True)

    def _give_back(self, index: int, peer: Holder, *, avoid: bool) -> None:
        self.tried.setdefault(index, set()).add(peer.peer_id)
        if avoid:
            self.avoided.add(peer.peer_id)
        self.pending.insert(0, index)
        self.changed.set()

    async def _download(self, peer: Holder, info: ShardInfo) -> bytearray:
        """One shard from one peer, verified; queued for disk when there is a directory."""
        args = protocol.shard_args(self.run_id, self.manifest.sha256, info.name)
        buffer = bytearray(info.nbytes)
        view = memoryview(buffer)
        received = 0
        try:
            opened = await self.host.open_stream(peer.maddrs[0], protocol.SHARD, args, timeout=self.timeout)
            async with opened as stream:
                await stream.end()
                while (chunk := await stream.read(timeout=self.timeout)) is not None:
                    end = received + len(chunk)
                    if end > info.nbytes:
                        raise CorruptShard(f"more than the {info.nbytes} bytes the manifest lists")
                    view[received:end] = chunk  # a memcpy of one chunk: cheap on the loop
                    received = end
                    self.streaming += len(chunk)
                    self._progress()
        finally:
            self.streaming -= received
            view.release()
        if received != info.nbytes:
            raise CorruptShard(f"{received} bytes, the manifest lists {info.nbytes}")
        if await asyncio.to_thread(_sha256, buffer) != info.sha256:
            raise CorruptShard("SHA-256 does not match the manifest")
        if self._writer is not None and self.directory is not None:
            loop = asyncio.get_running_loop()
            self._writes.append(loop.run_in_executor(self._writer, _keep, self.directory / info.name, buffer))
        return buffer

    def _progress(self) -> None:
        if self.on_progress is not None:
            self.on_progress(
                FetchProgress(
                    self.manifest.step,
                    min(self.done_bytes + self.streaming, self.manifest.total_bytes),
                    self.manifest.total_bytes,
                    time.perf_counter() - self.started,
                    self.done_shards,
                    len(self.manifest.shards),
                    len(self.peers) - len(self.avoided),
                )
            )


def _add_once(items: list[str], item: str) -> None:
    if item not in items:
        items.append(item)


def _sha256(data: bytearray) -> str:
    return hashlib.sha256(data).hexdigest()


def _keep(path: Path, data: bytearray) -> None:
    """Write a verified shard under a temporary name, then rename: never a partial shard file."""
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        f.write(data)
    part.replace(path)


def _verified_on_disk(path: Path, info: ShardInfo) -> bytearray | None:
    """The shard kept by an earlier, interrupted fetch, if it is whole and verifies."""
    try:
        if path.stat().st_size != info.nbytes:
            return None
        data = read_file(path)
    except (OSError, CheckpointError):
        return None
    return data if _sha256(data) == info.sha256 else None
