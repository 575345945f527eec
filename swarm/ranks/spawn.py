"""The rank processes that rank 0 of `swarm-node --nproc-per-node N` starts, and its watchdog.

    store, ranks = SpawnedRanks.start(launch, timeout=120.0)   # ranks 1..N-1, on 127.0.0.1
    group = RankGroup.open(launch, timeout=120.0, store=store)
    ranks.dead()            # "rank 1 (pid 4242) exited: killed by signal 9", or None
    ranks.close(grace=10)   # after STOP they exit themselves; whatever still runs is stopped
    ranks.kill()            # on an error: SIGKILL, no grace

Rank 0 makes the TCPStore on a free port of 127.0.0.1 before it starts the others, so no port
is guessed. Each rank runs `python -m swarm.ranks.follower` in its own session (a Ctrl+C on the
terminal reaches rank 0 only, which stops them in order) and gets SIGTERM should rank 0 die
(die_with_parent): no rank outlives its node. Their stderr is rank 0's, and so is their network
namespace. When rank 0 was itself forked from the preloaded server (swarm-sim's nodes, the
tests'), the same server forks them, torch already imported; otherwise they are exec'd
(swarm/utils/preloaded.py).
"""

from __future__ import annotations

import datetime
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from swarm.ranks.launch import RankLaunch
from swarm.utils import process_control

__all__ = ["SpawnedRanks"]

STOP_GRACE_S = 10.0


class SpawnedRanks:
    """Ranks 1..N-1 as child processes (see the module docstring)."""

    def __init__(self, procs: Sequence[subprocess.Popen[Any]]) -> None:
        self.procs = list(procs)  # procs[i] is rank i + 1

    @classmethod
    def start(cls, launch: RankLaunch, *, timeout: float) -> tuple[dist.TCPStore, SpawnedRanks]:
        store = dist.TCPStore(launch.master_addr, 0, launch.world_size, is_master=True,
                              timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)  # fmt: skip
        procs: list[subprocess.Popen[Any]] = []
        try:
            for rank in range(1, launch.world_size):
                device = f"cuda:{rank}" if launch.backend == "nccl" else "cpu"
                argv = [sys.executable, "-m", "swarm.ranks.follower", "--rank", str(rank), "--world-size",
                        str(launch.world_size), "--port", str(store.port), "--device", device, "--backend",
                        launch.backend, "--timeout", f"{timeout:g}"]  # fmt: skip
                procs.append(process_control.start(argv, stdin=subprocess.DEVNULL, die_with_parent=True))
        except BaseException:
            process_control.stop_all(procs, 0.0)
            raise
        return store, cls(procs)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def dead(self) -> str | None:
        """A line naming the first rank that has exited, or None while all run."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
                return f"rank {rank} of this node (pid {proc.pid}) exited: {how}"
        return None

    def close(self, grace: float = STOP_GRACE_S) -> None:
        """Wait up to `grace` for the ranks to exit (after STOP they do), then stop the rest:
        SIGTERM, SIGKILL a few seconds later, every one reaped."""
        late = process_control.wait_all(self.procs, grace)
        process_control.stop_all(late, 5.0, term=signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL every rank still running, and reap it: a node leaving on an error. Its ranks hold
        nothing to keep (rank 0 holds the node's state and writes its checkpoints), and one that
        hung, or waits in a collective that will not complete, answers neither STOP nor SIGTERM:
        close() would wait out its grace and SIGTERM's for nothing."""
        process_control.stop_all(self.procs, 0.0, term=None)
