"""scripts/bench/state.py end to end on the tiny preset: a bootstrap node, one state_seeder donor,
one newcomer process, the loopback limit, and the JSON it prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # `python -m scripts.bench.state` runs from there


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_tiny_state_from_one_peer_prints_the_json_keys(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "scripts.bench.state", "--model", "tiny", "--peers", "1", "--repeat", "1",
               "--json", "--dest", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("state_MB", "loopback_MBps", "fetch_MBps_1", "peak_rss_MB_1"):
        assert isinstance(out[key], float) and out[key] > 0, key
    assert 10 < out["state_MB"] < 11  # tiny: 1.31M parameters, twice (θ_outer, momentum), fp32
    (run,) = out["detail"]["runs"]["1"]
    assert run["fetched_bytes"] == run["bytes"] and not run["corrupt_peers"] and not run["failed_peers"]
    assert run["peak_rss_MB"] >= run["baseline_rss_MB"] > 0
    assert list(tmp_path.iterdir()) == []  # fetched files and logs are deleted
