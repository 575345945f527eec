"""The watching commands as a user types them: `swarm-dht inspect --serve` (a real process, stopped
by SIGTERM), `swarm-sim --dashboard`, `swarm-node --metrics-port` on a port in use, and the flags
they refuse."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from click.testing import CliRunner

from swarm.cli.dht import main as dht_main
from swarm.cli.sim import main as sim_main
from swarm.utils import process_control
from swarm.utils.process_control import console_script
from tests.children import child_env

T = TypeVar("T")
ENV = child_env(OMP_NUM_THREADS="1")
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.swarm
@pytest.mark.timeout(90)
def test_inspect_serves_the_run_dashboard_until_sigterm() -> None:
    procs: list[subprocess.Popen[str]] = []
    try:
        serve = [console_script("swarm-dht"), "serve", "--json", "--host-maddrs", LOOPBACK]
        bootstrap = process_control.start(serve, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)
        procs.append(bootstrap)
        maddr = process_control.read_json_line(bootstrap, 30, what="bootstrap")["maddrs"][0]
        argv = [console_script("swarm-dht"), "inspect", "--run-id", "nobody-yet", "--serve", "0", "--json",
                "--initial-peers", maddr]  # fmt: skip
        watch = process_control.start(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        procs.append(watch)
        ready = process_control.read_json_line(watch, 30, what="swarm-dht inspect --serve")
        url = ready["url"]
        assert ready["run_id"] == "nobody-yet" and url.startswith("http://127.0.0.1:")
        status, body = get(url + "api/run")
        snapshot = json.loads(body)
        assert status == 200 and snapshot["run_id"] == "nobody-yet" and snapshot["nodes"] == []
        status, page = get(url)
        assert status == 200 and b'id="loss-chart"' in page and b"<script" in page
        assert b"src=" not in page and b"href=" not in page and b"@import" not in page  # nothing to fetch but its JSON
        assert get(url + "missing")[0] == 404
        watch.send_signal(signal.SIGTERM)
        assert watch.wait(20) == 0
    finally:
        process_control.stop_all(procs, 10.0)


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_a_metrics_port_in_use_is_one_line_and_exit_1() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [console_script("swarm-node"), "--host-maddrs", LOOPBACK, "--model", "tiny", "--threads", "1",
                "--max-outer-steps", "1", "--metrics-port", str(port)]  # fmt: skip
        proc = process_control.start(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        try:
            _, err = proc.communicate(timeout=100)
        finally:
            process_control.kill(proc, reap_s=None)
    assert proc.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "cannot serve --metrics-port" in lines[0], err


@pytest.mark.parametrize(
    ("command", "args", "says"),
    [
        (dht_main, ["inspect", "--serve", "0", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "--serve needs --run-id"),
        (dht_main, ["inspect", "--run-id", "r", "--serve", "70000"], "70000"),
        (sim_main, ["--dashboard", "--link", "20mbit"], "--dashboard reads the swarm from 127.0.0.1"),
        (sim_main, ["--dashboard", "x"], "x"),
    ],
)
def test_bad_watching_flags_give_one_line_and_exit_2(command: object, args: list[str], says: str) -> None:
    result = CliRunner().invoke(command, args)  # type: ignore[arg-type]
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.output


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_swarm_sim_dashboard_prints_its_address_and_shows_the_swarm(tmp_path: Path) -> None:
    """`swarm-sim --dashboard`: the page's address comes first, the page then shows the local
    swarm, and Ctrl+C stops the dashboard with the nodes."""
    run_dir, out_path = tmp_path / "run", tmp_path / "sim.out"
    argv = [console_script("swarm-sim"), "--nodes", "2", "--outer-steps", "100", "--inner-steps", "8", "--batch-size",
            "2", "--seq-len", "64", "--matchmaking-time", "2", "--dashboard", "--run-dir", str(run_dir)]  # fmt: skip
    with open(out_path, "w") as out:
        sim = process_control.start(argv, stdout=out, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        url = _wait_for(lambda: _dashboard_url(out_path), 60, "the dashboard's address", out_path)
        snapshot: dict = {}

        def two_nodes() -> bool:
            snapshot.update(json.loads(get(url + "api/run")[1]))
            return len(snapshot["nodes"]) == 2 and len(snapshot["curve"]) >= 1

        _wait_for(two_nodes, 150, "2 nodes and an eval loss on the page", out_path)
        assert snapshot["run_id"].startswith("sim-") and snapshot["settings"]["inner_steps"] == 8
        sim.send_signal(signal.SIGINT)
        assert sim.wait(60) == 130
    finally:
        process_control.stop(sim, 30.0, reap_s=None)
    deadline = time.monotonic() + 5
    while (left := [p for p in _commands() if str(run_dir) in p or snapshot.get("run_id", "?") in p]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert not left, f"processes left running: {left}"


def _dashboard_url(path: Path) -> str | None:
    found = re.search(r"dashboard: (http://\S+)", path.read_text())
    return found.group(1) if found else None


def _wait_for(probe: Callable[[], T | None], timeout: float, what: str, log: Path) -> T:
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}; swarm-sim said:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)
    return value


def _commands() -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue
    return found
