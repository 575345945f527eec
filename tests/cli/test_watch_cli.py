"""The watching commands as a user types them: `swarm-dht inspect --serve` (a real process, stopped
by SIGTERM), `swarm-node --metrics-port` on a port in use, and the flags they refuse."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import urllib.error
import urllib.request

import pytest
from click.testing import CliRunner

from swarm import process_control
from swarm.cli.dht import main as dht_main
from swarm.cli.sim import main as sim_main
from swarm.process_control import console_script

ENV = {k: v for k, v in os.environ.items() if k != "SWARM_INITIAL_PEERS"} | {"OMP_NUM_THREADS": "1"}
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
