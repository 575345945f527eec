"""swarm.model: not built yet (see the open issues)."""
