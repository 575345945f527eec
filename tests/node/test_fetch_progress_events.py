"""A node's fetch_progress events (swarm/node/events.py): at most one a second, and the 100% one
once per fetch (the fetcher reports 100% when the last bytes arrive and again once the last shard
is verified; the log printed the full line twice)."""

from __future__ import annotations

from swarm.node.events import Event, EventSink
from swarm.state.fetcher import FetchProgress


def _at(step: int, done: int, total: int = 100) -> FetchProgress:
    return FetchProgress(step, done, total, 1.0, 0, 1, 2)


def test_one_full_progress_event_per_fetch() -> None:
    seen: list[Event] = []
    sink = EventSink("peer", seen.append)
    for p in (_at(7, 10), _at(7, 20), _at(7, 100), _at(7, 100), _at(8, 50), _at(8, 100), _at(8, 100)):
        sink.fetch_progress(p)
    shown = [(e["outer_step"], e["done_bytes"]) for e in seen]
    # 20 and 50 come within a second of the one before: left out; each fetch's 100% once
    assert shown == [(7, 10), (7, 100), (8, 100)]
