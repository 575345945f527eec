"""What a state fetch tells its caller: the errors it raises, its progress while it runs, its report at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm.p2p.peer_id import PeerID


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
