"""The examples run as the docs say: 3 real processes each, one state on all, the loss falls."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "one state on every process: yes; the loss fell: yes" in done.stdout, done.stdout
    return done.stdout


@pytest.mark.swarm
@pytest.mark.timeout(420)
def test_the_custom_model_example_agrees_across_three_processes() -> None:
    out = run_example("custom_model.py", "--outer-steps", "4", "--inner-steps", "10")
    assert out.count("(finished, exit 0)") == 3


@pytest.mark.swarm
@pytest.mark.timeout(420)
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="the [hf] extra is not installed")
def test_the_transformers_example_agrees_across_three_processes() -> None:
    out = run_example("hf_transformers.py", "--outer-steps", "3", "--inner-steps", "10")
    assert out.count("(finished, exit 0)") == 3
