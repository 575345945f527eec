"""swarm.utils.process_memory: the one reader of a process's memory (node metrics, benchmarks, tests)."""

from __future__ import annotations

import os
import sys

from swarm.utils import process_control
from swarm.utils.process_memory import pss_bytes, resident_bytes, status_kib


def test_this_process_reads_the_same_resident_set_both_ways() -> None:
    ballast = bytearray(64 << 20)  # 64 MiB touched: both readings must see it
    ballast[::4096] = b"x" * len(ballast[::4096])
    rss, vm_rss = resident_bytes(), status_kib("VmRSS") * 1024
    assert rss > 64 << 20
    assert abs(rss - vm_rss) < 8 << 20, (rss, vm_rss)
    assert status_kib("VmHWM") * 1024 >= vm_rss - (1 << 20)  # the peak is at least what is held now
    del ballast


def test_pss_sums_live_processes_and_counts_a_gone_one_as_zero() -> None:
    child = process_control.start([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        mine, both = pss_bytes([os.getpid()]), pss_bytes([os.getpid(), child.pid])
        assert 0 < mine < both
    finally:
        process_control.kill(child)
    assert pss_bytes([child.pid]) == 0
    assert status_kib("VmRSS", child.pid) == 0
