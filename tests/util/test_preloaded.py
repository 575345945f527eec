"""swarm-node children forked from the preloaded server behave as exec'd ones do: output, exit
codes, signals, environment, working directory; and they cost a fraction of the CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.utils import preloaded, process_control
from swarm.utils.process_control import console_script

pytestmark = pytest.mark.timeout(120)

NODE = console_script("swarm-node")


def _exec(argv: list[str], **options: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, **options)  # type: ignore[call-overload]


def _forked(argv: list[str], **options: object) -> tuple[int, str, str]:
    proc = process_control.start(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **options)  # type: ignore[arg-type]
    assert isinstance(proc, preloaded.PreloadedChild)
    out, err = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
    return proc.wait(60), out, err


@pytest.mark.parametrize(
    ("table", "preloadable"),
    [
        ([NODE, "--help"], True),
        ([str(Path(NODE).parent / "swarm-dht"), "serve"], False),  # only swarm-node is forked
        (["/usr/local/bin/swarm-node", "--help"], False),  # not the one beside this interpreter
        ([sys.executable, "-m", "swarm.cli.node"], False),
        ([], False),
    ],
)
def test_which_command_lines_are_forked(table: list[str], preloadable: bool) -> None:
    assert (preloaded.preloadable(table, None) is not None) == preloadable


def test_a_child_of_another_pythonpath_is_execd() -> None:
    env = dict(os.environ, PYTHONPATH="/nonexistent")
    assert preloaded.preloadable([NODE, "--help"], env) is None
    assert preloaded.preloadable([NODE, "--help"], dict(os.environ, OTHER="x")) is not None


@pytest.mark.parametrize("args", [["--help"], ["--inner-steps", "-5"], ["--model", "huge"]])
def test_output_and_exit_code_are_those_of_an_execd_node(args: list[str]) -> None:
    code, out, err = _forked([NODE, *args])
    ran = _exec([NODE, *args])
    assert (code, out, err) == (ran.returncode, ran.stdout, ran.stderr)


def test_the_environment_and_working_directory_are_the_callers(tmp_path: Path) -> None:
    (tmp_path / "node.toml").write_text("inner_steps = -3\n")
    env = dict(os.environ, SWARM_INITIAL_PEERS="not-an-address")
    code, _, err = _forked([NODE, "--config", "node.toml"], cwd=tmp_path)
    assert code != 0 and "inner_steps" in err, err
    code, _, err = _forked([NODE, "--run-id", "x"], env=env)
    assert code != 0 and "not-an-address" in err, err


def test_a_signal_ends_it_as_it_ends_an_execd_process_and_is_never_sent_after(tmp_path: Path) -> None:
    argv = [NODE, "--run-id", "sig", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--threads", "1",
            "--identity", "ephemeral", "--metrics-file", str(tmp_path / "sig.jsonl")]  # fmt: skip
    proc = process_control.start(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert isinstance(proc, preloaded.PreloadedChild) and proc.poll() is None
        assert os.getsid(proc.pid) == proc.pid  # its own session, as process_control starts children
        # its own command line, not the server's: ps, and whatever finds a run's processes by it
        shown = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert shown.split() == argv, shown
        assert process_control.kill(proc) == -signal.SIGKILL
    finally:
        process_control.stop(proc, 5.0)  # a no-op once it is gone; never leave it running
    assert process_control.send_signal(proc, signal.SIGTERM) is False
    proc.send_signal(signal.SIGTERM)  # a no-op once its code is known
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)  # reaped by the server


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _cpu_at_join_line(proc: subprocess.Popen[bytes] | preloaded.PreloadedChild) -> float:
    """The child's CPU seconds once it printed its join line (its model and DHT node are up)."""
    assert proc.stdout is not None
    seen, deadline = b"", time.monotonic() + 60
    try:
        while b"join with:" not in seen:
            assert time.monotonic() < deadline, seen
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            assert chunk, seen
            seen += chunk
        return _cpu_seconds(proc.pid)
    finally:
        process_control.stop(proc, 10)  # type: ignore[arg-type]


@pytest.mark.swarm
def test_a_forked_node_costs_seconds_of_cpu_less_than_an_execd_one() -> None:
    """The point of the server: the child does not import torch and swarm again. CPU time, which
    a busy machine does not inflate as it does the wall time; measured 1.0 s against 3.4 s."""
    argv = [NODE, "--run-id", "cpu", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--model", "tiny", "--threads", "1",
            "--identity", "ephemeral"]  # fmt: skip
    process_control.start([NODE, "--help"], stdout=subprocess.DEVNULL).wait(60)  # the server is up
    forked = _cpu_at_join_line(process_control.start(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    execd = _cpu_at_join_line(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                               start_new_session=True))  # fmt: skip
    assert forked < execd - 1.0, (forked, execd)
