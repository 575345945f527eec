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
  the last of its children (preloaded_bootstrap.let_go_of_the_server says why).
- Modules were imported under the server's environment: a child whose PYTHON* variables
  differ from it (another PYTHONPATH, say) is exec'd instead. OMP_NUM_THREADS, which torch
  read at import, is applied again in the child.
- Python's atexit handlers do not run at its exit (multiprocessing ends children with
  os._exit, after flushing the standard streams); swarm registers none.

Anything but a swarm-node console script next to this interpreter (and a follower, above) is
exec'd as before.

This module is the caller's side: which command lines are forked, the request to the server,
and what the server's child unpickles (_Script). The steps that child takes before it runs the
script are preloaded_bootstrap.py's; what the caller holds of it is a PreloadedChild
(preloaded_child.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from multiprocessing import forkserver
from multiprocessing.reduction import sendfds
from pathlib import Path
from typing import IO, Any

from swarm.utils import preloaded_bootstrap as bootstrap
from swarm.utils import preloaded_child

__all__ = ["preloadable", "start"]

SCRIPTS = ("swarm-node",)  # the console scripts forked from the server
# `python -m MODULE` command lines forked from the server by a process it forked itself
MODULES = {"swarm.ranks.follower": "swarm.ranks.follower:main"}
# what a node imports on its way to training: swarm, torch, and what torch imports lazily on
# first use (sympy, about 470 modules, under the sharding of --nproc-per-node's ranks); each
# child would import them again otherwise
PRELOAD = ["torch", "sympy", "uvloop", "multiaddr", "setproctitle", "swarm.cli.node", "swarm.node.node",
           "swarm.model.llama", "swarm.observe.serve", "swarm.ranks.launch", "swarm.ranks.follower"]  # fmt: skip

_lock = threading.Lock()
_server_env: dict[str, str] | None = None  # os.environ when the server started: what it imported under
_forked = False  # this process is a child of the server and asks that server for its own children
SETUP_TIMEOUT_S = 30.0  # the longest start() waits for a child to be in its session with its streams


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
        return bootstrap.run_entry_point(self.entry, self.argv, setup=self._become)

    def _become(self) -> None:
        global _forked, _server_env
        if _can_reach_parent_server():  # else it starts a server of its own, as any process does
            _forked, _server_env = True, self.server_env
        bootstrap.let_go_of_the_server()
        if self.new_session:
            os.setsid()
        # the caller's stdin, stdout and stderr, in order, the pipe that tells it we are set up,
        # its network namespace, and with die_with_parent the pipe that closes when it exits
        stdin, stdout, stderr, ready, caller_netns, *lifeline = forkserver.get_inherited_fds()
        bootstrap.take_streams([stdin, stdout, stderr])
        bootstrap.enter_network_namespace(self.netns, caller_netns)
        if lifeline:
            bootstrap.die_with_caller(lifeline[0])
        bootstrap.take_command_line(self.argv, self.env, self.cwd)
        os.write(ready, b".")  # set up: the caller's start() returns
        os.close(ready)


Stdio = int | IO[Any] | None


def start(
    entry: str, argv: Sequence[str], *, stdin: Stdio, stdout: Stdio, stderr: Stdio,
    env: Mapping[str, str] | None, cwd: str | Path | None, text: bool, new_session: bool, die_with_parent: bool,
    netns: str | None = None,
) -> preloaded_child.PreloadedChild:  # fmt: skip
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
        child = preloaded_child.PreloadedChild(script.argv, status, kept, text, lifeline)
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
        # of and the child would let go of at once (bootstrap.let_go_of_the_server): /dev/null
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
