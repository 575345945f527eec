"""A local network of shaped links: each process in a Linux network namespace of its own, joined
to the others by a veth pair and a bridge, its traffic limited by tc in both directions
(DESIGN.md "Links"; swarm-sim --link). Pure stdlib: rates.py parses rates, plan.py plans the
names, addresses and commands, lab.py runs them and removes them again.
"""

from swarm.netlab.lab import Lab, LabError, exec_prefix, missing, missing_nat, remove_leftovers
from swarm.netlab.nat import NAT_KINDS, Home
from swarm.netlab.plan import PREFIX, Endpoint, LabPlan, plan_lab
from swarm.netlab.rates import Rate, parse_rate, parse_rates

__all__ = [
    "NAT_KINDS",
    "PREFIX",
    "Endpoint",
    "Home",
    "Lab",
    "LabError",
    "LabPlan",
    "Rate",
    "exec_prefix",
    "missing",
    "missing_nat",
    "parse_rate",
    "parse_rates",
    "plan_lab",
    "remove_leftovers",
]
