"""swarm-node children forked from the preloaded server behave as exec'd ones do: output, exit
codes, signals, environment, working directory, network namespace, death with their caller;
and they cost a fraction of the CPU.

The namespace test needs root and iproute2 (skipped otherwise, with what is missing); it builds
a lab of its own (10.77.x addresses) and removes it, pass or fail."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.netlab import Lab, exec_prefix, missing, parse_rate
from swarm.utils import netns, preloaded, process_control
from swarm.utils.preloaded_child import PreloadedChild
from swarm.utils.process_control import console_script
from tests.children import child_env, still_running

pytestmark = pytest.mark.timeout(120)

NODE = console_script("swarm-node")


def _exec(argv: list[str], **options: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, **options)  # type: ignore[call-overload]


def _forked(argv: list[str], **options: object) -> tuple[int, str, str]:
    proc = process_control.start(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **options)  # type: ignore[arg-type]
    assert isinstance(proc, PreloadedChild)
    out, err = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
    return proc.wait(60), out, err


@pytest.mark.parametrize(
    ("table", "preloadable"),
    [
        ([NODE, "--help"], True),
        ([str(Path(NODE).parent / "swarm-dht"), "serve"], False),  # only swarm-node is forked
        (["/usr/local/bin/swarm-node", "--help"], False),  # not the one beside this interpreter
        ([sys.executable, "-m", "swarm.cli.node"], False),
        # a follower is forked only by a process the server forked (rank 0 of a node): this one
        # would have to start a server of its own, which imports what the follower saves
        ([sys.executable, "-m", "swarm.ranks.follower", "--rank", "1"], False),
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
        assert isinstance(proc, PreloadedChild) and proc.poll() is None
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


def _cpu_at_join_line(proc: subprocess.Popen[bytes] | PreloadedChild) -> float:
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


def _as_rank_zero() -> None:
    """Run in a child of the server, as rank 0 of a node of two ranks is: start a follower the
    way spawn.py does (with no rank 0 to meet, it gives up after its --timeout, argv[2] here);
    say how it was started, then how it ended."""
    argv = [sys.executable, "-m", "swarm.ranks.follower", "--rank", "1", "--world-size", "2", "--port", "9",
            "--device", "cpu", "--backend", "gloo", "--timeout", sys.argv[2]]  # fmt: skip
    proc = process_control.start(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, die_with_parent=True)
    started = {"forked": isinstance(proc, PreloadedChild), "pid": proc.pid, "parent": _parent(proc.pid),
               "server": os.getppid()}  # fmt: skip
    print(json.dumps(started), flush=True)
    _, err = proc.communicate(90)
    print(json.dumps({"code": proc.returncode, "err": err.decode(errors="replace")}), flush=True)


def _start_rank_zero(follower_timeout: int) -> PreloadedChild:
    return preloaded.start(f"{__name__}:_as_rank_zero", [sys.executable, "rank-zero", str(follower_timeout)],
                           stdin=None, stdout=subprocess.PIPE, stderr=None, env=None, cwd=None, text=False,
                           new_session=True, die_with_parent=False)  # fmt: skip


def test_a_child_of_the_server_has_its_follower_forked_by_the_same_server() -> None:
    """Rank 0 of a node forked from the server asks that server for its followers: they do not
    import torch again. The follower runs as `python -m swarm.ranks.follower` would."""
    rank_zero = _start_rank_zero(1)
    try:
        started = process_control.read_json_line(rank_zero, 90)  # type: ignore[arg-type]
        ended = process_control.read_json_line(rank_zero, 90)  # type: ignore[arg-type]
    finally:
        process_control.stop(rank_zero, 10)  # type: ignore[arg-type]
    assert started["forked"] is True and started["parent"] == started["server"] != rank_zero.pid, started
    assert ended["code"] == 1 and ended["err"].splitlines()[-1].startswith("swarm-node rank 1: "), ended


def test_with_die_with_parent_a_forked_child_gets_sigterm_when_its_caller_is_killed() -> None:
    """As PR_SET_PDEATHSIG gives an exec'd child: the forked one's parent is the server, not
    the caller, so the child watches a pipe only the caller holds."""
    rank_zero, follower = _start_rank_zero(120), None
    try:
        started = process_control.read_json_line(rank_zero, 90)  # type: ignore[arg-type]
        follower = int(started["pid"])
        time.sleep(1.0)  # past its start: the watch must hold while it runs, not only as it begins
        assert still_running([follower], 0.0) == [follower]
        process_control.kill(rank_zero)  # type: ignore[arg-type]
        assert still_running([follower], 20) == [], "the forked follower outlived its caller"
    finally:
        process_control.kill(rank_zero)  # type: ignore[arg-type]
        if follower is not None and still_running([follower], 0.0) and b"swarm.ranks.follower" in _cmdline(follower):
            os.kill(follower, signal.SIGKILL)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.parametrize("name", ["swarmtest-missing", "", "..", "a/../../etc"])
def test_a_namespace_it_cannot_enter_is_a_netns_error_and_exit_1_never_a_node_elsewhere(name: str) -> None:
    code, out, err = _forked([NODE, "--help"], netns=name)
    assert code == 1 and out == "", (code, out)
    assert err.startswith("swarm-node: error: NetnsError: ") and err.count("\n") == 1, err
    with pytest.raises(netns.NetnsError):
        netns.enter(name)  # the same error in this process, which stays where it was


def _ns_inode(where: str) -> int:
    return os.stat(where).st_ino


JOIN = re.compile(rb"--initial-peers /ip4/([0-9.]+)/tcp/(\d+)/p2p/")
RANK_PIDS = re.compile(rb"ranks 1\.\. run as pids \[(\d+)\]")
DIAL = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10).close()"


@pytest.mark.swarm
@pytest.mark.skipif(missing() is not None, reason=f"a lab {missing()}")
def test_a_node_forked_into_a_namespace_listens_there_and_its_follower_rank_joins_it(tmp_path: Path) -> None:
    """The node enters the namespace itself (no `ip netns exec`): it listens on the endpoint's
    address there, and its rank 1, which the server forks at rank 0's request, is put in rank
    0's namespace, not the server's (it would not reach rank 0's store on 127.0.0.1 otherwise)."""
    log = tmp_path / "node.log"
    with Lab.create(f"t{secrets.token_hex(3)}") as lab, open(log, "wb") as out:
        endpoint = lab.add("n", parse_rate("1gbit"))
        argv = [NODE, "--run-id", "netns", "--host-maddrs", f"/ip4/{endpoint.address}/tcp/0", "--model", "tiny",
                "--batch-size", "2", "--seq-len", "64", "--threads", "1", "--identity", "ephemeral",
                "--nproc-per-node", "2", "-vv"]  # fmt: skip
        proc = process_control.start(argv, stdout=out, stderr=out, env=child_env(OMP_NUM_THREADS="1"),
                                     netns=endpoint.netns)  # fmt: skip
        try:
            assert isinstance(proc, PreloadedChild)
            deadline = time.monotonic() + 90
            while not (JOIN.search(text := log.read_bytes()) and RANK_PIDS.search(text)):
                assert proc.poll() is None and time.monotonic() < deadline, text[-3000:]
                time.sleep(0.2)
            address, port = JOIN.search(text).groups()  # type: ignore[union-attr]
            follower = int(RANK_PIDS.search(text).group(1))  # type: ignore[union-attr]
            inside = _ns_inode(netns.path(endpoint.netns))
            assert address.decode() == endpoint.address
            assert _ns_inode(f"/proc/{proc.pid}/ns/net") == inside != _ns_inode("/proc/self/ns/net")
            assert _ns_inode(f"/proc/{follower}/ns/net") == inside
            # it listens there: dialled from inside the namespace, its port answers
            dial = subprocess.run([*exec_prefix(endpoint), sys.executable, "-c", DIAL, address, port],
                                  capture_output=True, text=True, timeout=60)  # fmt: skip
            assert dial.returncode == 0, dial.stderr
            with pytest.raises(OSError):  # and not here: that address is nowhere in our namespace
                socket.create_connection((address.decode(), int(port)), timeout=2).close()
        finally:
            assert process_control.stop(proc, 30) is not None
        assert not still_running([follower], 10)
