"""Commands whose issue has not landed must say so and fail, never pretend to work."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("command", ["swarm-node", "swarm-sim"])
def test_pending_commands_exit_nonzero_with_one_line(command: str) -> None:
    beside_python = Path(sys.executable).parent / command  # the venv's scripts, activated or not
    path = str(beside_python) if beside_python.exists() else shutil.which(command)
    assert path is not None, f"{command} is not installed as a console script"
    result = subprocess.run(
        [path, "--initial-peers", "/ip4/127.0.0.1/tcp/1"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "not available yet" in lines[0] and "issue #" in lines[0]
