"""swarm: a peer-to-peer DiLoCo training swarm for PyTorch (see DESIGN in the repository)."""

__version__ = "0.1.0"
