"""The README's swarm.join snippet runs as written: extracted from README.md, given a model, its
batches and a loss (the names it leaves to the reader), and run as `python train.py` once, then
twice more with the line the first printed. The three train together from their first step
(the snippet's own barrier, wait_for_peers) and end after the same outer step (the run's length,
max_outer_steps, shortened here), holding one state."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.utils import process_control
from tests.children import child_env

README = Path(__file__).resolve().parents[2] / "README.md"
OUTER_STEPS = 3  # the run's length, in place of the snippet's max_outer_steps

# what the snippet leaves to the reader: a model, its batches (each process its own), a loss
PRELUDE = """
import os
import torch
from torch import nn

def MyModel():
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

def my_batches():  # endless: the run's length ends the loop (a process that arrived while the
    # others trained spends fewer batches on its first step, so a fixed count would end it later)
    generator = torch.Generator().manual_seed(os.getpid())
    while True:
        x = torch.randn(16, 8, generator=generator)
        yield x, x.sum(dim=1, keepdim=True).tanh()

my_loss = nn.functional.mse_loss
"""
# what the test reads once the snippet is done
EPILOGUE = """
import json
print(json.dumps({"outer_step": session.outer_step, "state": session.state_sha256()}), flush=True)
"""


def readme_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    snippet = next(b for b in blocks if "swarm.join(" in b)
    assert "wait_for_peers(3" in snippet and "sys.argv[1:]" in snippet, snippet
    shortened, found = re.subn(r"max_outer_steps=\d+", f"max_outer_steps={OUTER_STEPS}", snippet)
    assert found == 1, snippet  # the snippet gives the run a length: without one the processes end apart
    return shortened


@pytest.mark.swarm
@pytest.mark.timeout(400)
def test_the_readme_snippet_trains_three_processes_together(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(PRELUDE + readme_snippet() + EPILOGUE)
    env = child_env(OMP_NUM_THREADS="1", XDG_CONFIG_HOME=str(tmp_path / "config"))
    procs: list[subprocess.Popen[str]] = []

    def start(*peers: str) -> subprocess.Popen[str]:
        proc = process_control.start([sys.executable, str(script), *peers], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)  # fmt: skip
        procs.append(proc)
        return proc

    try:
        first = start()
        assert first.stdout is not None
        line = first.stdout.readline()  # printed before any wait: the others need it
        assert line.startswith("join with: python train.py /ip4/"), line
        peers = line.split()[4:]
        others = [start(*peers), start(*peers)]
        results = []
        for proc in [first, *others]:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        process_control.stop_all(procs, 15.0)
    assert [r["outer_step"] for r in results] == [OUTER_STEPS] * 3, results
    assert len({r["state"] for r in results}) == 1, results  # they averaged: one state on all three
