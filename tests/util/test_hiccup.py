"""scripts/tools/hiccup.py: a benchmark's node stopped for a while, on a real process."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.tools.hiccup import Hiccup


@pytest.mark.parametrize(
    ("text", "expected"),
    [("3:60:8", Hiccup(3, 60.0, 8.0)), ("0:0:0.5", Hiccup(0, 0.0, 0.5))],
)
def test_a_hiccup_is_parsed(text: str, expected: Hiccup) -> None:
    assert Hiccup.parse(text) == expected


@pytest.mark.parametrize("text", ["", "3:60", "3:60:8:1", "x:1:1", "-1:1:1", "1:-1:1", "1:1:0", "1:nan:1"])
def test_a_bad_hiccup_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--hiccup"):
        Hiccup.parse(text)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.timeout(30)
def test_the_process_stops_for_a_while_and_always_resumes() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with Hiccup(0, 0.2, 60.0).applied(proc):
            deadline = time.monotonic() + 10
            while _state(proc.pid) != "T":
                assert time.monotonic() < deadline, "never stopped"
                time.sleep(0.05)
        # the block ended long before FOR: the process runs again at once
        assert _state(proc.pid) in ("S", "R")
    finally:
        proc.kill()
        proc.wait()
