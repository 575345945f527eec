"""Parts the benchmarks and tests share: a child driven by JSON lines (worker_process), a state
donor that does not train (state_seeder), the attackers (attacker, attacks), a CPU hog for busy
machines (hiccup), and the test suite's tiers (test_tiers)."""
