"""One swarm node, many local ranks: DiLoCo across the swarm, torch.distributed inside the node.

    swarm-node --nproc-per-node 2 ...                  # starts ranks 1..N-1 itself (127.0.0.1)
    swarm-node --nproc-per-node 2 --shard ...          # FSDP2: each rank holds 1/N of the model
    torchrun --nproc-per-node 8 -m swarm.cli.node ...  # or torchrun starts every rank

Rank 0 runs the SwarmNode (DHT, matchmaking, all-reduce, state serving, checkpoints); every rank
runs the inner steps under DDP on its own rows of the node's batch. DDP keeps the parameters and
the inner AdamW identical on every rank, so rank 0's pseudo-gradient already is the node's: no
gather, and the swarm sees one node of unchanged bytes. Rank 0 drives the others with a tiny
command protocol (commands.py) from its training thread; whenever its parameters change outside
an inner step (an outer step, a fetched state, a resumed checkpoint) it broadcasts them.

    launch.py    where this process stands (spawn, torchrun, one rank): a pure decision
    commands.py  the command protocol rank 0 speaks: a spec with encode/decode
    group.py     the process group: rendezvous with a timeout, hello, commands, broadcasts
    step.py      one inner step of one rank: its rows of the node's batch, DDP forward/backward
    shard.py     --shard: FSDP2 instead of DDP; rank 0's full mirror, gathered and scattered
    leader.py    rank 0's training thread (the DataTrainingThread of a multi-rank node)
    follower.py  ranks 1..N-1: follow the commands until STOP
    spawn.py     the rank processes rank 0 starts, and its watchdog over them
"""
