"""swarm.dht: not built yet (see the open issues)."""
