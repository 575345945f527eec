"""The soak's short form (`python -m scripts.soak`), CI's soak tier: a churned swarm of
swarm-node processes for a few minutes, and every invariant of the report holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.utils import process_control

ROOT = Path(__file__).resolve().parents[2]
MINUTES = 5.0
NODES = 6  # 12 do not start and train in the tier's budget on a 2-core machine
pytestmark = pytest.mark.soak


@pytest.mark.timeout(415)
def test_a_churned_swarm_keeps_its_invariants(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "scripts.soak", "--nodes", str(NODES), "--minutes", str(MINUTES), "--json",
               "--run-dir", str(tmp_path)]  # fmt: skip
    proc = process_control.start(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, text=True)
    try:
        out, err = proc.communicate(timeout=400)
    finally:
        process_control.stop_all([proc], 30.0, group=True, reap_s=10.0)  # the soak stops its nodes on SIGTERM
    assert out.strip(), f"the soak printed no report (exit {proc.returncode}): {err[-3000:]}"
    report = json.loads(out.splitlines()[-1])
    assert report["figures"]["churn"]["events"] >= 4, report["figures"]
    assert report["figures"]["steps"]["last"] >= 3, report["figures"]
    assert not any(report["invariants"].values()), report["invariants"]
    assert proc.returncode == 0, err[-2000:]
    assert (tmp_path / "soak.png").stat().st_size > 0
