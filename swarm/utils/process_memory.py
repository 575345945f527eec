"""How much memory a process holds, from Linux's /proc (the one reader for the node's metrics,
the benchmarks and the memory-bound tests).

- resident_bytes(): this process's resident set now (the node's `rss_bytes` metric);
- status_kib("VmHWM", pid): a field of /proc/<pid>/status (VmRSS now, VmHWM its peak), in KiB;
- pss_bytes(pids): the summed proportional set size (shared pages split between their users),
  what a swarm of processes costs together without counting shared libraries once per process.

A process that is gone, or a system without /proc, reads as 0 (resident_bytes falls back to the
peak from getrusage). Pure stdlib.
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterable


def resident_bytes() -> int:
    """This process's resident memory now (Linux /proc), else its peak (getrusage)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def status_kib(field: str, pid: int | str = "self") -> int:
    """A `VmRSS:`-style field of /proc/<pid>/status, in KiB (0 when the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def pss_bytes(pids: Iterable[int]) -> int:
    """Summed PSS of live processes, from /proc/<pid>/smaps_rollup (those gone count 0)."""
    total_kib = 0
    for pid in pids:
        with contextlib.suppress(OSError, StopIteration), open(f"/proc/{pid}/smaps_rollup") as f:
            total_kib += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    return total_kib * 1024
