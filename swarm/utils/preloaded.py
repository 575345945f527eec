"""swarm-node children forked from a server that has imported torch and swarm once.

A swarm-node process spends 2 to 3 s of CPU importing torch and swarm before it reads its
first flag. swarm-sim, the soak, the benchmarks and the tests start dozens of nodes, on
machines of 2 cores, where that import was a third of the CPU a short run costs. So
process_control.start forks swarm-node children from multiprocessing's forkserver: one server
per parent process, started with the first such child, which imports PRELOAD once; each child
is a fork of it that runs the console script's entry point with the arguments, environment,
working directory and standard streams the caller gave.

The child is a process of its own as an exec'd one is: its own PID, session, sockets, signals
and exit code (a signal's death reads as -N, as Popen reports it). What differs, and how it is
kept from mattering:
- Its parent is the server, not the caller: the caller reads the exit code from the server's
  pipe (multiprocessing's sentinel) and signals the child through a pidfd, which can never
  reach another process once the child is gone, so a PID reused after the server reaped it is
  safe. die_with_parent holds through the server, which exits when its own parent does.
- Modules were imported under the server's environment: a child whose PYTHON* variables
  differ from it (another PYTHONPATH, say) is exec'd instead. OMP_NUM_THREADS, which torch
  read at import, is applied again in the child.
- Python's atexit handlers do not run at its exit (multiprocessing ends children with
  os._exit, after flushing the standard streams); swarm registers none.

Anything but a swarm-node console script next to this interpreter is exec'd as before.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from multiprocessing import forkserver
from pathlib import Path
from typing import IO, Any

__all__ = ["PreloadedChild", "preloadable", "start"]

SCRIPTS = ("swarm-node",)  # the console scripts forked from the server
# what a node imports on its way to training: swarm, torch, and what torch imports lazily on
# first use (sympy, about 470 modules); each child would import them again otherwise
PRELOAD = ["torch", "sympy", "uvloop", "multiaddr", "setproctitle", "swarm.cli.node", "swarm.node.node",
           "swarm.model.llama", "swarm.observe.serve", "swarm.ranks.launch"]  # fmt: skip

_lock = threading.Lock()
_server_env: dict[str, str] | None = None  # os.environ when the server started: what it imported under
SETUP_TIMEOUT_S = 30.0  # the longest start() waits for a child to be in its session with its streams
# the longest start() waits for the server to fork: a server started by this call imports torch
# first (3 s on a quiet 2-core machine, past 30 s at load 40); a server that died closes the pipe
# at once, so only a hung one costs the whole wait
FORK_TIMEOUT_S = 300.0
_STATUS = struct.Struct("q")  # the server's pipe: the child's PID, then its exit code (a signal's as -N)


def _python_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("PYTHON")}


def preloadable(argv: Sequence[str], env: Mapping[str, str] | None) -> str | None:
    """The entry point ("module:function") to fork for this command line, or None to exec it."""
    if not argv or not hasattr(os, "pidfd_open"):  # Linux 5.3 and later
        return None
    path = Path(argv[0])
    if path.name not in SCRIPTS or path.parent != Path(sys.executable).parent:
        return None
    if env is not None and _python_env(env) != _python_env(_server_env if _server_env is not None else os.environ):
        return None
    return _entry_point(path.name)


@functools.cache
def _entry_point(script: str) -> str | None:
    """The installed console script's "module:function" when it is one of ours (read once: the
    package metadata is files on disk, and swarm-sim starts a node at every churn event)."""
    found = [ep.value for ep in entry_points(group="console_scripts", name=script)]
    return found[0] if len(found) == 1 and found[0].startswith("swarm.") else None


class _Script:
    """What the server's child unpickles and runs (multiprocessing calls `_bootstrap` and exits
    with what it returns): the command line, as a fresh interpreter would run it."""

    def __init__(self, entry: str, argv: list[str], env: dict[str, str], cwd: str | None, new_session: bool,
                 die_with_parent: bool) -> None:  # fmt: skip
        self.entry, self.argv, self.env, self.cwd = entry, argv, env, cwd
        self.new_session, self.die_with_parent = new_session, die_with_parent

    def _bootstrap(self, parent_sentinel: int | None = None) -> int:
        try:
            self._become()
            module, function = self.entry.split(":")
            main = getattr(__import__(module, fromlist=[function]), function)
            main()
            code = 0
        except SystemExit as e:
            code = _exit_code(e.code)
        except BaseException:  # what an uncaught exception does to an interpreter: a traceback, exit 1
            traceback.print_exc()
            code = 1
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at an interpreter's exit
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        return code

    def _become(self) -> None:
        if self.new_session:
            os.setsid()
        if self.die_with_parent:
            from swarm.utils.process_control import die_with_parent

            die_with_parent()
        # the caller's stdin, stdout and stderr, in order, and the pipe that tells it we are set up
        *stdio, ready = forkserver.get_inherited_fds()
        for target, fd in enumerate(stdio):
            if fd != target:
                os.dup2(fd, target)
        for fd in set(stdio) - {0, 1, 2}:
            os.close(fd)
        # fresh Python streams over 0, 1 and 2: the server's were made for its own, and a terminal
        # on stdout gets line buffering as it does in a fresh interpreter
        sys.stdin = open(0, closefd=False, encoding="utf-8")  # noqa: SIM115
        sys.stdout = open(1, "w", closefd=False, encoding="utf-8")  # noqa: SIM115
        sys.stdout.reconfigure(line_buffering=os.isatty(1))
        sys.stderr = open(2, "w", closefd=False, encoding="utf-8", errors="backslashreplace")  # noqa: SIM115
        sys.stderr.reconfigure(line_buffering=True)
        # its own command line in ps and /proc/PID/cmdline, not the server's: for an operator, and
        # for what finds a run's processes by their arguments (a test's check that none is left).
        # Before the environment changes: it finds the memory it rewrites from the process's
        # original argv and environ, which clearing os.environ moves
        import setproctitle

        setproctitle.setproctitle(" ".join(self.argv))
        os.environ.clear()
        os.environ.update(self.env)
        if self.cwd is not None:
            os.chdir(self.cwd)
        if (threads := self.env.get("OMP_NUM_THREADS", "")).isdigit() and int(threads) > 0:
            import torch

            torch.set_num_threads(int(threads))  # torch read the server's environment at import
        sys.argv = list(self.argv)
        os.write(ready, b".")  # set up: the caller's start() returns
        os.close(ready)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"), as an interpreter prints it
    return 1


class PreloadedChild:
    """What process_control and its callers use of a subprocess.Popen, for a forked child."""

    def __init__(self, argv: list[str], status: int, streams: list[IO[Any] | None], text: bool) -> None:
        self.args, self._text = argv, text
        self._status = status  # the server's pipe for this child: its exit code comes there
        self._pidfd: int | None = None
        self.returncode: int | None = None  # set before anything can fail: __del__ reads it
        self.pid = _read_signed(status, FORK_TIMEOUT_S)  # the server writes it as it forks
        with contextlib.suppress(ProcessLookupError):  # gone already: its code is on the way
            self._pidfd = os.pidfd_open(self.pid)
        self.stdin, self.stdout, self.stderr = streams

    def poll(self) -> int | None:
        return self._wait_status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._wait_status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Popen.communicate without input: what the child writes to our pipes until it closes
        them, then its exit. TimeoutExpired after `timeout` seconds (what was read is lost)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fds = [None if s is None else s.fileno() for s in (self.stdout, self.stderr)]
        read = {fd: bytearray() for fd in fds if fd is not None}
        open_fds = set(read)
        while open_fds:
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or not (ready := select.select(list(open_fds), [], [], left)[0]):
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                read[fd] += chunk
                if not chunk:
                    open_fds.discard(fd)
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out = [None if fd is None else bytes(read[fd]) for fd in fds]
        if self._text:
            return tuple(None if o is None else o.decode("utf-8", errors="replace") for o in out)  # type: ignore[return-value]
        return out[0], out[1]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):  # exited, its code not read yet
                signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _wait_status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            if not select.select([self._status], [], [], timeout)[0]:
                return None
            try:
                self.returncode = _read_signed(self._status, 5.0)
            except (OSError, EOFError):  # the server died: the child's code is lost
                self.returncode = 255
            self._close()
        return self.returncode

    def _close(self) -> None:
        for fd in (self._status, self._pidfd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._status, self._pidfd = -1, None

    def __del__(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(Exception):
                self._close()


def _read_signed(fd: int, timeout: float | None) -> int:
    data = b""
    while len(data) < _STATUS.size:
        if timeout is not None and not select.select([fd], [], [], timeout)[0]:
            raise EOFError("the fork server did not answer")
        chunk = os.read(fd, _STATUS.size - len(data))
        if not chunk:
            raise EOFError("the fork server closed the pipe")
        data += chunk
    return _STATUS.unpack(data)[0]


Stdio = int | IO[Any] | None


def start(
    entry: str, argv: Sequence[str], *, stdin: Stdio, stdout: Stdio, stderr: Stdio,
    env: Mapping[str, str] | None, cwd: str | Path | None, text: bool, new_session: bool, die_with_parent: bool,
) -> PreloadedChild:  # fmt: skip
    """Fork `argv` (a preloadable command line: preloadable() gave `entry`) from the server."""
    global _server_env
    ours: list[int] = []  # descriptors to close here once the server holds its copies
    kept: list[IO[Any] | None] = [None, None, None]  # our ends of the pipes the caller asked for
    fds: list[int] = []
    devnull: int | None = None
    try:
        for target, spec in enumerate((stdin, stdout, stderr)):
            if spec is None and _open(target):
                fds.append(target)  # what this process has there, as an exec'd child inherits it
            elif spec is None or spec == subprocess.DEVNULL:
                if devnull is None:
                    devnull = os.open(os.devnull, os.O_RDWR)
                    ours.append(devnull)
                fds.append(devnull)
            elif spec == subprocess.PIPE:
                read, write = os.pipe()
                child_end, our_end = (read, write) if target == 0 else (write, read)
                ours.append(child_end)
                mode = ("w" if target == 0 else "r") + ("" if text else "b")
                kept[target] = open(our_end, mode, buffering=-1 if text else 0)  # noqa: SIM115
                fds.append(child_end)
            elif spec == subprocess.STDOUT and target == 2:
                fds.append(fds[1])
            else:
                fds.append(spec if isinstance(spec, int) else spec.fileno())
        script = _Script(entry, [str(a) for a in argv], dict(os.environ if env is None else env),
                         None if cwd is None else str(cwd), new_session, die_with_parent)  # fmt: skip
        with _lock:
            if _server_env is None:
                forkserver.set_forkserver_preload(PRELOAD)
                _server_env = dict(os.environ)
            ready, ready_w = os.pipe()
            ours += [ready, ready_w]
            status, data = forkserver.connect_to_new_process([*fds, ready_w])
        with open(data, "wb", closefd=True) as f:
            # what multiprocessing's child reads: its preparation (nothing: not the caller's
            # __main__, which multiprocessing would run again in the child), then what to run
            pickle.dump({}, f)
            pickle.dump(script, f)
        child = PreloadedChild(script.argv, status, kept, text)
        ours.remove(ready_w)
        os.close(ready_w)  # the child holds its copy: EOF here once it is gone
        # as Popen returns once the child is set up (its session, its streams): a stop or a
        # group signal right away must find it there. EOF: it died first, which poll() will say
        select.select([ready], [], [], SETUP_TIMEOUT_S)
        return child
    except BaseException:
        for stream in kept:
            if stream is not None:
                stream.close()
        raise
    finally:
        for fd in ours:
            with contextlib.suppress(OSError):
                os.close(fd)


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
