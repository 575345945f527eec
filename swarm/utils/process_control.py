"""Child processes: start one, read the JSON line it prints once it is ready, stop it, reap it.

    proc = process_control.start([console_script("swarm-dht"), "serve", "--json"], stdout=subprocess.PIPE)
    try:
        info = process_control.read_json_line(proc, timeout=30, what="swarm-dht serve")
        ...
    finally:
        process_control.stop(proc, grace=10)     # SIGTERM, SIGKILL after 10 s, reaped

Everything that runs children does it through this module: swarm-sim's nodes, the benchmarks'
workers (scripts/) and the multi-process tests. The rules it keeps:

- A child starts in its own session (`new_session=True`): its own process group, so a Ctrl+C on
  the terminal reaches only the parent, which then stops its children in order, and a signal to
  the group (`group=True`) also reaches whatever the child started.
- A signal is sent only while the child is unreaped: until then neither its PID nor the group id
  it leads can be reused, so a stop never hits a stranger. `Popen.poll()` and `wait()` reap.
- stop = ask (SIGTERM, or nothing when the caller asked in its own way, e.g. by closing the
  child's stdin), wait up to a grace period, SIGKILL, reap. Many children share one deadline.
  With `group=True` the SIGKILL goes to the group even when the child exited in its grace (it is
  left unreaped until then), so nothing it started survives it.
- Every wait has a timeout; a read that times out says which child and how long.

A swarm-node command line is not exec'd but forked from a server that has imported torch and
swarm once (preloaded.py): the same process to every caller, at a fraction of the CPU. A child
meant for a named network namespace (a lab's endpoint) gets its name as `netns`, not an
`ip netns exec` prefix on its command line, so that a node there is forked too.

Failure modes: what a child started is out of reach once the child is reaped (by the caller's
own poll() or wait() before the stop) or if it left the group (setsid); the hivemind comparisons
in scripts/ hunt those with psutil. Linux and macOS (process groups, select on pipes; without
waitid a group stop reaps early). Pure stdlib: swarm-sim imports it before torch, and nothing
here may import torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, cast

from swarm.utils import netns as netns_module
from swarm.utils import preloaded, preloaded_child

REAP_S = 10.0  # how long to wait for a SIGKILLed child to be reaped
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_READ_CHUNK = 1 << 16
_POLL_S = 0.02  # how often a wait that must not reap the child looks again

Stdio = int | IO[Any] | None  # what Popen takes for stdin / stdout / stderr

# stdout bytes read past the last line read_json_line returned, per child: its next call starts there
_unread: weakref.WeakKeyDictionary[subprocess.Popen[Any], bytearray] = weakref.WeakKeyDictionary()


class ChildExited(RuntimeError):
    """The child closed its stdout (it exited) before printing what we waited for."""


# --- starting ----------------------------------------------------------------------------------


def console_script(name: str) -> str:
    """The path of an installed console script (swarm-node, swarm-dht, swarm-sim): the one next to
    this interpreter (a venv's, activated or not), else the one on PATH."""
    beside_python = Path(sys.executable).parent / name
    path = str(beside_python) if beside_python.exists() else shutil.which(name)
    if path is None:
        raise FileNotFoundError(f"{name} is not installed as a console script (pip install -e .)")
    return path


def start(
    argv: Sequence[str],
    *,
    stdin: Stdio = None,
    stdout: Stdio = None,
    stderr: Stdio = None,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    text: bool = False,
    new_session: bool = True,
    die_with_parent: bool = False,
    netns: str | None = None,
) -> subprocess.Popen[Any]:
    """Start a child, by default in its own session (see the module docstring). With
    `die_with_parent` it gets SIGTERM when this process dies, even by SIGKILL (Linux only).
    With `netns` it runs in that named network namespace (`ip netns add`; a lab's endpoint).
    A swarm-node command line is forked from a server that has torch imported (preloaded.py),
    and enters the namespace itself: what it returns then has the Popen methods and attributes
    this module and its callers use. Any other command runs under `ip netns exec NETNS`, which
    execs it: the PID returned is the command's either way."""
    if (entry := preloaded.preloadable(argv, env)) is not None:
        child = preloaded.start(entry, argv, stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=cwd, text=text,
                                new_session=new_session, die_with_parent=die_with_parent, netns=netns)  # fmt: skip
        return cast("subprocess.Popen[Any]", child)
    if netns is not None:
        argv = [*netns_module.exec_prefix(netns), *argv]
    return subprocess.Popen(
        list(argv), stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=cwd, text=text,
        start_new_session=new_session, preexec_fn=_die_with_parent if die_with_parent else None,
    )  # fmt: skip


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (PR_SET_PDEATHSIG); a
    no-op where there is no prctl. Call it first thing in a child, or use start(die_with_parent=True)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def _die_with_parent() -> None:  # preexec_fn: runs in the child between fork and exec
    die_with_parent()


class TerminatedBySigterm(SystemExit):
    """What exit_on_sigterm's handler raises: SystemExit with code 143."""


def exit_on_sigterm() -> None:
    """In a parent: SIGTERM unwinds like Ctrl+C (SystemExit 143), so `finally` blocks stop the
    children instead of leaving them running.

    Python drops an exception raised where nothing can catch it: a SIGTERM that comes while the
    process forks through the at-fork hooks (a child with a preexec_fn, as die_with_parent starts
    one) is handled inside logging's hook, and the SystemExit only prints "Exception ignored".
    Such a drop goes through sys.unraisablehook; ours then sends SIGTERM again from a thread, so
    that it lands in the main code a moment later."""

    def raise_exit(*_: Any) -> None:
        raise TerminatedBySigterm(128 + signal.SIGTERM)

    def redeliver_dropped(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, TerminatedBySigterm):
            previous_hook(unraisable)
            return
        again = threading.Timer(_REDELIVER_S, os.kill, (os.getpid(), signal.SIGTERM))
        again.daemon = True
        again.start()

    previous_hook = sys.unraisablehook
    sys.unraisablehook = redeliver_dropped
    signal.signal(signal.SIGTERM, raise_exit)


_REDELIVER_S = 0.05  # past the fork hook that dropped it; nothing waits on it


# --- reading what it prints --------------------------------------------------------------------


def read_json_line(
    proc: subprocess.Popen[Any], timeout: float, *, prefix: str = "", what: str | None = None
) -> dict[str, Any]:
    """The next line of the child's stdout (a pipe) that is `prefix` + a JSON object, parsed;
    other lines are skipped (a library may print first). Raises TimeoutError after `timeout`
    seconds of waiting and ChildExited when the child closes its stdout first; the caller stops
    it. Once called for a child, read its stdout only through here: bytes past the line returned
    are kept for the next call (reading the pipe directly would miss them)."""
    assert proc.stdout is not None, "start the child with stdout=subprocess.PIPE"
    name = what or _describe(proc)
    fd = proc.stdout.fileno()
    buffer = _unread.setdefault(proc, bytearray())
    deadline = time.monotonic() + timeout
    while True:
        while (end := buffer.find(b"\n")) >= 0:
            line = bytes(buffer[:end])
            del buffer[: end + 1]
            if (found := _parse(line, prefix)) is not None:
                return found
        remaining = deadline - time.monotonic()
        # select, not a blocking read: the wait is bounded; os.read, not readline: no data hides
        # in a Python-level buffer that select cannot see
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise TimeoutError(f"{name} printed no JSON line within {timeout:g}s")
        chunk = os.read(fd, _READ_CHUNK)
        if not chunk:
            last = bytes(buffer)  # a last line without its newline
            buffer.clear()
            if (found := _parse(last, prefix)) is not None:
                return found
            raise ChildExited(f"{name} {_exit_status(proc, 1.0)} before printing a JSON line")
        buffer += chunk


def _parse(line: bytes, prefix: str) -> dict[str, Any] | None:
    text = line.decode(errors="replace").rstrip("\r")
    if not text.startswith(prefix):
        return None
    try:
        found = json.loads(text[len(prefix) :])
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def _exit_status(proc: subprocess.Popen[Any], timeout: float) -> str:
    """How the child ended, once it exits within `timeout` seconds, left unreaped."""
    if _wait_unreaped(proc, time.monotonic() + timeout):
        return f"exited (code {_peek(proc)})"
    return "closed its stdout"


def _describe(proc: subprocess.Popen[Any]) -> str:
    args = proc.args if isinstance(proc.args, str | bytes) else " ".join(map(str, proc.args))
    return f"child {proc.pid} ({args[:200]})"


# --- stopping ----------------------------------------------------------------------------------


def send_signal(proc: subprocess.Popen[Any], sig: int, *, group: bool = False) -> bool:
    """Send `sig` to the child (with `group`, to its process group) if it is still unreaped;
    True when sent. Safe to call at any time: a reaped child's PID may be a stranger's by now,
    so nothing is sent; an unreaped one that exited (a zombie) ignores it, its group does not."""
    if proc.returncode is not None:  # reaped: by Popen.poll / wait, which set returncode
        return False
    try:
        if group:
            os.killpg(proc.pid, sig)
        elif isinstance(proc, preloaded_child.PreloadedChild):
            proc.send_signal(sig)  # through its pidfd: its parent is the fork server, which reaps it
        else:
            os.kill(proc.pid, sig)
    except (ProcessLookupError, PermissionError):  # exited meanwhile (a zombie's group may be empty)
        return False
    return True


def close_stdin(proc: subprocess.Popen[Any]) -> None:
    """Close our end of the child's stdin: a child that reads it sees EOF, its cue to finish."""
    if proc.stdin is not None:
        with contextlib.suppress(OSError, ValueError):  # a broken pipe: it is gone already
            proc.stdin.close()


def wait(proc: subprocess.Popen[Any], timeout: float | None) -> int | None:
    """The child's exit code once it exits (reaped), or None if it still runs after `timeout`
    seconds (None: wait as long as it takes)."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def _peek(proc: subprocess.Popen[Any]) -> int | None:
    """The child's exit code without reaping it (None while it runs): until it is reaped its PID,
    and the process group it leads, cannot be reused."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (ChildProcessError, AttributeError):  # reaped behind Popen's back; no waitid: reap it
        return proc.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status  # Popen's convention


def _wait_unreaped(proc: subprocess.Popen[Any], deadline: float) -> bool:
    """Wait until the child exits or time.monotonic() reaches `deadline`, without reaping it
    (waitid has no timeout: look every _POLL_S); True once it has exited."""
    while _peek(proc) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def wait_all(procs: Sequence[subprocess.Popen[Any]], timeout: float) -> list[subprocess.Popen[Any]]:
    """Wait for all of them, `timeout` seconds in total; those still running then."""
    deadline = time.monotonic() + timeout
    return [proc for proc in procs if wait(proc, max(0.0, deadline - time.monotonic())) is None]


def stop_all(
    procs: Sequence[subprocess.Popen[Any]],
    grace: float,
    *,
    term: int | None = signal.SIGTERM,
    group: bool = False,
    reap_s: float | None = REAP_S,
) -> None:
    """Send each running child `term` (None: send nothing, the caller has asked them to stop in
    its own way), wait up to `grace` seconds in total, then SIGKILL whatever still runs and reap
    it, waiting up to `reap_s` seconds each (None: as long as it takes). Children already reaped
    are left alone.

    With `group` the signals go to each child's process group, and the children are not reaped
    while they get their grace: so the group id stays theirs, and the SIGKILL also reaches what
    a child started and left behind when it exited (a daemon that ignored SIGTERM)."""
    if term is not None:
        for proc in procs:
            send_signal(proc, term, group=group)
    deadline = time.monotonic() + grace
    if group:
        for proc in procs:
            _wait_unreaped(proc, deadline)
        late = list(procs)  # a zombie leader's group may still hold its children
    else:
        late = [proc for proc in procs if wait(proc, max(0.0, deadline - time.monotonic())) is None]
    for proc in late:
        send_signal(proc, signal.SIGKILL, group=group)
        wait(proc, reap_s)


def stop(
    proc: subprocess.Popen[Any],
    grace: float,
    *,
    term: int | None = signal.SIGTERM,
    group: bool = False,
    reap_s: float | None = REAP_S,
) -> int | None:
    """stop_all for one child; its exit code (None if it was not reaped in time)."""
    stop_all([proc], grace, term=term, group=group, reap_s=reap_s)
    return proc.returncode


def kill(proc: subprocess.Popen[Any], *, group: bool = False, reap_s: float | None = REAP_S) -> int | None:
    """SIGKILL the child if it still runs (no goodbye) and reap it; its exit code."""
    return stop(proc, 0.0, term=None, group=group, reap_s=reap_s)


BUSY_LOOP = "while True: pass"  # one core's worth of load, until stopped


def start_busy(count: int, *, stdout: Stdio = subprocess.DEVNULL) -> list[subprocess.Popen[Any]]:
    """`count` processes that each spin a core until stopped: the load of a busy machine beside
    a swarm (the benchmarks' --busy, the soak's load bursts, tests of timing under load)."""
    return [start([sys.executable, "-c", BUSY_LOOP], stdout=stdout, stderr=stdout) for _ in range(count)]


@contextlib.contextmanager
def busy(count: int) -> Iterator[list[subprocess.Popen[Any]]]:
    """start_busy for the length of a block; they are stopped by PID when it ends, however it ends."""
    procs = start_busy(count)
    try:
        yield procs
    finally:
        stop_all(procs, 5.0)
