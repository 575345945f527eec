"""swarm-sim --link / --links: every node and the bootstrap in a network namespace of its own, on
a link shaped by tc (swarm.netlab). Runs the installed console script as test_sim.py does; every
test checks that no child process and no namespace of the run is left, pass or fail.

The swarm tests need root and iproute2 (skipped otherwise, with what is missing); the flag checks
run anywhere."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from swarm.cli.sim import main as sim_main
from swarm.netlab import PREFIX, LabError, missing
from swarm.netlab import lab as lab_module
from tests.cli.test_sim import QUICK, _assert_no_leftovers, _finish, _leftovers, _run, _start

needs_links = pytest.mark.skipif(missing() is not None, reason=f"swarm-sim --link {missing()}")


def _namespaces_of(sim_pid: int) -> list[str]:
    """The namespaces of the lab a swarm-sim process owns (named after its PID)."""
    return [ns for ns in lab_module.namespaces() if ns.startswith(f"{PREFIX}{sim_pid}-")]


@contextlib.contextmanager
def _removed_after(sim_pid: int) -> Any:
    """Whatever happens in the test, the run's namespaces (and what runs inside) go at the end."""
    try:
        yield
    finally:
        with contextlib.suppress(LabError):
            lab_module.remove(sorted(_namespaces_of(sim_pid), key=len, reverse=True))


def _final_states(run_dir: Path) -> dict[str, tuple[int, str]]:
    """Each node's last state: (the outer step it is at, its state_sha256), from its own
    outer_step events (the state after step n is the state at n + 1) and the states it fetched."""
    final = {}
    for path in sorted(run_dir.glob("node*.jsonl")):
        states = [(-1, "")]
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "outer_step":
                states.append((event["outer_step"] + 1, event["state_sha256"]))
            elif event["event"] == "fetch":
                states.append((event["outer_step"], event["state_sha256"]))
        final[path.stem] = max(states)
    return final


@needs_links
@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_three_nodes_on_50mbit_links_train_and_agree(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # three outer steps (click keeps the last --outer-steps, this one): the nodes average over the
    # links, the loss falls and they end with one state; QUICK's fourth step showed nothing new
    # (the test and every child: 14.7 CPU-s with four steps, 12.5 and 12.7 with three)
    proc = _start("--nodes", "3", "--link", "50mbit", *QUICK, "--outer-steps", "3", "--run-dir", str(run_dir))
    with _removed_after(proc.pid):
        code, out, err = _finish(proc, timeout=260)
        assert code == 0, f"{out}\n{err}"
        _assert_no_leftovers(run_dir)
        assert not _namespaces_of(proc.pid), "the run's namespaces are still there"

    # each child ran in its own namespace, on its own address there
    assert "links: bootstrap 50mbit (10.77.0.1), node0 50mbit (10.77.0.2)" in out
    bootstrap = json.loads((run_dir / "bootstrap.out").read_text().splitlines()[0])
    assert [m.split("/")[2] for m in bootstrap["maddrs"]] == ["10.77.0.1"]
    doc = json.loads((run_dir / "metrics.json").read_text())
    assert doc["bootstrap_link"] == "50mbit"
    nodes = doc["nodes"]
    assert sorted(n["link"]["address"] for n in nodes) == ["10.77.0.2", "10.77.0.3", "10.77.0.4"]
    assert {n["link"]["rate"] for n in nodes} == {"50mbit"}

    # it trained: nodes averaged over the links, and the swarm's eval loss fell
    steps = sorted((s for n in nodes for s in n["steps"]), key=lambda s: s["outer_step"])
    assert max(s["group_size"] for s in steps) >= 2, steps
    assert steps[-1]["eval_loss"] < steps[0]["eval_loss"], steps
    # it agrees: every node ends at the last outer step with one state (averaged, or fetched from
    # the others when it fell behind: a 10 MB state takes ~1.8 s at 50mbit)
    final = _final_states(run_dir)
    assert len(final) == 3 and len(set(final.values())) == 1, final
    assert next(iter(final.values()))[0] == 3, final


@needs_links
@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_sigterm_stops_the_nodes_and_removes_the_links(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start_two_linked(run_dir)
    with _removed_after(proc.pid):
        _wait_for_four_namespaces(proc)
        time.sleep(1)  # the nodes are importing inside their namespaces
        proc.send_signal(signal.SIGTERM)
        code, out, err = _finish(proc, timeout=60)
        assert code == 130, f"{out}\n{err}"
        _assert_no_leftovers(run_dir)
        assert not _namespaces_of(proc.pid)


@needs_links
@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_a_killed_runs_nodes_and_links_go_at_the_next_start(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start_two_linked(run_dir)
    with _removed_after(proc.pid):
        _wait_for_four_namespaces(proc)
        os.kill(proc.pid, signal.SIGKILL)  # no chance to clean up: its nodes run on, in their namespaces
        proc.communicate(timeout=30)
        assert _leftovers(run_dir), "the killed run's nodes are expected to outlive it"
        # the next start: a run that fails right after building its lab still cleared the dead one's
        code, out, err = _run("--nodes", "1", "--link", "20mbit", "--seq-len", "100000", timeout=120)
        assert code == 1 and "failed at start" in err, f"{out}\n{err}"
        assert not _namespaces_of(proc.pid), "the killed run's namespaces are still there"
        _assert_no_leftovers(run_dir)  # its nodes were stopped with them


# --- flags: one line, nothing built -----------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--link", "20mbps"), "tc reads 'mbps' as megabytes/s"),
        (("--link", "fast"), "'fast' is not a rate"),
        (("--link", "10kbit"), "between 100kbit and 100gbit"),
        (("--links", "100mbit,20mbit"), "--links has 2 rate(s) for 3 nodes"),
        (("--links", "100mbit,,20mbit,1gbit"), "separated by commas"),
        (("--link", "1gbit", "--links", "1gbit,1gbit,1gbit"), "not both"),
        (("--links", "1gbit,1gbit,1gbit", "--join-every", "10"), "use --link with --join-every"),
    ],
)
def test_bad_link_flags_give_one_line_and_exit_2(args: tuple[str, ...], says: str) -> None:
    result = CliRunner().invoke(sim_main, list(args))
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("swarm-sim: error:"), result.output
    assert says in lines[0], lines[0]


@pytest.mark.parametrize("flag", [("--link", "50mbit"), ("--links", "50mbit,50mbit,50mbit")])
def test_without_root_one_line_and_nothing_made(flag: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    made = []
    monkeypatch.setattr(lab_module, "run", lambda command: made.append(command))
    monkeypatch.setattr("tempfile.mkdtemp", lambda **kw: made.append(kw))
    result = CliRunner().invoke(sim_main, list(flag))
    assert result.exit_code == 1 and not made
    assert (
        result.output
        == f"swarm-sim: error: {flag[0]} needs root to make network namespaces and shape links (run it with sudo)\n"
    )


def _start_two_linked(run_dir: Path) -> subprocess.Popen[str]:
    """A long swarm-sim of 2 nodes on 20mbit links."""
    return _start("--nodes", "2", "--link", "20mbit", *QUICK, "--outer-steps", "1000", "--run-dir", str(run_dir))


def _wait_for_four_namespaces(proc: subprocess.Popen[str]) -> None:
    """Until the run's 4 namespaces exist: the bridge's, the bootstrap's and both nodes'."""
    deadline = time.monotonic() + 60
    while len(_namespaces_of(proc.pid)) < 4 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)  # polling `ip netns`: there is no event to wait on
    assert len(_namespaces_of(proc.pid)) == 4, proc.communicate()
