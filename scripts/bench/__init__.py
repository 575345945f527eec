"""Benchmarks of swarm: each prints a table, takes --json, and most run the same workload on
hivemind in the same invocation with --compare hivemind (the `bench` extra). Run from the
repository root as `python -m scripts.bench.<name>`; --help says what each measures."""
