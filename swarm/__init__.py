"""swarm: a peer-to-peer DiLoCo training swarm for PyTorch (see DESIGN in the repository)."""

__version__ = "0.1.0"

from typing import TYPE_CHECKING, Any

from swarm.utils import moved

moved.install()

if TYPE_CHECKING:
    from swarm.api import SwarmSession, join

__all__ = ["SwarmSession", "join"]


def __getattr__(name: str) -> Any:
    """`swarm.join` imports torch and the node on first use: the CLIs check their flags first."""
    if name in __all__:
        from swarm import api

        return getattr(api, name)
    raise AttributeError(f"module 'swarm' has no attribute {name!r}")
