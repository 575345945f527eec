"""One training process of the swarm: the node and its parts.

    node.py        SwarmNode: starts a run's services, trains, stops (the public face)
    model_setup.py what it trains: its data, model, error feedback, DiLoCo around the model
    starting.py    nodes that start a run together (--start-with, swarm.join's wait_for_peers)
    context.py     RunContext (the run's services, fixed) and StepFacts (the step's mutable facts)
    loop.py        OuterLoop: the outer step, top to bottom: plan, matchmaking, the round, landing
    grouping.py    the step's matchmaking: whom to expect, the wait for slower peers, the fork check
    step_end.py    StepEnd: what happens when a round lands or fails: apply, fetch, or step alone
    view.py        SwarmView: the peers' records read as the plans' facts, and our own record
    plan.py        pure decisions of the loop (when to announce, how long to wait), clock passed in
    progress.py    the progress records of the run's nodes in the DHT
    run_lookup.py  which run a node joins and with whose settings
    config.py      NodeConfig: every setting of a node, checked when built
    settings.py    RunSettings: what every node of a run must agree on, one digest, one comparison
    reachability.py  how peers reach this node: dial-back, relays, hole punching
    relay_records.py the relays the run's nodes advertise in the DHT
    events.py      the events a node emits (JSON lines for the CLI, metrics)
    inner_steps.py InnerSteps: the permits of the inner steps, spent by the training thread
    training_thread.py  TrainingThread, and swarm-node's own on its data (DataTrainingThread)
    errors.py      NodeError

`from swarm.node import SwarmNode` imports torch on first use only: the CLIs check their flags
before paying for it, and the light modules here (config, plan) import nothing heavy.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarm.node.errors import NodeError
    from swarm.node.events import Event
    from swarm.node.node import SwarmNode

__all__ = ["Event", "NodeError", "SwarmNode"]
_HOME = {"Event": "swarm.node.events", "NodeError": "swarm.node.errors", "SwarmNode": "swarm.node.node"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        import importlib

        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'swarm.node' has no attribute {name!r}")
