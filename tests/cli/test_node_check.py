"""`swarm-node check`: the pre-flight against a real run (a bootstrap and a training node on
127.0.0.1): ready against the run as it is (exit 0, its table), refused with the fix against an
address nobody answers and against a run of other settings (exit 1)."""

from __future__ import annotations

import asyncio
import socket
import subprocess

import pytest

from swarm.cli import node_check
from swarm.cli.common import CliError
from swarm.cli.node_check import FAIL, OK, WARN, Finding, print_findings
from swarm.utils.process_control import console_script
from tests.children import run_to_end
from tests.node.conftest import ENV, FAST, LOOPBACK, Swarm


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return run_to_end([console_script("swarm-node"), "check", "--host-maddrs", LOOPBACK, *FAST, *args], 240,
                      env=ENV | {"COLUMNS": "120"})  # fmt: skip


def row(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(f"│ {name} "))


def status(out: str, name: str) -> str:
    """The row's last cell (ok, WARN, FAIL), whatever the column's width: on a loaded machine
    another row says WARN (a slow inner step) and pads every "ok" to its width."""
    return row(out, name).split("│")[-2].strip()


@pytest.mark.swarm
@pytest.mark.timeout(600)
def test_check_says_ready_for_a_good_run_and_why_not_for_a_dead_address_or_other_settings(swarm: Swarm) -> None:
    bootstrap = swarm.start_bootstrap()
    swarm.node("first", "--run-id", "checked", "--inner-steps", "5")
    swarm.wait_for(lambda: bool(swarm.events("first", "network")), 180, "the first node's progress record")
    good = check("--run-id", "checked", "--initial-peers", bootstrap)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "verdict: ready to join" in good.stdout
    assert "1 node(s) in run 'checked'" in row(good.stdout, "peers") and status(good.stdout, "peers") == "ok"
    assert "the run's (model debug, H 5)" in row(good.stdout, "settings")  # H adopted from the run
    assert "peers dial this machine directly" in row(good.stdout, "reachability")
    assert "MB/s down" in row(good.stdout, "bandwidth")  # a shard of the run's state, timed
    assert "GiB for model debug and one step" in row(good.stdout, "memory")
    assert "the run's median" in row(good.stdout, "inner step")

    other = check("--run-id", "checked", "--inner-steps", "7", "--initial-peers", bootstrap)
    assert other.returncode == 1, other.stdout + other.stderr
    assert "differ: --inner-steps 5 (this node: 7)" in other.stdout and status(other.stdout, "settings") == "FAIL"
    assert "verdict: cannot join: settings: Leave these flags out" in other.stdout

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = f"/ip4/127.0.0.1/tcp/{port}/p2p/{bootstrap.rsplit('/', 1)[1]}"
    unreachable = check("--run-id", "checked", "--initial-peers", dead)
    assert unreachable.returncode == 1, unreachable.stdout + unreachable.stderr
    assert "none answered" in row(unreachable.stdout, "peers") and "FAIL" in row(unreachable.stdout, "peers")
    assert "verdict: cannot join: peers: check the address" in unreachable.stdout


def test_the_verdict_lists_each_failure_with_its_fix(capsys: pytest.CaptureFixture[str]) -> None:
    print_findings([Finding("peers", "1 dialed", OK), Finding("memory", "needs 9 GiB; 2 GiB free", FAIL, "more memory"),
                    Finding("reachability", "not dialed", WARN, "forward the port")])  # fmt: skip
    out = capsys.readouterr().out
    assert "verdict: cannot join: memory: more memory" in out and "note (reachability): forward the port" in out


async def test_a_probe_step_that_runs_out_of_time_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_check, "PROBE_TIMEOUT", 0.05)
    with pytest.raises(CliError, match=r"^reading the run.s node records: no answer within 0\.05s$"):
        await node_check._stage("reading the run's node records", asyncio.sleep(5))
    assert await node_check._stage("joining the run's DHT", asyncio.sleep(0, "joined")) == "joined"
