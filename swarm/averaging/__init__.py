"""swarm.averaging: DHT matchmaking and the fault-tolerant butterfly all-reduce of a group.

    averager.py    Averager: what the node calls once per outer step (form a group, run its round)
    config.py      AveragingConfig;  errors.py: the errors a round raises;  messages.py: the wire values
    robust.py      the bounded-influence aggregate every part owner computes
    matchmaking/   who averages: the DHT protocol, the pure rules of readiness, liveness
    rounds/        how: the flat and the grid butterfly, their parts, streams and registry
    audit/         checking the part owners: the arithmetic, and its flat and grid rounds

The names below load on first use (PEP 562), so that `swarm.averaging.config` (no torch) is
quick to import for the command line's checks."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "AllReduceError": "errors",
    "RoundReport": "rounds.member",
    "Averager": "averager",
    "GroupReport": "averager",
    "AveragingConfig": "config",
    "AuditError": "errors",
    "GroupInfo": "messages",
    "MemberInfo": "messages",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'swarm.averaging' has no attribute {name!r}")
    return getattr(importlib.import_module(f"swarm.averaging.{_WHERE[name]}"), name)
