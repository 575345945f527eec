"""fetch_state: bring a node up to the swarm's state from several peers at once.

    manifest, state, report = await fetch_state(host, run_id, holders, expect=run_info, dest=dir)
    diloco.load_state_dict(state)

1. Choose (holders.choose_state): the newest step, the manifest hash most peers advertise.
2. Manifest: asked from the holders in random order; believed only when its bytes hash to the
   advertised value, and refused (IncompatibleState) when it is of another run or model.
3. Shards, in parallel: `streams_per_peer` downloads per holder at a time. Shard i prefers
   holder (i + r) mod n for a random r, so each shard comes from a different peer where possible
   and many newcomers spread over all holders; an idle holder takes any shard still waiting.
   Each shard streams to `<dest>/fetch-<sha>/<shard>.part` while it is hashed (in a thread:
   the event loop never blocks), and is renamed into place only when its length and SHA-256
   match the manifest. A shard that fails verification marks its peer as corrupt (avoided for
   the rest of the fetch); a peer that dies or moves on to a newer state is dropped; either
   way the shard goes back to the queue for another peer. A busy peer is retried after a pause.
4. Load: only when every shard is verified; an interrupted fetch (crash, timeout) finds its
   verified shards on disk and fetches only the rest.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from swarm.model.checkpoint import (
    CheckpointError,
    Manifest,
    RunInfo,
    ShardInfo,
    parse_manifest,
    state_from_shards,
)
from swarm.p2p.errors import P2PError, RemoteError
from swarm.p2p.host import P2PHost
from swarm.p2p.peer_id import PeerID
from swarm.state import protocol
from swarm.state.holders import Holder, choose_state

logger = logging.getLogger(__name__)

BUSY_PAUSE = 0.3  # seconds before a busy peer is asked again
MAX_BUSY = 200  # busy answers in a row before a peer counts as failed (about a minute)


class FetchError(RuntimeError):
    """The state could not be fetched; the message says which shard or step and why."""


class CorruptShard(Exception):
    """A peer sent bytes that do not match the manifest."""


@dataclass
class FetchProgress:
    step: int
    done_bytes: int
    total_bytes: int
    elapsed_s: float
    shards_done: int
    shards_total: int
    peers: int

    @property
    def rate_MBps(self) -> float:
        return self.done_bytes / 1e6 / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class FetchReport:
    step: int
    manifest_sha256: str
    total_bytes: int
    fetched_bytes: int = 0  # over the network in this call (shards found on disk are not counted)
    reused_shards: int = 0  # verified shards already on disk (a resumed fetch)
    elapsed_s: float = 0.0
    bytes_by_peer: dict[str, int] = field(default_factory=dict)
    corrupt_peers: list[str] = field(default_factory=list)
    failed_peers: list[str] = field(default_factory=list)


async def fetch_state(
    host: P2PHost,
    run_id: str,
    holders: Sequence[Holder],
    *,
    expect: RunInfo,
    dest: Path,
    streams_per_peer: int = 2,
    timeout: float = 60.0,
    on_progress: Callable[[FetchProgress], None] | None = None,
    rng: random.Random | None = None,
) -> tuple[Manifest, dict[str, Any], FetchReport]:
    """Fetch, verify and load the state to use (see the module docstring). Raises FetchError,
    or IncompatibleState for a state of another run or model."""
    rng = rng or random.Random()
    chosen = choose_state(holders)
    if chosen is None:
        raise FetchError(f"nobody advertises a state of run {run_id!r}")
    _, sha, peers = chosen
    rng.shuffle(peers)
    manifest = await _fetch_manifest(host, run_id, peers, sha, expect, timeout)
    directory = Path(dest) / f"fetch-{sha[:16]}"
    await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
    fetch = _ShardFetch(host, run_id, manifest, peers, directory, streams_per_peer, timeout, on_progress, rng)
    await fetch.run()
    state = await asyncio.to_thread(_load, manifest, directory)
    fetch.report.elapsed_s = time.perf_counter() - fetch.started
    return manifest, state, fetch.report


async def _fetch_manifest(
    host: P2PHost, run_id: str, peers: Sequence[Holder], sha: str, expect: RunInfo, timeout: float
) -> Manifest:
    reasons = []
    for peer in peers:
        try:
            args = protocol.manifest_args(run_id, sha)
            reply = await host.call(peer.maddrs[0], protocol.MANIFEST, args, timeout=timeout)
            data = reply.get("manifest") if isinstance(reply, dict) else None
            if not isinstance(data, bytes) or hashlib.sha256(data).hexdigest() != sha:
                raise CheckpointError("its manifest does not hash to what it advertises")
            manifest = parse_manifest(data)
        except (P2PError, CheckpointError) as e:
            reasons.append(f"{str(peer.peer_id)[-8:]}: {e}")
            continue
        manifest.check_usable_by(expect)  # IncompatibleState: the advertised state itself is wrong for us
        return manifest
    raise FetchError(f"no holder of state {sha[:12]} sent its manifest ({'; '.join(reasons)[:400]})")


class _ShardFetch:
    def __init__(
        self,
        host: P2PHost,
        run_id: str,
        manifest: Manifest,
        peers: list[Holder],
        directory: Path,
        streams_per_peer: int,
        timeout: float,
        on_progress: Callable[[FetchProgress], None] | None,
        rng: random.Random,
    ) -> None:
        self.host, self.run_id, self.manifest, self.peers = host, run_id, manifest, peers
        self.directory, self.streams_per_peer, self.timeout = directory, max(1, streams_per_peer), timeout
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

    async def run(self) -> None:
        for i, info in enumerate(self.manifest.shards):
            if await asyncio.to_thread(_verified_on_disk, self.directory / info.name, info):
                self.done_bytes += info.nbytes
                self.done_shards += 1
                self.report.reused_shards += 1
            else:
                self.pending.append(i)
        self._progress()
        if not self.pending:
            return
        workers = [
            asyncio.ensure_future(self._worker(peer)) for peer in self.peers for _ in range(self.streams_per_peer)
        ]
        try:
            await asyncio.gather(*workers)
        finally:
            for worker in workers:
                worker.cancel()
        if self.pending:
            names = ", ".join(self.manifest.shards[i].name for i in self.pending[:3])
            raise FetchError(
                f"could not fetch {len(self.pending)} shard(s) of step {self.manifest.step} ({names}): "
                f"corrupt peers {self.report.corrupt_peers}, failed peers {self.report.failed_peers}"
            )

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
                self.changed.clear()
                try:
                    await asyncio.wait_for(self.changed.wait(), self.timeout)
                except asyncio.TimeoutError:
                    return
                continue
            self.pending.remove(index)
            info = self.manifest.shards[index]
            self.in_flight += 1
            try:
                await self._download(peer, info)
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

    async def _download(self, peer: Holder, info: ShardInfo) -> None:
        part = self.directory / f"{info.name}.part.{id(asyncio.current_task())}"
        args = protocol.shard_args(self.run_id, self.manifest.sha256, info.name)
        hasher = hashlib.sha256()
        received = counted = 0
        file = await asyncio.to_thread(open, part, "wb")
        try:
            opened = await self.host.open_stream(peer.maddrs[0], protocol.SHARD, args, timeout=self.timeout)
            async with opened as stream:
                await stream.end()
                while (chunk := await stream.read(timeout=self.timeout)) is not None:
                    received += len(chunk)
                    if received > info.nbytes:
                        raise CorruptShard(f"more than the {info.nbytes} bytes the manifest lists")
                    await asyncio.to_thread(_write_and_hash, file, hasher, chunk)
                    self.streaming += len(chunk)
                    counted += len(chunk)
                    self._progress()
            await asyncio.to_thread(file.close)
            if received != info.nbytes:
                raise CorruptShard(f"{received} bytes, the manifest lists {info.nbytes}")
            if hasher.hexdigest() != info.sha256:
                raise CorruptShard("SHA-256 does not match the manifest")
            await asyncio.to_thread(part.replace, self.directory / info.name)
        except BaseException:
            await asyncio.to_thread(_discard, file, part)
            raise
        finally:
            self.streaming -= counted

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


def _write_and_hash(file: IO[bytes], hasher: Any, chunk: Any) -> None:
    hasher.update(chunk)
    file.write(chunk)


def _discard(file: IO[bytes], part: Path) -> None:
    file.close()
    part.unlink(missing_ok=True)


def _verified_on_disk(path: Path, info: ShardInfo) -> bool:
    try:
        if path.stat().st_size != info.nbytes:
            return False
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(8 << 20):
                digest.update(block)
        return digest.hexdigest() == info.sha256
    except OSError:
        return False


def _load(manifest: Manifest, directory: Path) -> dict[str, Any]:
    state = state_from_shards(manifest, ((directory / info.name).read_bytes() for info in manifest.shards))
    return state


def remove_fetch_dir(dest: Path, manifest: Manifest) -> None:
    """Delete a finished fetch's files (the node keeps the state in memory and checkpoints it)."""
    shutil.rmtree(Path(dest) / f"fetch-{manifest.sha256[:16]}", ignore_errors=True)
