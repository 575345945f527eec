"""Refusals first: a swarm-node whose run settings contradict the run's is refused right after it
reads the run's records, before torch, the data or the model load, so the refusal is its first
line and comes in seconds even beside a training swarm on a machine under CPU load."""

from __future__ import annotations

import subprocess
import time

import pytest

from swarm.utils import process_control
from swarm.utils.process_control import console_script
from tests.node.conftest import ENV, FAST, LOOPBACK, Swarm

REFUSAL_S = 3.0


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_a_node_of_other_settings_is_refused_first_and_in_seconds_beside_a_busy_swarm(swarm: Swarm) -> None:
    bootstrap = swarm.start_bootstrap()
    swarm.node("first", "--run-id", "busy", "--inner-steps", "5")
    # its progress record is in the DHT once it has published one (a network event goes with each)
    swarm.wait_for(lambda: bool(swarm.events("first", "network")), 180, "the first node's progress record")
    with process_control.busy(2):
        began = time.monotonic()
        refused = subprocess.run(
            [console_script("swarm-node"), "--run-id", "busy", "--inner-steps", "7", "--initial-peers", bootstrap,
             "--host-maddrs", LOOPBACK, *FAST, "--identity", str(swarm.workdir / "refused.key")],
            capture_output=True, text=True, env=ENV, timeout=120,
        )  # fmt: skip
        took = time.monotonic() - began
    assert refused.returncode == 1, refused.stderr
    lines = (refused.stdout + refused.stderr).strip().splitlines()
    assert lines[0].startswith("swarm-node: error: this run trains with other settings: --inner-steps 5 (this node: 7)")
    assert len(lines) == 1, lines  # nothing before it, nothing after
    assert took < REFUSAL_S, f"refused after {took:.1f}s"
