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
import hashlib
import logging
import random
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from swarm.model.checkpoint import (
    CheckpointError,
    IncompatibleState,
    Manifest,
    RunInfo,
    parse_manifest,
    state_from_shards,
)
from swarm.p2p.errors import P2PError
from swarm.p2p.host import P2PHost
from swarm.state import protocol
from swarm.state.config import FetchConfig
from swarm.state.fetch_outcome import FetchError, FetchProgress, FetchReport, RefusedManifest
from swarm.state.holders import Holder, choose_state, direct_donors
from swarm.state.shard_fetch import ShardFetch
from swarm.state.trust import manifest_problem

__all__ = ["FetchError", "FetchProgress", "FetchReport", "RefusedManifest", "fetch_manifest", "fetch_state",
           "remove_fetch_dir"]  # fmt: skip

logger = logging.getLogger(__name__)


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
    fetch = ShardFetch(host, run_id, manifest, peers, directory, config, on_progress, rng)
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


def remove_fetch_dir(dest: Path, manifest: Manifest) -> None:
    """Delete a finished fetch's files (the node keeps the state in memory and checkpoints it)."""
    shutil.rmtree(Path(dest) / f"fetch-{manifest.sha256[:16]}", ignore_errors=True)
