"""A node that stops for a few seconds in the middle of a run (a GC pause, a laptop lid, a
stalled disk), for the benchmarks: `--hiccup NODE:AT:FOR` sends node NODE's process SIGSTOP
AT seconds after the nodes start and SIGCONT FOR seconds later. Its group forms without it, and
it has to catch up (state/update.py, or the whole state with --catch-up state).

    hiccup = Hiccup.parse("3:60:8")
    with hiccup.applied(proc):   # proc: the node's Popen (its pid is the node's: ip netns exec execs)
        proc.wait()
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Hiccup:
    node: int
    at_s: float
    for_s: float

    @classmethod
    def parse(cls, text: str) -> Hiccup:
        """NODE:AT:FOR, e.g. "3:60:8"; ValueError otherwise."""
        try:
            node, at_s, for_s = text.split(":")
            hiccup = cls(int(node), float(at_s), float(for_s))
        except ValueError:
            raise ValueError(f"--hiccup {text!r}: expected NODE:AT_SECONDS:FOR_SECONDS, e.g. 3:60:8") from None
        if hiccup.node < 0 or not hiccup.at_s >= 0 or not hiccup.for_s > 0:
            raise ValueError(f"--hiccup {text!r}: a node index >= 0, AT >= 0 and FOR > 0 seconds")
        return hiccup

    @contextlib.contextmanager
    def applied(self, proc: subprocess.Popen[bytes]) -> Iterator[None]:
        """Stop `proc` at `at_s` for `for_s` seconds while the block runs; it is always resumed
        when the block ends (a stopped process would not exit on SIGTERM)."""
        done = threading.Event()

        def pause() -> None:
            if done.wait(self.at_s):
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGSTOP)
            done.wait(self.for_s)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)

        thread = threading.Thread(target=pause, name="hiccup", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
