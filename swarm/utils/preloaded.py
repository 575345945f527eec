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
  safe. With die_with_parent the child holds the read end of a pipe only the caller writes to,
  and sends itself SIGTERM when that pipe closes: when the caller exits, however it dies (the
  caller also closes it once it has read the child's exit code, or drops its PreloadedChild).
- It would inherit the server's network namespace: it enters the caller's first (or the one
  named by `netns`: swarm-sim's nodes on a lab's links), as an exec'd child under
  `ip netns exec` would be (netns.py says what that command does besides, and why a node
  needs none of it). It does so before it has a second thread or a socket; a namespace it
  cannot enter is a NetnsError on its stderr and exit 1, never a node in the wrong namespace.
- A child of the server that starts children of its own (rank 0 of a node of several ranks
  starts its followers, `python -m swarm.ranks.follower`) asks the same server, whose address
  it inherited through the fork. A process the server did not fork execs followers, since a
  server of its own would import what a follower saves.
- It holds nothing of the server's: the server ends with the caller that started it, not with
  the last of its children (_let_go_of_the_server says why).
- Modules were imported under the server's environment: a child whose PYTHON* variables
  differ from it (another PYTHONPATH, say) is exec'd instead. OMP_NUM_THREADS, which torch
  read at import, is applied again in the child.
- Python's atexit handlers do not run at its exit (multiprocessing ends children with
  os._exit, after flushing the standard streams); swarm registers none.

Anything but a swarm-node console script next to this interpreter (and a follower, above) is
exec'd as before.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from multiprocessing import forkserver, resource_tracker
from multiprocessing.reduction import sendfds
from pathlib import Path
from typing import IO, Any

from swarm.utils import netns as netns_module

__all__ = ["PreloadedChild", "preloadable", "start"]

SCRIPTS = ("swarm-node",)  # the console scripts forked from the server
# `python -m MODULE` command lines forked from the server by a process it forked itself
MODULES = {"swarm.ranks.follower": "swarm.ranks.follower:main"}
# what a node imports on its way to training: swarm, torch, and what torch imports lazily on
# first use (sympy, about 470 modules); each child would import them again otherwise
PRELOAD = ["torch", "sympy", "uvloop", "multiaddr", "setproctitle", "swarm.cli.node", "swarm.node.node",
           "swarm.model.llama", "swarm.observe.serve", "swarm.ranks.launch", "swarm.ranks.follower"]  # fmt: skip

_lock = threading.Lock()
_server_env: dict[str, str] | None = None  # os.environ when the server started: what it imported under
_forked = False  # this process is a child of the server and asks that server for its own children
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
    if env is not None and _python_env(env) != _python_env(_server_env if _server_env is not None else os.environ):
        return None
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m":
        return MODULES.get(argv[2]) if _forked else None
    path = Path(argv[0])
    if path.name not in SCRIPTS or path.parent != Path(sys.executable).parent:
        return None
    return _entry_point(path.name)


def _can_reach_parent_server() -> bool:
    """What _connect_to_parent_server needs of multiprocessing (Python 3.10 to 3.13): the
    server's address, and no authentication handshake (which 3.14 adds)."""
    server = forkserver._forkserver  # type: ignore[attr-defined]
    return getattr(server, "_forkserver_address", None) is not None and not hasattr(server, "_forkserver_authkey")


@functools.cache
def _entry_point(script: str) -> str | None:
    """The installed console script's "module:function" when it is one of ours (read once: the
    package metadata is files on disk, and swarm-sim starts a node at every churn event)."""
    found = [ep.value for ep in entry_points(group="console_scripts", name=script)]
    return found[0] if len(found) == 1 and found[0].startswith("swarm.") else None


class _Script:
    """What the server's child unpickles and runs (multiprocessing calls `_bootstrap` and exits
    with what it returns): the command line, as a fresh interpreter would run it."""

    def __init__(self, entry: str, argv: list[str], env: dict[str, str], cwd: str, new_session: bool,
                 die_with_parent: bool, netns: str | None, server_env: dict[str, str]) -> None:  # fmt: skip
        self.entry, self.argv, self.env, self.cwd = entry, argv, env, cwd
        self.new_session, self.die_with_parent, self.netns = new_session, die_with_parent, netns
        self.server_env = server_env

    def _bootstrap(self, parent_sentinel: int | None = None) -> int:
        try:
            self._become()
            module, function = self.entry.split(":")
            imported = __import__(module, fromlist=[function])
            # as the interpreter sets it: the script's path, or for `python -m M` the module's file
            module_run = self.argv[0] == sys.executable and self.argv[1:2] == ["-m"]
            sys.argv = [imported.__file__, *self.argv[3:]] if module_run else list(self.argv)
            code = _exit_code(getattr(imported, function)())  # a console script exits with what main returns
        except SystemExit as e:
            code = _exit_code(e.code)
        except netns_module.NetnsError as e:
            print(f"{Path(self.argv[0]).name}: error: NetnsError: {e}", file=sys.stderr)
            code = 1
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
        global _forked, _server_env
        if _can_reach_parent_server():  # else it starts a server of its own, as any process does
            _forked, _server_env = True, self.server_env
        _let_go_of_the_server()
        if self.new_session:
            os.setsid()
        # the caller's stdin, stdout and stderr, in order, the pipe that tells it we are set up,
        # its network namespace, and with die_with_parent the pipe that closes when it exits
        stdin, stdout, stderr, ready, caller_netns, *lifeline = forkserver.get_inherited_fds()
        stdio = [stdin, stdout, stderr]
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
        # the network namespace: after the streams, so that a failure is said on the caller's
        # stderr; while this process has one thread (setns moves only the calling thread, and
        # the threads started later follow it) and before anything opens a socket
        try:
            if self.netns is not None:
                netns_module.enter(self.netns)
            else:
                netns_module.enter_same_as(caller_netns)
        finally:
            os.close(caller_netns)
        if lifeline:
            _die_with_caller(lifeline[0])
        # its own command line in ps and /proc/PID/cmdline, not the server's: for an operator, and
        # for what finds a run's processes by their arguments (a test's check that none is left).
        # Before the environment changes: it finds the memory it rewrites from the process's
        # original argv and environ, which clearing os.environ moves
        import setproctitle

        setproctitle.setproctitle(" ".join(self.argv))
        os.environ.clear()
        os.environ.update(self.env)
        os.chdir(self.cwd)
        if (threads := self.env.get("OMP_NUM_THREADS", "")).isdigit() and int(threads) > 0:
            import torch

            torch.set_num_threads(int(threads))  # torch read the server's environment at import
        os.write(ready, b".")  # set up: the caller's start() returns
        os.close(ready)


def _let_go_of_the_server() -> None:
    """Close what multiprocessing gives a child of the server: the server's "alive" pipe and the
    resource tracker's. Held here, they would keep both processes running for as long as this
    child does, and with them the caller's stdout and stderr, which both inherited when the
    caller started them: a caller killed while its nodes run on (swarm-sim, SIGKILLed) would
    leave its pipes open to whoever reads them. The server ends with the caller instead."""
    server, tracker = forkserver._forkserver, resource_tracker._resource_tracker  # type: ignore[attr-defined]
    for owner, name in ((server, "_forkserver_alive_fd"), (tracker, "_fd")):
        if (fd := getattr(owner, name, None)) is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
            setattr(owner, name, None)


def _die_with_caller(lifeline: int) -> None:
    """SIGTERM to this process once the caller's end of `lifeline` closes (the caller exited, or
    is done with us), as PR_SET_PDEATHSIG gives an exec'd child of the caller: our parent is the
    server, not the caller, so the kernel's parent-death signal cannot say it."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(lifeline, 1):  # blocks for as long as the caller lives: that is its job
                pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="die-with-caller", daemon=True).start()


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"), as an interpreter prints it
    return 1


class PreloadedChild:
    """What process_control and its callers use of a subprocess.Popen, for a forked child."""

    def __init__(self, argv: list[str], status: int, streams: list[IO[Any] | None], text: bool,
                 lifeline: int | None) -> None:  # fmt: skip
        self.args, self._text = argv, text
        self._status = status  # the server's pipe for this child: its exit code comes there
        self._lifeline: int | None = None
        self._pidfd: int | None = None
        self.returncode: int | None = None  # set before anything can fail: __del__ reads it
        self.pid = _read_signed(status, FORK_TIMEOUT_S)  # the server writes it as it forks
        with contextlib.suppress(ProcessLookupError):  # gone already: its code is on the way
            self._pidfd = os.pidfd_open(self.pid)
        self.stdin, self.stdout, self.stderr = streams
        # ours from here (until now start() closes it on a failure): die_with_parent's pipe, the
        # child gets SIGTERM once it closes
        self._lifeline = lifeline

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
        for fd in (self._status, self._pidfd, self._lifeline):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._status, self._pidfd, self._lifeline = -1, None, None

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
    netns: str | None = None,
) -> PreloadedChild:  # fmt: skip
    """Fork `argv` (a preloadable command line: preloadable() gave `entry`) from the server; in
    the network namespace named `netns` (None: this process's)."""
    global _server_env
    ours: list[int] = []  # descriptors to close here once the server holds its copies
    kept: list[IO[Any] | None] = [None, None, None]  # our ends of the pipes the caller asked for
    fds: list[int] = []
    devnull: int | None = None
    lifeline: int | None = None  # our end of the die_with_parent pipe, the child's once it starts
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
        ready, ready_w = os.pipe()
        ours += [ready, ready_w]
        ours.append(own_netns := os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC))
        fds += [ready_w, own_netns]
        if die_with_parent:
            child_end, lifeline = os.pipe()
            ours.append(child_end)
            fds.append(child_end)
        with _lock:
            if _server_env is None:
                forkserver.set_forkserver_preload(PRELOAD)
                _server_env = dict(os.environ)
            status, data = _connect_to_parent_server(fds) if _forked else forkserver.connect_to_new_process(fds)
        script = _Script(entry, [str(a) for a in argv], dict(os.environ if env is None else env),
                         os.getcwd() if cwd is None else str(cwd), new_session, die_with_parent, netns,
                         _server_env)  # fmt: skip
        with open(data, "wb", closefd=True) as f:
            # what multiprocessing's child reads: its preparation (nothing: not the caller's
            # __main__, which multiprocessing would run again in the child), then what to run
            pickle.dump({}, f)
            pickle.dump(script, f)
        child = PreloadedChild(script.argv, status, kept, text, lifeline)
        lifeline = None  # the child's to close now
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
        if lifeline is not None:
            os.close(lifeline)
        raise
    finally:
        for fd in ours:
            with contextlib.suppress(OSError):
                os.close(fd)


def _connect_to_parent_server(fds: list[int]) -> tuple[int, int]:
    """forkserver.connect_to_new_process for a child of the server: the same request to the
    server that forked this process, which the child did not start (multiprocessing's own call
    would start a server of its own). (status pipe, data pipe), as that call returns them."""
    server = forkserver._forkserver  # type: ignore[attr-defined]
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(server._forkserver_address)
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        # in the places of the alive pipe and the resource tracker's, which this process let go
        # of and the child would let go of at once (_let_go_of_the_server): /dev/null
        placeholder = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            sendfds(client, [child_r, child_w, placeholder, placeholder, *fds])
            return parent_r, parent_w
        except BaseException:
            os.close(parent_r)
            os.close(parent_w)
            raise
        finally:
            for fd in (child_r, child_w, placeholder):
                os.close(fd)


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
