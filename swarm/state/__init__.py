"""swarm.state: not built yet (see the open issues)."""
