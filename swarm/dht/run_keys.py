"""The DHT keys a training run publishes under, in one place (every key starts with the run id).

    <run>/nodes     subkey [owner:<PeerID>]  -> {"maddrs": [...], "step": outer step, "client": bool, ...}
    <run>/state     subkey [owner:<PeerID>]  -> {"step": step held, "manifest": sha256 hex, "maddrs": [...]}
    <run>/ready/<N> subkey [owner:<PeerID>]  -> matchmaking announcements for outer step N
    <run>/receipts/<N> subkey [owner:<PeerID>] -> {"g": group id, "r": result state, "s": signature}:
                    a member's signature of its round of outer step N (state/lineage_book.py)

    <run>/chunks    subkey [owner:<PeerID>]  -> {"epoch": ..., "live": [[chunk, at], ...], "done": ...}:
                    the data chunks a node claims and has trained (data/claims.py)

    runs            subkey [owner:<PeerID>]  -> {"run": run id, "model": ..., "step": ...}: which runs
                    this DHT carries (every training node lists its own; no slash: never a run's key)
    relays          subkey [owner:<PeerID>]  -> {"maddrs": [...], "proof": ...}: the nodes that relay for
                    NATed ones, for every run of this DHT (node/relay_records.py owns it)

Each value is a map; later layers may add fields, and readers ignore fields they don't know.
`swarm-dht inspect --run-id RUN` shows the first two; `swarm-dht inspect` lists the runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from swarm.dht.errors import RecordError
from swarm.dht.id_proof import BadIdProof, verify
from swarm.dht.records import owner_of
from swarm.dht.ttl_caps import RUNS_KEY
from swarm.p2p.peer_id import PeerID

MAX_RUN_ID_CHARS = 128
__all__ = ["RUNS_KEY", "check_run_id", "chunks_key", "nodes_key", "owned_map", "ready_key", "receipts_key", "state_key"]


Owned = tuple[PeerID, dict[str, Any]]  # a run record's owner and its map


def owned_map(subkey: Any, value: Any) -> Owned | None:
    """(owner, value) of a run record: a map under an [owner:<PeerID>] subkey; None otherwise
    (records are peers' input: a malformed one is skipped, never raised on)."""
    try:
        peer = owner_of(subkey)
    except RecordError:
        return None
    if peer is None or not isinstance(value, dict):
        return None
    return peer, value


def proven_map(subkey: Any, value: Any, id_bits: int | None, *,
               unproven: Callable[[PeerID, BadIdProof], Any] | None = None) -> Owned | None:  # fmt: skip
    """owned_map of a record whose "proof" field is its owner's proof of a costly id (id_proof.py);
    None when malformed or unproven (told to `unproven`): a record only a costly identity may
    write. `id_bits` None: the proof is not checked (a display of the records)."""
    owned = owned_map(subkey, value)
    if owned is None or id_bits is None:
        return owned
    try:
        verify(owned[0], owned[1].get("proof"), id_bits)
    except BadIdProof as e:
        if unproven is not None:
            unproven(owned[0], e)
        return None
    return owned


def check_run_id(run_id: str) -> str:
    if not run_id or len(run_id) > MAX_RUN_ID_CHARS or not run_id.isprintable() or "/" in run_id:
        raise ValueError(f"a run id is 1 to {MAX_RUN_ID_CHARS} printable characters without '/'")
    return run_id


def nodes_key(run_id: str) -> str:
    return f"{check_run_id(run_id)}/nodes"


def state_key(run_id: str) -> str:
    return f"{check_run_id(run_id)}/state"


def ready_key(run_id: str, step: int) -> str:
    return f"{check_run_id(run_id)}/ready/{int(step)}"


def chunks_key(run_id: str) -> str:
    return f"{check_run_id(run_id)}/chunks"


def receipts_key(run_id: str, step: int) -> str:
    return f"{check_run_id(run_id)}/receipts/{int(step)}"
