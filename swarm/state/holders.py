"""Who holds which state: records under `<run>/state` in the DHT (run_keys.py).

    {"step": outer steps applied, "manifest": sha256 hex, "maddrs": [...], "bytes": state size,
     "proof": the nonce of the holder's costly DHT id}

in a subkey owned (signed) by the holder, refreshed after every outer step and expiring soon
after a holder stops. A record counts only with its owner's proof of a costly id (dht/id_proof.py),
as ready records do: a key pair is free, and a crowd of free identities advertising a state
would otherwise be a crowd of holders to every count of backers. A fetcher takes the newest
step, and at that step the manifest hash that the most peers advertise (ties: the smaller hash,
so every fetcher picks the same one).
Records are untrusted input: malformed ones are skipped, and a manifest is only believed when
its bytes hash to the advertised value.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from swarm.dht.node import DHTNode
from swarm.dht.records import owner_subkey
from swarm.dht.run_keys import proven_map, state_key
from swarm.dht.run_records import record_entries
from swarm.dht.store_retry import store_or_warn
from swarm.model.checkpoint import Manifest
from swarm.p2p.maddr import TcpAddress, parse_address
from swarm.p2p.peer_id import PeerID
from swarm.utils.log_once import OncePerPeer

logger = logging.getLogger(__name__)
_unproven = OncePerPeer(logger, logging.INFO)

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
MAX_MADDRS = 8


@dataclass(frozen=True, slots=True)
class Holder:
    peer_id: PeerID
    step: int
    manifest: str  # sha256 hex
    maddrs: tuple[str, ...]
    nbytes: int


async def advertise(dht: DHTNode, run_id: str, manifest: Manifest, maddrs: Sequence[str], expiration: float, *,
                    within: float | None = None) -> bool:  # fmt: skip
    """Advertise that we hold `manifest`'s state; False when no DHT node stored the record
    (store_or_warn retried it within `within` seconds and logged a warning): nobody can find
    this state until the caller advertises it again."""
    value = {"step": manifest.step, "manifest": manifest.sha256, "maddrs": list(maddrs), "bytes": manifest.total_bytes,
             "proof": dht.id_nonce}  # fmt: skip
    subkey = owner_subkey(dht.peer_id)
    return await store_or_warn(dht, state_key(run_id), value, expiration, subkey, kind="state holders",
                               within=within) > 0  # fmt: skip


def decode_holder(subkey: Any, value: Any, id_bits: int | None = None) -> Holder | None:
    """The record's holder, or None when it is malformed or, with `id_bits`, when its owner's
    proof of a costly id does not check out (None: not checked, for a display of the records)."""
    owned = proven_map(subkey, value, id_bits, unproven=lambda peer, e: _unproven.log(
        peer, "unproven", "a state record without a proof of a costly id (%s): skipped", e))  # fmt: skip
    if owned is None:
        return None
    peer, value = owned
    step, sha, maddrs, nbytes = value.get("step"), value.get("manifest"), value.get("maddrs"), value.get("bytes", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None
    if not isinstance(sha, str) or not _HEX64.match(sha) or isinstance(nbytes, bool) or not isinstance(nbytes, int):
        return None
    if not isinstance(maddrs, list) or not 1 <= len(maddrs) <= MAX_MADDRS:
        return None
    good = []
    for text in maddrs:
        try:
            good.append(parse_address(text).with_peer_id(peer).to_maddr() if isinstance(text, str) else None)
        except ValueError:
            continue
    good = [m for m in good if m]
    return Holder(peer, step, sha, tuple(good), nbytes) if good else None


async def find_holders(dht: DHTNode, run_id: str) -> list[Holder]:
    """The live state records of the run (an empty list when none or on a DHT failure)."""
    bits = dht.config.id_bits
    entries = await record_entries(dht, state_key(run_id), "who holds state")
    holders = [decode_holder(subkey, value, bits) for subkey, value in entries]
    return [h for h in holders if h is not None]


def choose_state(holders: Sequence[Holder], exclude: Sequence[PeerID] = ()) -> tuple[int, str, list[Holder]] | None:
    """(step, manifest sha256, its holders) of the state to fetch, or None when nobody holds one."""
    usable = [h for h in holders if h.peer_id not in set(exclude)]
    if not usable:
        return None
    step = max(h.step for h in usable)
    votes = Counter(h.manifest for h in usable if h.step == step)
    sha = min(votes, key=lambda s: (-votes[s], s))
    return step, sha, [h for h in usable if h.step == step and h.manifest == sha]


def direct_donors(holders: Sequence[Holder]) -> list[Holder]:
    """The holders a fetch takes its shards from: those with an address of their own when there
    are any, so that no relay carries a state shard unless nothing else can."""
    direct = [h for h in holders if any(isinstance(_address(m), TcpAddress) for m in h.maddrs)]
    return direct or list(holders)


def _address(text: str) -> object:
    try:
        return parse_address(text)
    except ValueError:
        return None


SETTLE_SECONDS = 1.0  # longest wait for peers advertising an older step to advertise the chosen one
SETTLE_POLL = 0.2
SETTLE_MIN_BYTES = 4 << 20  # a smaller state comes from one donor in well under SETTLE_SECONDS
SETTLE_DONORS = 2  # the fetch spreads over this many donors before it stops waiting for more


async def settled_holders(holders: list[Holder], step: int, find: Callable[[], Awaitable[list[Holder]]], *,
                          within: float = SETTLE_SECONDS, poll: float = SETTLE_POLL,
                          min_bytes: int = SETTLE_MIN_BYTES) -> list[Holder]:  # fmt: skip
    """Peers that finished a step together advertise its state a moment apart: a fetch that
    started at the first advertisement would take it all from one donor. While the chosen step
    has fewer than SETTLE_DONORS holders and some peer still advertises the step before it, read
    the holders again (for at most `within` seconds). Peers further behind are not waited for
    (they are catching up themselves; with short steps the chosen state would be gone by the
    time they advertise it), nor is anyone for a state under `min_bytes`."""
    if max((h.nbytes for h in holders if h.step == step), default=0) < min_bytes:
        return holders

    def unsettled(found: list[Holder]) -> bool:
        donors = sum(1 for h in found if h.step == step)
        return donors < SETTLE_DONORS and any(h.step == step - 1 for h in found)

    deadline = time.monotonic() + within
    while unsettled(holders) and time.monotonic() < deadline:
        await asyncio.sleep(poll)
        holders = await find() or holders  # a failed lookup: keep what we knew
    return holders
