"""fetch_state: bring a node up to the swarm's state from several peers at once.

    manifest, state, report = await fetch_state(host, run_id, holders, expect=run_info, dest=dir,
                                                config=FetchConfig(timeout=60.0, streams_per_peer=2))
    diloco.load_state_dict(state)

1. Choose (holders.choose_state): the newest step, the manifest hash most peers advertise.
2. Manifest: asked from the holders in random order; believed only when its bytes hash to the
   advertised value, and refused (RefusedManifest) when it is of another run or model, or
   when its tensors or shard sizes do not fit the model (trust.py).
3. Shards, in parallel: `config.streams_per_peer` downloads per holder at a time. Shard i prefers
   holder (i + r) mod n for a random r, so each shard comes from a different peer where possible
   and many newcomers spread over all holders; an idle holder takes any shard still waiting.
   Each shard streams into a buffer of its size, is hashed in a thread (the event loop never
   blocks; other shards keep arriving meanwhile) and is kept only when its length and SHA-256
   match the manifest. A shard that fails verification marks its peer as corrupt (avoided for
   the rest of the fetch); a peer that dies or moves on to a newer state is dropped; either
   way the shard goes back to the queue for another peer. A busy peer is retried after a pause.
   With `find_holders`, the holders are read again every `config.recruit_every` seconds while shards
   are missing: peers that advertise the same state later (they finished the outer step a
   moment after the first ones) join the fetch.
   With `dest`, each verified shard is also written to `<dest>/fetch-<sha>/` by a writer thread,
   off the download's path, so that an interrupted fetch (crash, timeout) resumes with the
   shards it has; without it nothing touches the disk.
4. Load: only when every shard is verified. The tensors are views of the received buffers
   (checkpoint.tensors_in_safetensors): the newcomer holds the state once, plus the shards in
   flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.dht.errors import DHTError
from swarm.model.checkpoint import (
    CheckpointError,
    IncompatibleState,
    Manifest,
    RunInfo,
    ShardInfo,
    parse_manifest,
    read_file,
    state_from_shards,
)
from swarm.p2p.errors import P2PError, RemoteError
from swarm.p2p.host import P2PHost
from swarm.p2p.peer_id import PeerID
from swarm.state import protocol
from swarm.state.config import FetchConfig
from swarm.state.holders import Holder, choose_state, direct_donors
from swarm.state.trust import manifest_problem

logger = logging.getLogger(__name__)

BUSY_PAUSE = 0.3  # seconds before a busy peer is asked again
MAX_BUSY = 200  # busy answers in a row before a peer counts as failed (about a minute)


class FetchError(RuntimeError):
    """The state could not be fetched; the message says which shard or step and why. `failed`:
    the holders that were asked for it and did not deliver (unreachable, gone, or sent bad bytes)."""

    def __init__(self, message: str, failed: frozenset[PeerID] = frozenset()) -> None:
        super().__init__(message)
        self.failed = failed


class RefusedManifest(FetchError):
    """The chosen state's manifest does not fit this node's model (trust.manifest_problem): its
    holders lie about it, and nothing was allocated for it."""

    def __init__(self, sha: str, problem: str) -> None:
        super().__init__(f"refusing state {sha[:12]}: {problem}")
        self.sha, self.problem = sha, problem


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
    by_update: bool = False  # computed from the previous state and the step's update (update_fetch.py)


async def fetch_state(
    host: P2PHost,
    run_id: str,
    holders: Sequence[Holder],
    *,
    expect: RunInfo,
    dest: Path | None = None,
    config: FetchConfig | None = None,
    on_progress: Callable[[FetchProgress], None] | None = None,
    rng: random.Random | None = None,
    find_holders: Callable[[], Awaitable[Sequence[Holder]]] | None = None,
    expect_tensors: Mapping[str, int] | None = None,
) -> tuple[Manifest, dict[str, Any], FetchReport]:
    """Fetch, verify and load the state to use (see the module docstring), tuned by `config`
    (None: FetchConfig's defaults). Raises FetchError; RefusedManifest for a state of another
    run or model (anyone can advertise one under our run's key: it must not stop the node).
    With `expect_tensors` (each tensor name of the state -> its raw byte size), a manifest that
    does not fit them is refused (RefusedManifest) before any shard buffer is allocated."""
    config = config or FetchConfig()
    rng = rng or random.Random()
    chosen = choose_state(holders)
    if chosen is None:
        raise FetchError(f"nobody advertises a state of run {run_id!r}")
    _, sha, chosen_peers = chosen
    peers = direct_donors(chosen_peers)  # a relay carries no shard unless nobody else can
    rng.shuffle(peers)
    manifest = await fetch_manifest(host, run_id, peers, sha, expect, config.timeout)
    if expect_tensors is not None and (problem := manifest_problem(manifest, expect_tensors)) is not None:
        raise RefusedManifest(sha, problem)
    directory = None
    if dest is not None:
        directory = Path(dest) / f"fetch-{sha[:16]}"
        await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
    fetch = _ShardFetch(host, run_id, manifest, peers, directory, config, on_progress, rng)
    try:
        await fetch.run(find_holders)
    finally:
        await fetch.writes_done()
    shards = [fetch.buffers[i] for i in range(len(manifest.shards))]
    try:
        state = await asyncio.to_thread(state_from_shards, manifest, shards)
    except CheckpointError as e:  # shards that hash right but hold no usable state: its maker lies
        raise RefusedManifest(sha, str(e)) from None
    fetch.report.elapsed_s = time.perf_counter() - fetch.started
    return manifest, state, fetch.report


async def fetch_manifest(
    host: P2PHost, run_id: str, peers: Sequence[Holder], sha: str, expect: RunInfo, timeout: float
) -> Manifest:
    reasons, failed = [], set()
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
            failed.add(peer.peer_id)
            continue
        try:
            manifest.check_usable_by(expect)
        except IncompatibleState as e:  # under our run's key: a peer of other settings, or one that lies
            raise RefusedManifest(sha, f"{e} (a node of other settings, or a lie: not adopted)") from None
        return manifest
    raise FetchError(f"no holder of state {sha[:12]} sent its manifest ({'; '.join(reasons)[:400]})", frozenset(failed))


class _ShardFetch:
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


def remove_fetch_dir(dest: Path, manifest: Manifest) -> None:
    """Delete a finished fetch's files (the node keeps the state in memory and checkpoints it)."""
    shutil.rmtree(Path(dest) / f"fetch-{manifest.sha256[:16]}", ignore_errors=True)
