"""Benchmarks of swarm, most of them next to the same workload on hivemind 1.1.12 for a ratio in
one run (`--compare hivemind`, the `bench` extra: pip install -e '.[bench]').

Run each one as a module from the repository root, so that it imports its siblings as
`scripts.<name>` and the `swarm` beside it:

    python -m scripts.bench_p2p          # transport: RPC latency, stream throughput
    python -m scripts.bench_dht          # DHT: start, store, get, memory, churn; --simulate
    python -m scripts.bench_codec        # int8 codec throughput
    python -m scripts.bench_allreduce    # butterfly all-reduce, one process per member
    python -m scripts.bench_scale        # matchmaking + all-reduce, many members per process
    python -m scripts.bench_state        # state exchange: fetch rate and memory of a newcomer
    python -m scripts.bench_diloco       # swarm-node DiLoCo runs against data parallelism
    python -m scripts.diloco_sweep       # DiLoCo hyperparameters, simulated in one process
    python -m scripts.bench_robust       # training with one attacker (scripts.attacks)
    python -m scripts.bench_robust_reducer
    python -m scripts.overlap_sweep      # an overlapped outer step's cost in loss, simulated
    python -m scripts.fragment_sweep     # the same, syncing the model a fragment at a time
    python -m scripts.gpu_check          # a GPU machine checked in one command (one JSON line)

`--help` on each says what it measures; the README has the results. The other modules are
their parts: worker_process (a child driven by JSON lines), hivemind_* (the hivemind side of each
comparison), hivemind_procs (finding and cleaning up hivemind's processes and socket files),
state_seeder (a state donor that does not train, also used by the tests), attacker / attacks.
Children are started, read and stopped through swarm.utils.process_control.
"""
