"""swarm.averaging: not built yet (see the open issues)."""
