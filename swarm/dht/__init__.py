"""swarm.dht: a Kademlia DHT with expiring records, subkeys and owner-signed records."""

from swarm.dht.background import DHT
from swarm.dht.config import DHTConfig
from swarm.dht.errors import (
    BadRecord,
    BadSignature,
    BootstrapError,
    DHTError,
    ExpirationOutOfRange,
    Outdated,
    RecordError,
    StorageFull,
    ValueTooLarge,
)
from swarm.dht.node import DHTNode
from swarm.dht.records import OWNER_PREFIX, Record, ValueWithExpiration, owner_of, owner_subkey

__all__ = [
    "DHT",
    "OWNER_PREFIX",
    "BadRecord",
    "BadSignature",
    "BootstrapError",
    "DHTConfig",
    "DHTError",
    "DHTNode",
    "ExpirationOutOfRange",
    "Outdated",
    "Record",
    "RecordError",
    "StorageFull",
    "ValueTooLarge",
    "ValueWithExpiration",
    "owner_of",
    "owner_subkey",
]
