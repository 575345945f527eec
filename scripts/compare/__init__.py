"""The hivemind side of each comparison (`--compare hivemind`): the same workload on hivemind
1.1.12, driven by the benchmark of the same name in scripts/bench/."""
