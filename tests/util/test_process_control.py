"""swarm.utils.process_control on real children (small `python -c` programs, no torch): a child that
ignores SIGTERM is SIGKILLed after the grace, a JSON line is read even when it shares a read with
another, a silent child times out with a clear error, and no child is left unreaped."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarm.utils import netns, preloaded, preloaded_bootstrap, preloaded_child, process_control
from tests.children import still_running

# a child that says it is ready only once its SIGTERM handler is in place
IGNORES_SIGTERM = """
import json, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(json.dumps({"ready": True}), flush=True)
time.sleep(60)
"""
SILENT = "import time; time.sleep(60)"


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    """The children of one test, SIGKILLed and reaped at its end whatever happened."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        process_control.kill(proc, group=True)


def python(children: list[subprocess.Popen[bytes]], code: str, **options: object) -> subprocess.Popen[bytes]:
    proc = process_control.start([sys.executable, "-c", code], stdout=subprocess.PIPE, **options)  # type: ignore[arg-type]
    children.append(proc)
    return proc


def assert_reaped(pid: int) -> None:
    """No zombie: the child is reaped, so the kernel no longer holds it for us."""
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def assert_dead(pid: int, timeout: float = 5.0) -> None:
    """A process that is not our child (a grandchild) is dead: gone, or a zombie that its new
    parent (init, or a container's first process) has not reaped yet."""
    if still_running([pid], timeout):
        pytest.fail(f"process {pid} still runs {timeout:g}s after its group was stopped")


# --- stopping ------------------------------------------------------------------------------------


def test_a_child_that_ignores_sigterm_is_sigkilled_after_the_grace_and_reaped(children: list) -> None:
    proc = python(children, IGNORES_SIGTERM)
    assert process_control.read_json_line(proc, 10) == {"ready": True}
    started = time.monotonic()
    code = process_control.stop(proc, grace=0.5)
    elapsed = time.monotonic() - started
    assert code == -signal.SIGKILL  # SIGTERM did nothing; SIGKILL ended it
    assert 0.5 <= elapsed < 5.0, elapsed  # it had the whole grace, and no more than it needed
    assert_reaped(proc.pid)


def test_a_child_that_exits_on_sigterm_is_not_kept_waiting_for_the_grace(children: list) -> None:
    proc = python(children, 'print("{}", flush=True); import time; time.sleep(60)')
    process_control.read_json_line(proc, 10)
    started = time.monotonic()
    assert process_control.stop(proc, grace=30) == -signal.SIGTERM
    assert time.monotonic() - started < 10
    assert_reaped(proc.pid)


def test_stop_all_shares_one_deadline_and_reaps_every_child(children: list) -> None:
    procs = [python(children, IGNORES_SIGTERM) for _ in range(3)]
    for proc in procs:
        process_control.read_json_line(proc, 10)
    started = time.monotonic()
    process_control.stop_all(procs, grace=1.0)
    assert time.monotonic() - started < 2.9  # one grace for all three, not one each (3 s)
    for proc in procs:
        assert proc.returncode == -signal.SIGKILL
        assert_reaped(proc.pid)


def test_with_group_the_signals_reach_what_the_child_started(children: list) -> None:
    """The child starts a grandchild (same process group) that ignores SIGTERM, as a p2pd might."""
    code = f"""
import json, subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", {IGNORES_SIGTERM!r}], stdout=subprocess.PIPE)
grandchild.stdout.readline()
print(json.dumps({{"grandchild": grandchild.pid}}), flush=True)
time.sleep(60)
"""
    proc = python(children, code)
    grandchild = process_control.read_json_line(proc, 10)["grandchild"]
    process_control.stop(proc, grace=0.5, group=True)
    assert_reaped(proc.pid)
    assert_dead(grandchild)


def test_kill_is_immediate_and_a_reaped_child_is_never_signalled_again(children: list) -> None:
    proc = python(children, SILENT)
    started = time.monotonic()
    assert process_control.kill(proc) == -signal.SIGKILL
    assert time.monotonic() - started < 5
    assert_reaped(proc.pid)
    # its PID may belong to a stranger by now: nothing is sent, stop and kill only report
    assert not process_control.send_signal(proc, signal.SIGKILL)
    assert process_control.stop(proc, grace=1.0) == -signal.SIGKILL


def test_term_none_waits_for_the_child_to_finish_on_its_own(children: list) -> None:
    """A worker that stops when its stdin closes: no signal, it exits 0 within the grace."""
    proc = python(children, "import sys; sys.stdin.read()", stdin=subprocess.PIPE)
    process_control.close_stdin(proc)
    assert process_control.stop(proc, grace=10, term=None) == 0
    assert_reaped(proc.pid)


# --- reading the JSON line -----------------------------------------------------------------------


def test_the_json_line_is_read_past_other_output(children: list) -> None:
    code = r"""
import sys, time
sys.stdout.write("a library's banner\nnot json {\n[1, 2]\nMARK {\"port\": 5}\n")
sys.stdout.flush()
time.sleep(60)
"""
    proc = python(children, code)
    assert process_control.read_json_line(proc, 10, prefix="MARK ") == {"port": 5}


def test_two_lines_in_one_write_are_both_read(children: list) -> None:
    """The second line arrives in the same read as the first: it must not wait in a buffer that
    select() cannot see (readline() on the pipe would time out here)."""
    code = r"""
import sys, time
sys.stdout.write('{"n": 1}\n{"n": 2}\n')
sys.stdout.flush()
time.sleep(60)
"""
    proc = python(children, code, text=True)
    assert process_control.read_json_line(proc, 10) == {"n": 1}
    assert process_control.read_json_line(proc, 2) == {"n": 2}


def test_a_child_that_never_prints_times_out_with_a_clear_error_and_is_stopped(children: list) -> None:
    proc = python(children, SILENT)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"the seeder printed no JSON line within 0\.5s"):
        try:
            process_control.read_json_line(proc, 0.5, what="the seeder")
        finally:
            process_control.stop(proc, grace=1.0)
    assert time.monotonic() - started < 5
    assert proc.returncode == -signal.SIGTERM
    assert_reaped(proc.pid)


def test_a_child_that_exits_first_is_reported_with_its_code_and_left_unreaped(children: list) -> None:
    proc = python(children, 'print("starting"); raise SystemExit(3)')
    with pytest.raises(process_control.ChildExited, match=r"exited \(code 3\) before printing a JSON line"):
        process_control.read_json_line(proc, 10)
    # unreaped: a caller may still stop its process group by the PID
    assert proc.returncode is None
    assert process_control.wait(proc, 5) == 3
    assert_reaped(proc.pid)


def test_the_error_names_the_command_when_no_name_is_given(children: list) -> None:
    proc = python(children, "pass")
    with pytest.raises(process_control.ChildExited, match=rf"child {proc.pid} \(.*python.* -c pass\)"):
        process_control.read_json_line(proc, 10)


# --- a parent that exits on SIGTERM ---------------------------------------------------------------

# SIGTERM lands in an at-fork hook (as it does when it comes while the process forks a child with a
# preexec_fn, e.g. die_with_parent): Python drops the SystemExit raised there, and exit_on_sigterm
# must still unwind through `finally`, with 143
SIGTERM_DURING_A_FORK = """
import os, signal, time
from swarm.utils import process_control
process_control.exit_on_sigterm()
os.register_at_fork(after_in_parent=lambda: os.kill(os.getpid(), signal.SIGTERM))
try:
    process_control.wait(process_control.start(["true"], die_with_parent=True), 10)
    time.sleep(30)
finally:
    print("unwound", flush=True)
"""


def test_a_sigterm_python_drops_during_a_fork_still_unwinds_with_143(children: list) -> None:
    proc = python(children, SIGTERM_DURING_A_FORK, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 143, err
    assert out == b"unwound\n"
    assert b"Exception ignored" not in err


# --- the module itself ---------------------------------------------------------------------------


def _imported_roots(path: str, *, top_level_only: bool) -> set[str]:
    tree = ast.parse(Path(path).read_text())
    nodes = list(tree.body) if top_level_only else list(ast.walk(tree))
    imported = {alias.name.split(".")[0] for node in nodes if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in nodes if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    return {name if name == "swarm.utils" else name.split(".")[0] for name in imported}


def test_the_module_imports_only_the_standard_library() -> None:
    """swarm-sim imports it before torch; a benchmark's parent must not pay for torch either.
    Its modules of ours, the fork server's client (at its top: torch is imported by the server
    and the children it forks) and the network namespaces', import only the standard library."""
    imported = _imported_roots(process_control.__file__, top_level_only=False)
    assert imported - {"__future__", "swarm.utils"} <= set(sys.stdlib_module_names), imported
    stdlib = set(sys.stdlib_module_names) | {"__future__", "swarm.utils"}
    for module in (preloaded, preloaded_bootstrap, preloaded_child):
        assert _imported_roots(module.__file__, top_level_only=True) <= stdlib, module.__name__
    assert _imported_roots(netns.__file__, top_level_only=False) - {"__future__"} <= set(sys.stdlib_module_names)
    check = "import sys, swarm.utils.process_control; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", check], timeout=60).returncode == 0


def test_console_script_finds_the_installed_commands() -> None:
    for name in ("swarm-node", "swarm-dht", "swarm-sim"):
        assert os.access(process_control.console_script(name), os.X_OK)
    with pytest.raises(FileNotFoundError, match="no-such-command is not installed"):
        process_control.console_script("no-such-command")


def test_busy_processes_spin_while_the_block_runs_and_are_stopped_when_it_fails() -> None:
    with pytest.raises(RuntimeError), process_control.busy(2) as procs:
        pids = [p.pid for p in procs]

        def user_ticks(pid: int) -> int:  # user CPU time in clock ticks (proc(5): field 14)
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11])

        deadline = time.monotonic() + 30  # a busy machine gives them a tick late, never none
        while not all(user_ticks(pid) > 0 for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(user_ticks(pid) > 0 for pid in pids)  # they spin
        assert all(p.poll() is None for p in procs)  # and still run
        raise RuntimeError("the block failed")
    assert all(p.returncode is not None for p in procs)  # stopped and reaped
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
