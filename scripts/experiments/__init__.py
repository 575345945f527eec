"""Experiments that are not head-to-head benchmarks: hyperparameter sweeps simulated in one
process, and the GPU check (one command on a lent GPU machine, one JSON line)."""
