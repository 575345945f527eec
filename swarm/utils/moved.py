"""Modules that moved keep their old import path for one release, with a DeprecationWarning.

`import swarm.eventloop` finds `swarm.utils.eventloop` through a finder on sys.meta_path; the old
name is then the same module object (one module, not a copy whose globals would drift apart).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED = {  # old name -> new name: the node package and the shared helpers
    "swarm.outer_step": "swarm.node.loop",
    "swarm.step_end": "swarm.node.step_end",
    "swarm.plan": "swarm.node.plan",
    "swarm.progress": "swarm.node.progress",
    "swarm.run_lookup": "swarm.node.run_lookup",
    "swarm.node_config": "swarm.node.config",
    "swarm.node_events": "swarm.node.events",
    "swarm.user_steps": "swarm.node.inner_steps",
    "swarm.trainer": "swarm.node.training_thread",
    "swarm.node.permits": "swarm.node.inner_steps",  # one concept, one name: the inner steps' permits
    "swarm.node.data_loop": "swarm.node.training_thread",  # and the thread that spends them
    "swarm.model.run_settings": "swarm.node.settings",  # the run settings' one owner
    "swarm.eventloop": "swarm.utils.eventloop",
    "swarm.supervised": "swarm.utils.supervised",
    "swarm.log_once": "swarm.utils.log_once",
    "swarm.process_control": "swarm.utils.process_control",
    "swarm.process_memory": "swarm.utils.process_memory",
    # averaging/ in subpackages (swarm.averaging.matchmaking is now the package; its module is .matchmaker)
    "swarm.averaging.ready": "swarm.averaging.matchmaking.ready",
    "swarm.averaging.ready_board": "swarm.averaging.matchmaking.ready_board",
    "swarm.averaging.liveness": "swarm.averaging.matchmaking.liveness",
    "swarm.averaging.allreduce": "swarm.averaging.rounds.flat",
    "swarm.averaging.hierarchical": "swarm.averaging.rounds.grid",
    "swarm.averaging.grid": "swarm.averaging.rounds.grid_shape",
    "swarm.averaging.grid_serving": "swarm.averaging.rounds.grid_serving",
    "swarm.averaging.round_member": "swarm.averaging.rounds.member",
    "swarm.averaging.round_streams": "swarm.averaging.rounds.streams",
    "swarm.averaging.registry": "swarm.averaging.rounds.registry",
    "swarm.averaging.partition": "swarm.averaging.rounds.partition",
    "swarm.averaging.reduction": "swarm.averaging.rounds.reduction",
    "swarm.averaging.bandwidth": "swarm.averaging.rounds.bandwidth",
    "swarm.averaging.audit_round": "swarm.averaging.audit.flat",
    "swarm.averaging.grid_audit": "swarm.averaging.audit.grid",
}


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new}; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)  # fmt: skip
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """The module was executed under its new name already."""


class MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(new))


def install() -> None:
    """Once per process: swarm/__init__.py calls it."""
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedFinder())
