"""`python -m scripts.soak`: the soak (swarm/cli/soak.py, also `swarm-sim --soak`)."""
