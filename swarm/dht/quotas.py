"""Storage quotas: what one peer may make a node store, and who keeps a place under a full key.

Two attacks shaped these rules: one peer storing 6,000 unowned 60 KiB records (all
were kept: memory grew to 400 MiB), and 1,000 throwaway identities each signing a record under
`<run>/nodes` (the key filled up, an honest node's own record was refused, readers got 1,000
fakes). The rules, applied by RecordStorage.put:

- bytes: a record costs len(key) + len(subkey) + len(value) + len(signature) + RECORD_OVERHEAD.
  A store holds at most max_bytes in all, and one source peer (the sender of the dht.store) at
  most max_records_per_source records and max_bytes_per_source bytes; past its own quota a
  source is refused. When the whole store is full, the source holding the most bytes loses its
  record that expires first (max-min fairness: a peer below everyone else's share always gets
  in); if that source is the newcomer's own, the newcomer is refused.
- subkeys of one key (subkey_admission, a pure function): an entry's standing is whether its
  owner (the sender, for an unowned subkey) holds a costly DHT id (a proof of work this node
  verified) and whether it talked to this node within the liveness window. One source may hold
  at most max_per_source entries of a key; owners without a costly id share at most
  max_unproven entries of a key; a full key drops its lowest-ranked entry (no costly id first,
  then not seen alive, then the newest) if the newcomer ranks higher, else refuses it.

So a flood of throwaway identities holds at most max_unproven entries of any key (readers see
at most that many fakes), and a node with a costly id is never refused for a key full of them.
Known limit: identities that each pay the proof of work (2^id_bits hashes) rank like honest
nodes; then only the liveness rank and the per-key cap stand between them and a full key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from swarm.dht.config import DHTConfig
from swarm.dht.ids import Key
from swarm.dht.records import Record
from swarm.p2p.peer_id import PeerID

Subkey = Key | None
RECORD_OVERHEAD = 800  # Python objects per stored record: ~600 B of indexes + ~200 B Record (tracemalloc)


def record_bytes(record: Record) -> int:
    sizes = (record.key, record.subkey or b"", record.value, record.signature or b"")
    return sum(len(part) for part in sizes) + RECORD_OVERHEAD


@dataclass(frozen=True, kw_only=True, slots=True)
class Quotas:
    max_bytes: int
    max_records_per_source: int
    max_bytes_per_source: int
    max_per_source: int  # entries of one key from one source
    max_unproven: int  # entries of one key whose owner holds no costly id
    liveness_window: float

    @classmethod
    def from_config(cls, config: DHTConfig) -> Quotas:
        return cls(
            max_bytes=config.max_storage_bytes,
            max_records_per_source=config.max_records_per_source,
            max_bytes_per_source=config.max_bytes_per_source,
            max_per_source=config.max_subkeys_per_source_per_key,
            max_unproven=config.max_unproven_subkeys_per_key,
            liveness_window=config.liveness_window,
        )


@dataclass(frozen=True, slots=True)
class Standing:
    """What this node knows of a peer: a verified costly id, and when it last talked to us."""

    proven: bool
    last_seen: float  # time.time(); -inf when never


NEVER_SEEN = Standing(False, float("-inf"))
StandingFn = Callable[[PeerID], Standing]


class PeerStandings:
    """The standing of the peers this node heard from, least recently heard first; bounded
    (the oldest are forgotten: a peer not heard from for that long has no standing left)."""

    def __init__(self, max_peers: int = 1 << 16) -> None:
        self.max_peers = max_peers
        self._peers: OrderedDict[PeerID, Standing] = OrderedDict()

    def heard_from(self, peer: PeerID, now: float, *, proven: bool) -> None:
        known = self._peers.pop(peer, NEVER_SEEN)
        self._peers[peer] = Standing(proven or known.proven, now)
        if len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)

    def __call__(self, peer: PeerID) -> Standing:
        return self._peers.get(peer, NEVER_SEEN)


@dataclass(frozen=True, slots=True)
class SubkeyFacts:
    """One entry of a key (or a newcomer for it), as subkey_admission sees it."""

    subkey: Subkey
    source: PeerID | None  # who sent it to this node (None: this node itself)
    proven: bool  # its owner (the source, if unowned) holds a costly id
    alive: bool  # its owner (the source, if unowned) talked to this node within the window
    stored_at: float


def keep_rank(facts: SubkeyFacts) -> tuple[bool, bool, float]:
    """Higher keeps its place: a costly id, then seen alive, then the longest established."""
    return (facts.proven, facts.alive, -facts.stored_at)


@dataclass(frozen=True, slots=True)
class Admission:
    """The plan for a newcomer subkey: refused (reason), or admitted after evicting `evict`."""

    admit: bool
    evict: Subkey | None = None  # never None for a real subkey: only plain values have none
    reason: str = ""


def subkey_admission(
    entries: list[SubkeyFacts], newcomer: SubkeyFacts, *, max_subkeys: int, max_per_source: int, max_unproven: int
) -> Admission:
    """Whether a newcomer subkey gets into a key holding `entries` (the newcomer's own subkey
    is not among them), and whom it displaces. Rules in the module docstring."""
    if newcomer.source is not None:
        same_source = sum(e.source == newcomer.source for e in entries)
        if same_source >= max_per_source:
            return Admission(False, reason=f"the sender already holds {max_per_source} entries of this key")
    if not newcomer.proven:
        unproven = [e for e in entries if not e.proven]
        if len(unproven) >= max_unproven:
            return _displace(unproven, newcomer, f"{max_unproven} entries of owners without a costly id")
    if len(entries) >= max_subkeys:
        return _displace(entries, newcomer, f"the key holds {max_subkeys} entries that rank higher")
    return Admission(True)


def _displace(group: list[SubkeyFacts], newcomer: SubkeyFacts, why: str) -> Admission:
    victim = min(group, key=keep_rank)
    if keep_rank(newcomer) > keep_rank(victim):
        return Admission(True, evict=victim.subkey)
    return Admission(False, reason=why)


def fair_share_victim(bytes_by_source: dict[PeerID | None, int], newcomer: PeerID | None) -> PeerID | None:
    """The source that loses a record when the whole store is full: the one holding the most
    bytes. Raises LookupError when that is the newcomer's own source (or nobody holds any)."""
    candidates = [(size, source) for source, size in bytes_by_source.items() if size > 0]
    if not candidates:
        raise LookupError("nothing to evict")
    _, largest = max(candidates, key=lambda item: item[0])
    if largest == newcomer or bytes_by_source.get(newcomer, 0) >= bytes_by_source[largest]:
        raise LookupError("the newcomer's source holds the largest share")
    return largest
