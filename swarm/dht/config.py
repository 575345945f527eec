"""DHTConfig: the Kademlia parameters and every bound of a DHT node, checked when built."""

from __future__ import annotations

from dataclasses import dataclass

KiB = 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class DHTConfig:
    # Kademlia
    k: int = 20  # bucket size and replication factor
    alpha: int = 3  # parallel requests in a lookup
    # bounds on what a node accepts from peers and users
    max_key_bytes: int = 512  # msgpack form of a key
    max_subkey_bytes: int = 512  # msgpack form of a subkey
    max_value_bytes: int = 64 * KiB  # msgpack form of a value
    max_records: int = 100_000  # records (plain values and subkeys) one node stores
    max_cache_records: int = 10_000  # records cached from lookups that passed through this node
    max_subkeys_per_key: int = 1_000
    max_ttl: float = 7 * 24 * 3600.0  # the furthest an expiration may lie ahead
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
    maintenance_jitter: float = 0.1  # fraction of an interval added at random so nodes don't sync up
    ping_timeout: float = 2.0  # a stale bucket entry that does not answer within this is replaced

    def __post_init__(self) -> None:
        for name in (
            "k", "alpha", "max_key_bytes", "max_subkey_bytes", "max_value_bytes", "max_records",
            "max_cache_records", "max_subkeys_per_key", "max_ttl", "max_maddrs_per_peer",
            "max_maddr_chars", "max_store_batch", "rpc_timeout", "lookup_timeout",
            "bootstrap_timeout", "refresh_interval", "republish_interval", "ping_timeout",
        ):  # fmt: skip
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"DHTConfig.{name} must be positive, got {value}")
        if self.max_clock_skew < 0 or not 0 <= self.maintenance_jitter <= 1:
            raise ValueError("DHTConfig.max_clock_skew must be >= 0 and maintenance_jitter in [0, 1]")
        if self.alpha > self.k:
            raise ValueError("DHTConfig.alpha cannot exceed k")
