"""swarm command-line entry points (click)."""
