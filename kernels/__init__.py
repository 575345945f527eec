"""swarm_kernels: the int8 codec (not built yet: see the open issues)."""
