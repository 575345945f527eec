"""Relays that nodes learn from the DHT, beside their initial peers.

    relays   subkey [owner:<PeerID>] -> {"maddrs": [direct multiaddrs], "proof": the nonce of its costly id}

A node that relays for others (a reachable swarm-node, swarm-dht serve) lists itself under this
key, which belongs to no run (no slash, as `runs`): one relay serves every run of a DHT. It
stores the record every ADVERTISE_EVERY_S for RECORD_TTL_S, so a relay that stops drops out
within minutes. A NATed node's RelayKeeper (p2p/relay_client.py) asks find_relays() when it holds
fewer reservations than it wants: so it finds another relay when its initial peers' relays die.

Records are untrusted input, and a flood of fake ones is the attack to expect (a key pair is
free; a record pointing at nothing costs its author one store). What bounds it:
- a record counts only with its owner's proof of a costly DHT id (dht/id_proof.py), as state
  records do, and only its direct TCP addresses are read (circuits do not chain);
- choose_relays() draws at random, one record per source address (an IPv4 address, an IPv6
  /64: admission.source_of), at most `limit` per call: identities made on one machine share
  one draw, and a flood from many addresses is sampled, never read in an order its author picks;
- the keeper tries what it drew by a ping and a reservation, and skips one that failed for
  minutes: each call draws from the rest, so a real relay among fakes is found within a few
  passes. A real relay proves itself the only way that matters: it takes our reservation.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from swarm.dht.node import DHTNode
from swarm.dht.records import owner_subkey
from swarm.dht.run_keys import proven_map
from swarm.dht.run_records import record_entries
from swarm.dht.store_retry import store_or_warn
from swarm.p2p.admission import source_of
from swarm.p2p.maddr import TcpAddress, parse_address
from swarm.p2p.peer_id import PeerID

logger = logging.getLogger(__name__)

RELAYS_KEY = "relays"  # belongs to no run: a run id has no slash, and neither has this key
RECORD_TTL_S = 300.0
ADVERTISE_EVERY_S = 120.0  # well within the record's life: one lost store does not drop us
MAX_MADDRS = 4  # addresses read per record
LEARN_LIMIT = 8  # relays drawn per call: the keeper pings each


def relay_record(maddrs: Iterable[str], proof: bytes) -> dict[str, Any]:
    """Our record: our direct addresses (a relayed one is of no use to a NATed node) and our proof."""
    direct = [m for m in maddrs if isinstance(_address(m), TcpAddress)][:MAX_MADDRS]
    return {"maddrs": direct, "proof": proof}


def decode_relay(subkey: Any, value: Any, id_bits: int) -> TcpAddress | None:
    """The relay a record names: its first direct address, with the owner's PeerID; None when the
    record is malformed, names no direct address or its owner's id proof fails."""
    owned = proven_map(subkey, value, id_bits)
    if owned is None:
        return None
    peer, fields = owned
    maddrs = fields.get("maddrs")
    if not isinstance(maddrs, list):
        return None
    for text in maddrs[:MAX_MADDRS]:
        addr = _address(text) if isinstance(text, str) else None
        if isinstance(addr, TcpAddress) and addr.peer_id in (None, peer):
            return addr.with_peer_id(peer)
    return None


def choose_relays(relays: Sequence[TcpAddress], *, exclude: Iterable[PeerID] = (), limit: int = LEARN_LIMIT,
                  rng: random.Random | None = None) -> list[TcpAddress]:  # fmt: skip
    """At most `limit` of `relays`, drawn at random with at most one per source address, none of
    `exclude` (pure: the randomness is passed in)."""
    rng = rng or random.Random()
    excluded = set(exclude)
    by_source: dict[str, list[TcpAddress]] = {}
    for addr in relays:
        if addr.peer_id is not None and addr.peer_id not in excluded:
            by_source.setdefault(source_of(addr.host), []).append(addr)
    drawn = [rng.choice(group) for group in by_source.values()]
    rng.shuffle(drawn)
    return drawn[:limit]


async def find_relays(dht: DHTNode, *, exclude: Iterable[PeerID] = (), limit: int = LEARN_LIMIT) -> list[str]:
    """Relays the DHT's records name (choose_relays), as multiaddrs; [] when none or on a failure."""
    bits = dht.config.id_bits
    entries = await record_entries(dht, RELAYS_KEY, "the DHT's relays")
    relays = [decode_relay(subkey, value, bits) for subkey, value in entries]
    chosen = choose_relays([r for r in relays if r is not None], exclude=[dht.peer_id, *exclude], limit=limit)
    return [addr.to_maddr() for addr in chosen]


async def advertise_relay_forever(dht: DHTNode, maddrs: Callable[[], Sequence[str]]) -> None:
    """List us as a relay in the DHT every ADVERTISE_EVERY_S (run it under Supervised)."""
    while True:
        record = relay_record(maddrs(), dht.id_nonce)
        if record["maddrs"]:
            await store_or_warn(dht, RELAYS_KEY, record, time.time() + RECORD_TTL_S, owner_subkey(dht.peer_id),
                                kind="relays", within=ADVERTISE_EVERY_S / 2)  # fmt: skip
        await asyncio.sleep(ADVERTISE_EVERY_S)


def _address(text: str) -> object:
    try:
        return parse_address(text)
    except ValueError:
        return None
