"""swarm.averaging: DHT matchmaking and the fault-tolerant butterfly all-reduce of a group."""

from swarm.averaging.allreduce import AllReduceError, RoundReport
from swarm.averaging.averager import Averager, GroupReport
from swarm.averaging.config import AveragingConfig
from swarm.averaging.errors import AuditError
from swarm.averaging.messages import GroupInfo, MemberInfo

__all__ = [
    "AllReduceError",
    "AuditError",
    "Averager",
    "AveragingConfig",
    "GroupInfo",
    "GroupReport",
    "MemberInfo",
    "RoundReport",
]
