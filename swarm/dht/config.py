"""DHTConfig: the Kademlia parameters and every bound of a DHT node, checked when built."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

KiB = 1024
MiB = 1024 * KiB
ID_BITS_ENV = "SWARM_DHT_ID_BITS"  # overrides the default of id_bits (the tests set a small one)
DEFAULT_ID_BITS = 20  # 2^20 tries: ~1 s of one core with hashlib on average (scripts/bench/dht.py measures it)


def _default_id_bits() -> int:
    return int(os.environ.get(ID_BITS_ENV, DEFAULT_ID_BITS))


@dataclass(frozen=True, kw_only=True, slots=True)
class DHTConfig:
    # Kademlia
    k: int = 20  # bucket size and replication factor
    alpha: int = 3  # parallel requests in a lookup (per path)
    # S/Kademlia (id_proof.py, lookup.py): every node id carries a proof of 2^id_bits hashes,
    # checked on every contact; lookups run over disjoint_paths paths that share no node.
    # All nodes of one DHT should use the same id_bits: a node refuses ids weaker than its own.
    id_bits: int = field(default_factory=_default_id_bits)
    disjoint_paths: int = 3
    # bounds on what a node accepts from peers and users
    max_key_bytes: int = 512  # msgpack form of a key
    max_subkey_bytes: int = 512  # msgpack form of a subkey
    max_value_bytes: int = 64 * KiB  # msgpack form of a value
    max_records: int = 100_000  # records (plain values and subkeys) one node stores
    max_cache_records: int = 10_000  # records cached from lookups that passed through this node
    max_subkeys_per_key: int = 1_000
    max_ttl: float = 7 * 24 * 3600.0  # the furthest an expiration may lie ahead
    # the furthest ahead per kind of run key (ttl_caps.py): a record of a live node needs
    # seconds to minutes, so a flood of them cannot outlive its authors for days
    ttl_caps: tuple[tuple[str, float], ...] = (
        ("nodes", 900.0), ("state", 3600.0), ("ready", 3600.0), ("runs", 900.0), ("receipts", 3600.0),
        ("chunks", 3600.0),
    )  # fmt: skip
    # quotas (quotas.py). Memory: storage and cache each hold at most max_storage_bytes of
    # keys, subkeys and values; one peer's stores fill at most max_*_per_source of it.
    max_storage_bytes: int = 64 * MiB
    max_records_per_source: int = 1_000
    max_bytes_per_source: int = 4 * MiB
    max_subkeys_per_source_per_key: int = 16  # one peer may relay at most this many entries of a key
    max_unproven_subkeys_per_key: int = 32  # entries of owners without a costly id, per key
    liveness_window: float = 900.0  # an owner heard from this recently counts as alive
    max_clock_skew: float = 30.0  # tolerance on expirations for peers whose clocks run ahead
    max_maddrs_per_peer: int = 8  # addresses a peer may announce for itself
    max_maddr_chars: int = 256
    max_store_batch: int = 64  # records in one dht.store request
    # timeouts, seconds
    rpc_timeout: float = 2.0  # one request of a lookup; a slower peer is skipped
    lookup_timeout: float = 15.0  # one whole get or store
    bootstrap_timeout: float = 15.0
    # maintenance, seconds
    refresh_interval: float = 600.0  # buckets untouched this long are refreshed by a random lookup
    republish_interval: float = 300.0  # owners re-store their live records this often
    # an initial peer gone from the routing table (a network split, a restarted bootstrap) is
    # pinged again after this long, then at doubling waits up to refresh_interval (rejoin.py)
    rejoin_interval: float = 15.0
    maintenance_jitter: float = 0.1  # fraction of an interval added at random so nodes don't sync up
    ping_timeout: float = 2.0  # a stale bucket entry that does not answer within this is replaced

    def __post_init__(self) -> None:
        for name in (
            "k", "alpha", "max_key_bytes", "max_subkey_bytes", "max_value_bytes", "max_records",
            "max_cache_records", "max_subkeys_per_key", "max_ttl", "max_maddrs_per_peer",
            "max_maddr_chars", "max_store_batch", "rpc_timeout", "lookup_timeout",
            "bootstrap_timeout", "refresh_interval", "republish_interval", "ping_timeout", "rejoin_interval",
            "disjoint_paths", "max_storage_bytes", "max_records_per_source", "max_bytes_per_source",
            "max_subkeys_per_source_per_key", "max_unproven_subkeys_per_key", "liveness_window",
        ):  # fmt: skip
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"DHTConfig.{name} must be positive, got {value}")
        if self.max_clock_skew < 0 or not 0 <= self.maintenance_jitter <= 1:
            raise ValueError("DHTConfig.max_clock_skew must be >= 0 and maintenance_jitter in [0, 1]")
        if self.alpha > self.k:
            raise ValueError("DHTConfig.alpha cannot exceed k")
        if not 0 <= self.id_bits <= 32:
            raise ValueError(f"DHTConfig.id_bits must be in [0, 32], got {self.id_bits}")
        if any(not 0 < ttl <= self.max_ttl for _, ttl in self.ttl_caps):
            raise ValueError("DHTConfig.ttl_caps must be positive and at most max_ttl")
        if self.max_bytes_per_source > self.max_storage_bytes:
            raise ValueError("DHTConfig.max_bytes_per_source cannot exceed max_storage_bytes")
