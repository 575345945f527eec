"""swarm-node as a volunteer runs it: real processes on 127.0.0.1, through the console script."""

from __future__ import annotations

import json
import resource
import signal
import socket
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from swarm.cli.node import main
from swarm.model.llama import count_parameters
from swarm.model.presets import preset
from swarm.utils import process_control
from swarm.utils.process_control import console_script
from tests.children import run_to_end
from tests.node.conftest import FAST, Swarm

pytestmark = pytest.mark.swarm


def _hashes_by_step(swarm: Swarm, names: list[str]) -> dict[int, dict[str, str]]:
    by_step: dict[int, dict[str, str]] = defaultdict(dict)
    for name in names:
        for e in swarm.events(name, "outer_step"):
            by_step[e["outer_step"]][name] = e["state_sha256"]
    return by_step


@pytest.mark.timeout(240)
def test_three_nodes_train_together_with_identical_state(swarm: Swarm) -> None:
    swarm.start_bootstrap()
    names = ["a", "b", "c"]
    args = ("--run-id", "three", "--inner-steps", "8", "--max-outer-steps", "8", "--matchmaking-time", "2")
    procs = [swarm.node(name, *args) for name in names]
    swarm.wait_for(lambda: len(swarm.events("c", "outer_step")) >= 1, 150, "an outer step")
    command = [console_script("swarm-dht"), "inspect", "--run-id", "three", "--initial-peers", str(swarm.bootstrap)]

    last_shown: list[Any] = []

    def whole_run_published() -> bool:  # records refresh every few seconds: ask until all three show it
        inspect = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=60)
        last_shown[:] = [inspect.stdout or inspect.stderr]
        if inspect.returncode != 0:  # a lookup on a starved machine can miss: ask again, say it if it lasts
            return False
        shown = json.loads(inspect.stdout)
        published = {e["peer_id"]: e["value"] for e in shown["nodes"]}
        done = len(published) == 3 and all(v["step"] >= 1 and v["eval_loss"] for v in published.values())
        return done and len(shown["state"]) == 3  # each holds the state of its last outer step

    try:
        swarm.wait_for(whole_run_published, 60, "swarm-dht inspect to show all three nodes past step 0")
    except AssertionError as e:
        raise AssertionError(f"{e}; last shown: {last_shown}; steps: {_hashes_by_step(swarm, names)}") from None
    for name, proc in zip(names, procs, strict=True):
        assert proc.wait(200) == 0, swarm.stderr(name)
    by_step = _hashes_by_step(swarm, names)
    assert sorted(by_step) == list(range(8))
    for step, hashes in by_step.items():
        assert len(set(hashes.values())) == 1, f"outer step {step}: nodes disagree: {hashes}"
    # on a starved machine (CI runs three test files at once) a node may start too late for the
    # first groups; it fetches their state (the hashes above agree) and averages with the others
    # from then on: the last two steps are every node's, in one group of three
    events = {name: swarm.events(name, "outer_step") for name in names}
    sizes = {name: [e["group_size"] for e in events[name]] for name in names}
    assert all(s[-2:] == [3, 3] for s in sizes.values()), sizes
    every = sorted((e for es in events.values() for e in es), key=lambda e: e["outer_step"])
    first, last = every[0], every[-1]
    assert (first["outer_step"], last["outer_step"]) == (0, 7)
    assert last["eval_loss"] < first["eval_loss"] - 0.2
    assert all(e["bytes_sent"] > 0 for es in events.values() for e in es if e["group_size"] > 1)
    steps = events["a"]
    start = swarm.events("a", "start")[0]
    # 0, unless the other two formed step 0's group before this one was up: it starts from theirs
    assert start["outer_step"] <= steps[0]["outer_step"] and start["maddrs"]
    assert start["parameters"] == count_parameters(preset("debug"))
    assert swarm.events("a", "exit")[0]["reason"] == "finished"
    out = (swarm.workdir / "a.out").read_text()
    assert "join with: swarm-node" in out and start["maddrs"][0] in out


@pytest.mark.timeout(240)
def test_a_volunteer_joins_with_the_run_id_and_a_peer_and_adopts_the_runs_settings(swarm: Swarm) -> None:
    """The run's settings travel in its progress records: a node given none of them adopts them
    (and says so), trains in the run's groups; a flag that contradicts them is refused."""
    swarm.start_bootstrap()
    # a node stopped while its group forms leaves the others waiting part_timeout: 10 s, not 60
    timing = ("--matchmaking-time", "2", "--part-timeout", "10")
    run = ("--run-id", "adopt", *timing)
    first = swarm.node(
        "a",
        *run,
        "--inner-steps",
        "6",
        "--lr-schedule",
        "cosine",
        "--total-steps",
        "600",
        "--max-outer-steps",
        "200",
        "-v",  # its log, should it not stop in time (it did not once, under CI load)
    )  # fmt: skip (outlasts the others; stopped below)
    swarm.wait_for(lambda: len(swarm.events("a", "outer_step")) >= 1, 150, "the first node's first outer step")
    # no --run-id: the DHT's one run (stopped below, like the first)
    joiner = swarm.node("b", *timing, "--max-outer-steps", "200")
    contrary = swarm.node("c", *run, "--inner-steps", "5", "--max-outer-steps", "3")
    assert contrary.wait(120) != 0
    assert "--inner-steps 6 (this node: 5)" in swarm.stderr("c"), swarm.stderr("c")
    # the joiner, started with the contrary node, may not have read the run's records yet when the
    # contrary one has been refused (its stderr was still empty then once, on a loaded CI machine)
    swarm.wait_for(lambda: "adopting its settings" in swarm.stderr("b"), 120, "the joiner to adopt the run's settings")
    assert "adopting its settings --inner-steps 6 --lr-schedule cosine --total-steps 600" in swarm.stderr("b")
    assert "joining run 'adopt', the one run this DHT carries (--run-id adopt)" in swarm.stderr("b")
    # a mistyped run id starts a run alone, but says which runs the DHT has; swarm-dht lists them
    typo = swarm.node("d", "--run-id", "adpot", "--inner-steps", "2", "--max-outer-steps", "1")
    assert typo.wait(120) == 0, swarm.stderr("d")
    assert "no node of this DHT trains run 'adpot': starting it anew. The DHT has 'adopt' (" in swarm.stderr("d")
    listing = subprocess.run([console_script("swarm-dht"), "inspect", "--initial-peers", str(swarm.bootstrap)],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert listing.returncode == 0 and "adopt" in listing.stdout and "adpot" in listing.stdout, listing
    unsure = swarm.node("e", "--max-outer-steps", "1")  # two runs now, and no --run-id: which one?
    assert unsure.wait(60) == 1
    assert "this DHT carries several runs: 'adopt' (" in swarm.stderr("e") and "pass --run-id" in swarm.stderr("e")

    def grouped() -> list[dict[str, Any]]:
        return [e for e in swarm.events("b", "outer_step") if e["group_size"] == 2]

    swarm.wait_for(lambda: len(grouped()) >= 2, 150, "two outer steps of the newcomer with the first node")
    theirs = {e["outer_step"]: e["state_sha256"] for e in swarm.events("a", "outer_step")}
    assert all(e["state_sha256"] == theirs[e["outer_step"]] for e in grouped() if e["outer_step"] in theirs)
    joiner.send_signal(signal.SIGTERM)
    assert swarm.exit_code("b", joiner, 60) == 0, swarm.stderr("b")
    first.send_signal(signal.SIGTERM)
    assert swarm.exit_code("a", first, 60) == 0, swarm.stderr("a")


@pytest.mark.timeout(240)
def test_a_node_killed_mid_run_does_not_stop_the_others(swarm: Swarm) -> None:
    swarm.start_bootstrap()
    args = ("--run-id", "kill", "--inner-steps", "6", "--max-outer-steps", "8", "--matchmaking-time", "1.5")
    a, b, victim = (swarm.node(name, *args) for name in ("a", "b", "victim"))

    def trained_together() -> bool:
        # all three averaged in one group first: a node that started late on a starved machine (CI
        # runs three test files at once) and is still fetching its way in when the victim dies
        # chases the state only the dead node held until its record expires (a known gap, seen in
        # CI: ~50 s of fetches that fail) instead of testing the kill's effect on a running swarm
        return all(any(e["group_size"] == 3 for e in swarm.events(n, "outer_step")) for n in ("a", "b", "victim"))

    swarm.wait_for(trained_together, 150, "an outer step of all three in one group")
    victim.kill()  # SIGKILL: no goodbye
    assert a.wait(180) == 0, swarm.stderr("a")
    assert b.wait(60) == 0, swarm.stderr("b")
    by_step = _hashes_by_step(swarm, ["a", "b"])
    assert sorted(by_step) == list(range(8))
    last = swarm.events("a", "outer_step")[-1]
    assert last["group_size"] == 2  # the survivors still average together
    assert by_step[7]["a"] == by_step[7]["b"]


@pytest.mark.timeout(120)
def test_sigint_leaves_cleanly_with_exit_0(swarm: Swarm) -> None:
    proc = swarm.node("solo", "--run-id", "sigint", "--inner-steps", "4", "--matchmaking-time", "0.5")
    swarm.wait_for(lambda: len(swarm.events("solo", "outer_step")) >= 1, 90, "an outer step")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0, swarm.stderr("solo")
    exit_event = swarm.events("solo", "exit")
    assert exit_event and exit_event[0]["reason"] == "stopped"
    assert "Traceback" not in swarm.stderr("solo")


def _run(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """swarm-node to its end, forked from the server that has torch imported (run_to_end)."""
    return run_to_end([console_script("swarm-node"), *args], timeout)


def _one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--inner-steps", "0"], "--inner-steps"),
        (["--model", "huge"], "--model"),
        (["--compression", "int3"], "--compression"),
        (["--initial-peers", "/ip4/1.2.3/tcp/1"], "--initial-peers"),
        (["--seq-len", "100000"], "seq_len"),
        (["--outer-momentum", "1.5"], "--outer-momentum"),
        (["--run-id", "a/b"], "run id"),
        (["--bogus"], "--bogus"),
        (["--bandwidth", "0"], "--bandwidth"),
        (["--bandwidth", "fast"], "--bandwidth"),
        (["--bandwidth", "nan"], "--bandwidth"),
        (["--device", "cuda:7"] if not torch.cuda.is_available() else ["--device", "tpu"], "device"),
        (["--fragments", "0"], "--fragments"),
        (["--start-with", "0"], "--start-with"),
        (["--fragments", "2", "--error-feedback", "0.5"], "not yet with fragments > 1"),
        (["--fragments", "1000"], "fragments must be in [1, 56]"),  # more than the tiny model's tensors
    ],
)
def test_bad_flags_give_one_line(args: list[str], expected: str) -> None:
    result = CliRunner().invoke(main, [*args, "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], prog_name="swarm-node")
    assert result.exit_code != 0 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and lines[0].startswith("swarm-node"), result.stderr


@pytest.mark.parametrize("args", [["--inner-steps", "-5"], ["--lr-schedule", "cosine"], ["--model", "huge"]])
def test_a_bad_flag_is_refused_before_torch_loads(args: list[str]) -> None:
    """Under a second of CPU (torch's import alone takes several): measured as the child's CPU
    time, which a busy machine does not inflate as it does the wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    # exec'd, not forked from a server that has torch imported: what a user's command costs
    line = _one_error_line(
        subprocess.run([console_script("swarm-node"), *args], capture_output=True, text=True, timeout=90)
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert line.startswith("swarm-node: error:") and cpu < 1.0, (line, cpu)


def test_a_busy_port_says_what_to_do() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _one_error_line(_run("--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--max-outer-steps", "1", *FAST))
    assert f"port {port} of 127.0.0.1 is in use" in line and "/tcp/0 for any free port" in line, line


def test_bad_config_file_gives_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("inner-steps = [\n")
    assert "not valid TOML" in _one_error_line(_run("--config", str(broken)))
    unknown = tmp_path / "unknown.toml"
    unknown.write_text('inner-steps = 5\nlearning-speed = "fast"\n')
    line = _one_error_line(_run("--config", str(unknown)))
    assert "unknown option(s) learning-speed; valid: " in line and "inner-steps" in line  # as written, and the list
    wrong_type = tmp_path / "wrong.toml"
    wrong_type.write_text('inner-steps = "many"\n')
    line = _one_error_line(_run("--config", str(wrong_type)))
    assert f"{wrong_type}: inner-steps = 'many':" in line and "'--inner-steps'" not in line  # the file's, not a flag
    assert "cannot read" in _one_error_line(_run("--config", str(tmp_path / "missing.toml")))


def test_config_file_values_apply_and_flags_override_them(tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    config.write_text('run-id = "from-file"\ninner_steps = 2\nmax-outer-steps = 1\nmatchmaking-time = 0.3\n')
    metrics = tmp_path / "m.jsonl"
    result = _run("--config", str(config), "--max-outer-steps", "2", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                  *FAST, "--metrics-file", str(metrics), timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "run 'from-file'" in result.stdout
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert sum(e["event"] == "outer_step" for e in events) == 2  # the flag overrode the file's 1


def test_unreachable_initial_peers_give_one_line() -> None:
    line = _one_error_line(
        _run("--initial-peers", "/ip4/127.0.0.1/tcp/9", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *FAST)
    )
    assert "/ip4/127.0.0.1/tcp/9" in line


@pytest.mark.timeout(180)
def test_a_node_nobody_can_reach_runs_in_client_mode(swarm: Swarm) -> None:
    swarm.start_bootstrap("--relay", "off")  # no relay anywhere: with one, it would be reached through it
    args = ("--run-id", "nat", "--inner-steps", "4", "--max-outer-steps", "5", "--matchmaking-time", "1.5")
    server = swarm.node("server", *args, "--relay", "off")  # a reachable node relays by default
    # announces an address where nothing listens: the dial-back fails, as behind a NAT
    natted = swarm.node("natted", *args, "--announce-maddrs", "/ip4/127.0.0.1/tcp/9")
    assert natted.wait(150) == 0, swarm.stderr("natted")
    assert server.wait(60) == 0, swarm.stderr("server")
    assert "client mode" in swarm.stderr("natted") and "--announce-maddrs" in swarm.stderr("natted")
    start = swarm.events("natted", "start")[0]
    assert start["client_mode"] is True and start["maddrs"] == []
    steps = swarm.events("natted", "outer_step")
    assert 2 in [e["group_size"] for e in steps], swarm.stderr("natted")  # it still averages, as a client
    assert steps[-1]["state_sha256"] == swarm.events("server", "outer_step")[-1]["state_sha256"]
    assert not swarm.events("natted", "fetch") or swarm.events("natted", "fetch")[0]["peers"] == 1  # from the server


@pytest.mark.timeout(180)
def test_a_client_that_trained_alone_takes_the_state_of_a_server_that_comes_later(swarm: Swarm) -> None:
    """Nobody can fetch a client's steps: once a server is up (at an earlier step), the client
    takes the server's state and they average together from then on."""
    swarm.start_bootstrap("--relay", "off")  # no relay anywhere: the unreachable node is a client
    args = ("--run-id", "nat-first", "--inner-steps", "4", "--matchmaking-time", "1.5")
    # many steps, so that a slow server start cannot find the client already done; stopped below
    natted = swarm.node("natted", *args, "--max-outer-steps", "40", "--announce-maddrs", "/ip4/127.0.0.1/tcp/9")
    swarm.wait_for(lambda: bool(swarm.events("natted", "outer_step")), 90, "the client's first step alone")
    # the run (the client's) ends at 40
    server = swarm.node("server", *args, "--relay", "off", "--leave-after-steps", "5")
    assert server.wait(150) == 0, swarm.stderr("server")
    if natted.poll() is None:
        natted.send_signal(signal.SIGINT)
    assert natted.wait(60) == 0, swarm.stderr("natted")
    fetches = swarm.events("natted", "fetch")
    assert fetches and fetches[0]["reason"] == "ahead of every server", (fetches, swarm.stderr("natted"))
    assert fetches[0]["peers"] == 1
    by_step = {e["outer_step"]: e for e in swarm.events("natted", "outer_step")}  # the last of each step
    server_steps = swarm.events("server", "outer_step")
    assert by_step[4]["state_sha256"] == server_steps[-1]["state_sha256"]
    assert 2 in [e["group_size"] for e in server_steps]


@pytest.mark.timeout(300)
def test_resident_memory_does_not_grow_over_outer_steps(swarm: Swarm) -> None:
    """50 outer steps of tiny (alone, H = 1): resident memory after 50 within 10% of after 5."""
    proc = swarm.node("mem", "--run-id", "mem", "--inner-steps", "1", "--max-outer-steps", "50",
                      "--matchmaking-time", "0.1", "--eval-every", "5")  # fmt: skip
    assert proc.wait(280) == 0, swarm.stderr("mem")
    rss = {e["outer_step"]: e["rss_bytes"] for e in swarm.events("mem", "outer_step")}
    assert rss[49] <= 1.10 * rss[4], f"{rss[4] / 2**20:.1f} MiB after 5 outer steps, {rss[49] / 2**20:.1f} after 50"


@pytest.mark.timeout(120)
def test_on_a_terminal_it_shows_a_live_panel(tmp_path: Path) -> None:
    """stdout and stderr on one pseudo-terminal: the rich panel (progress bar, losses) instead of
    log lines, and the join line stays on the screen above it (a redraw used to erase it)."""
    import os
    import pty

    controller, terminal = pty.openpty()
    command = [console_script("swarm-node"), "--run-id", "tty", "--inner-steps", "3", "--max-outer-steps", "2",
               "--matchmaking-time", "0.2", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *FAST]  # fmt: skip
    proc = process_control.start(command, stdout=terminal, stderr=terminal)
    os.close(terminal)
    shown = b""
    try:
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            shown += chunk
        assert proc.wait(90) == 0
    finally:
        process_control.kill(proc)
        os.close(controller)
    text = shown.decode(errors="replace")
    assert "inner steps" in text and "eval loss" in text and "\x1b[" in text  # drawn, not logged
    screen = "\n".join(terminal_screen(text))
    assert "join with: swarm-node --run-id tty" in screen and "eval loss" in screen, screen


def terminal_screen(text: str) -> list[str]:
    """What a terminal shows after `text`: enough of VT100 for rich's Live (cursor up and down,
    erase line, carriage return, newline); other escape sequences are dropped."""
    import re

    lines, row, col = [""], 0, 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b.|[\r\n]|[^\x1b\r\n]+", text):
        if token == "\n":
            row += 1
            lines += [""] * (row + 1 - len(lines))
        elif token == "\r":
            col = 0
        elif token.startswith("\x1b["):
            count = int(token[2:-1] or 1) if token[2:-1].isdigit() else 1
            if token[-1] == "A":
                row = max(0, row - count)
            elif token[-1] == "B":
                row += count
                lines += [""] * (row + 1 - len(lines))
            elif token[-1] == "K":  # 2K: the whole line; K / 0K: from the cursor on
                lines[row] = "" if token[2:-1] == "2" else lines[row][:col]
        elif not token.startswith("\x1b"):
            lines[row] = lines[row][:col].ljust(col) + token + lines[row][col + len(token) :]
            col += len(token)
    return lines
