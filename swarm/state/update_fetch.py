"""Catching up by a step's update: a node that holds the state of step t, whose chosen state
(trust.py) is of step t+1, asks that state's holders for the update of step t from its own state
(update.py, `state.update`), computes the state of t+1 itself, and keeps it only when it
serializes to the chosen manifest, shard by shard (checkpoint.snapshot_like). A missed group then
costs the update's bytes (int8: about an eighth of the state) instead of the whole state.

    caught, failed = await by_update(host, run_id, donors, manifest, base=sha, numel=n,
                                     shapes=diloco.round_shapes(), stepped=..., timeout=10.0)

A holder's update is never believed, only used: one that does not lead to the manifest (a liar,
or a holder of another lineage) is named in `failed`; after MAX_TRIES such updates, or MAX_ASKS
holders asked, the caller fetches the whole state instead. A holder that keeps no such update
(`not_found`: it fetched the state itself, or moved on; or our state is not the group's) or is
busy is simply passed over.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarm.model.checkpoint import Manifest, Snapshot, snapshot_like
from swarm.p2p.errors import P2PError, RemoteError
from swarm.p2p.host import P2PHost
from swarm.p2p.peer_id import PeerID
from swarm.state import protocol
from swarm.state.holders import Holder
from swarm.state.update import (
    HEADER,
    UpdateError,
    body_length,
    decode_update,
    max_body_length,
    parse_header,
    split_update,
)

logger = logging.getLogger(__name__)

MAX_TRIES = 2  # holders whose update is fetched and tried before the whole state is fetched instead
MAX_ASKS = 4  # holders asked at all (one without the update answers at once: a fork's node asks a few)

Stepped = Callable[[list[torch.Tensor]], Awaitable[dict[str, Any]]]  # DiLoCo.stepped_state, in the trainer


@dataclass(frozen=True, slots=True)
class CaughtUp:
    """The state of step t+1, computed here and verified against its manifest."""

    state: dict[str, Any]
    snapshot: Snapshot  # the state serialized as the manifest lists it (its hash is the manifest's)
    body: bytes | bytearray  # the update, as received: served on to others
    peer: PeerID
    elapsed_s: float


async def fetch_update_body(host: P2PHost, run_id: str, holder: Holder, step: int, base: str, numel: int,
                            timeout: float) -> bytearray:  # fmt: skip
    """One holder's update of `step` from state `base`: its bytes, never more than its header
    announces (checked against `numel` first) nor than any update of `numel` elements can be.
    Raises RemoteError (not_found, busy), P2PError, TimeoutError or UpdateError."""
    args = protocol.update_args(run_id, step, base)
    limit = max_body_length(numel)
    buffer = bytearray()
    opened = await host.open_stream(holder.maddrs[0], protocol.UPDATE, args, timeout=timeout)
    async with opened as stream:
        await stream.end()
        checked = False
        while (chunk := await stream.read(timeout=timeout)) is not None:
            buffer += chunk
            if not checked and len(buffer) >= HEADER.size:
                codec, block, raw = parse_header(buffer, numel)
                limit, checked = body_length(codec, block, numel, raw), True
            if len(buffer) > limit:
                raise UpdateError(f"more than the {limit} bytes the update can have")
    if len(buffer) != limit:
        raise UpdateError(f"{len(buffer)} bytes, its header says {limit}")
    return buffer  # not copied again on the loop: nobody writes it from here on


async def by_update(
    host: P2PHost,
    run_id: str,
    holders: Sequence[Holder],
    manifest: Manifest,
    *,
    base: str,
    numel: int,
    shapes: Sequence[torch.Size],
    stepped: Stepped,
    timeout: float,
    rng: random.Random | None = None,
) -> tuple[CaughtUp | None, frozenset[PeerID]]:
    """The state of `manifest` (step t+1) from our state `base` (step t) and a holder's update,
    or None; with the holders whose update failed (unreachable, malformed, or not leading to
    the manifest: the caller does not ask them for this state again)."""
    started = time.perf_counter()
    step = manifest.step - 1
    order = list(holders)
    (rng or random.Random()).shuffle(order)
    failed: set[PeerID] = set()
    tries = 0
    for holder in order[:MAX_ASKS]:
        if tries >= MAX_TRIES:
            break
        who = str(holder.peer_id)[-8:]
        try:
            body = await fetch_update_body(host, run_id, holder, step, base, numel, timeout)
        except RemoteError as e:
            if e.code not in ("not_found", "busy"):
                failed.add(holder.peer_id)
            logger.debug("no update of step %d from %s: %s", step, who, e)
            continue
        except (P2PError, TimeoutError, asyncio.TimeoutError, UpdateError) as e:  # 3.10: not the same
            logger.info("could not take the update of step %d from %s: %s", step, who, e)
            failed.add(holder.peer_id)
            continue
        tries += 1
        try:
            flat = await asyncio.to_thread(decode_update, body, numel)
            state = await stepped(split_update(flat, shapes))
            snapshot = await asyncio.to_thread(snapshot_like, state, manifest)
        except (ValueError, KeyError) as e:  # UpdateError, a non-finite Δ̄ (DiLoCo), a tensor not in the state
            logger.warning("the update of step %d from %s is unusable: %s", step, who, e)
            failed.add(holder.peer_id)
            continue
        if snapshot.manifest.sha256 != manifest.sha256:
            logger.warning("the update of step %d from %s does not lead to the state its holders advertise; "
                           "not using it", step, who)  # fmt: skip
            failed.add(holder.peer_id)
            continue
        return CaughtUp(state, snapshot, body, holder.peer_id, time.perf_counter() - started), frozenset(failed)
    return None, frozenset(failed)
