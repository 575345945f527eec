"""The tunables of state exchange, one frozen config per component (torchtitan's nested style):

    KeeperConfig(shard_bytes=64 << 20, checkpoint_every=1, fetch=FetchConfig(timeout=120.0))

FetchConfig drives fetch_state (fetcher.py); KeeperConfig the StateKeeper (keeper.py), which
hands its `fetch` to every fetch it makes. Each checks its fields when it is built, so a bad
value fails where it is written, not in the middle of a fetch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True, slots=True)
class FetchConfig:
    """How fetch_state gets a state from its holders."""

    timeout: float = 60.0  # seconds: the manifest's reply, a shard stream's opening, each chunk
    streams_per_peer: int = 2  # shard downloads at once from one holder
    recruit_every: float = 2.0  # seconds between reads of the holders while shards are missing

    def __post_init__(self) -> None:
        for name in ("timeout", "recruit_every"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        if self.streams_per_peer < 1:
            raise ValueError(f"streams_per_peer must be >= 1, got {self.streams_per_peer}")


def _keeper_fetch() -> FetchConfig:
    return FetchConfig(timeout=120.0)  # a training node waits longer than fetch_state's default


@dataclass(frozen=True, kw_only=True, slots=True)
class KeeperConfig:
    """How a StateKeeper holds, advertises, checkpoints and fetches the swarm state."""

    shard_bytes: int  # the size of a snapshot's shards (checkpoint.make_snapshot)
    checkpoint_every: int = 1  # outer steps between local checkpoints (with a checkpoint dir)
    max_uploads: int = 4  # shards served at once (StateServer)
    advertise_ttl: float = 60.0  # seconds an advertisement lives; it is refreshed every third of it
    fetch: FetchConfig = field(default_factory=_keeper_fetch)
    # a node one step behind takes the step's update from its holders (update.py) before the whole state
    by_update: bool = True
    update_timeout: float = 10.0  # seconds: an update's stream opening and each chunk (then: the whole state)

    def __post_init__(self) -> None:
        for name in ("shard_bytes", "checkpoint_every", "max_uploads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("advertise_ttl", "update_timeout"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
