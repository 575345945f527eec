"""swarm.averaging: DHT matchmaking and the fault-tolerant butterfly all-reduce of a group.

The names below load on first use (PEP 562), so that `swarm.averaging.config` (no torch) is
quick to import for the command line's checks."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "AllReduceError": "allreduce",
    "RoundReport": "round_member",
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
