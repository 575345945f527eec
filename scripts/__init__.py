"""Scripts beside the package, run as modules from the repository root so that they import each
other as `scripts.<folder>.<name>` and the `swarm` beside them:

    bench/        benchmarks, each with --json and most with --compare hivemind (the `bench` extra)
    compare/      the hivemind side of each comparison (hivemind 1.1.12)
    experiments/  sweeps simulated in one process, and the one-command GPU check
    tools/        parts they and the tests share: worker_process, state_seeder, attackers,
                  hiccup (a CPU hog), test_tiers (the suite by tier, against its budgets)

    python -m scripts.bench.p2p          # transport: RPC latency, stream throughput
    python -m scripts.bench.dht          # DHT: start, store, get, memory, churn; --simulate
    python -m scripts.bench.codec        # int8 codec throughput
    python -m scripts.bench.allreduce    # butterfly all-reduce, one process per member
    python -m scripts.bench.scale        # matchmaking + all-reduce, many members per process
    python -m scripts.bench.state        # state exchange: fetch rate and memory of a newcomer
    python -m scripts.bench.diloco       # swarm-node DiLoCo runs against data parallelism
    python -m scripts.bench.robust       # training with one attacker (scripts.tools.attacks)
    python -m scripts.bench.lineage      # what round receipts cost: bytes and verification time
    python -m scripts.bench.data         # data: prepare and loader throughput, chunk-claim latency
    python -m scripts.experiments.diloco_sweep     # DiLoCo hyperparameters, simulated in one process
    python -m scripts.experiments.overlap_sweep    # an overlapped outer step's cost in loss, simulated
    python -m scripts.experiments.gpu_check        # a GPU machine checked in one command (one JSON line)
    python -m scripts.experiments.gpu_efficacy     # DiLoCo against data-parallel training on one GPU (--dry-run: CPU)

`--help` on each says what it measures; the docs' benchmark pages have the results. Children are
started, read and stopped through swarm.utils.process_control.
"""
