"""What a child of the preloaded server (preloaded.py) does to be the process an exec'd command
line would be: the steps, in the order _Script takes them, then the script itself.

Each step is given the values it needs (the descriptors the caller handed the server, the
command line, the environment). They run in the forked child only, before and around the
console script's entry point; nothing here runs in the caller or in the server.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from multiprocessing import forkserver, resource_tracker
from pathlib import Path

from swarm.utils import netns as netns_module


def run_entry_point(entry: str, argv: list[str], setup: Callable[[], None]) -> int:
    """Run `setup`, then the entry point ("module:function") with `argv` as sys.argv, as a fresh
    interpreter runs the command line; the exit code it would give (an uncaught exception: its
    traceback and 1, a NetnsError of `setup`: one line and 1)."""
    try:
        setup()
        module, function = entry.split(":")
        imported = __import__(module, fromlist=[function])
        # as the interpreter sets it: the script's path, or for `python -m M` the module's file
        module_run = argv[0] == sys.executable and argv[1:2] == ["-m"]
        sys.argv = [imported.__file__, *argv[3:]] if module_run else list(argv)
        code = exit_code(getattr(imported, function)())  # a console script exits with what main returns
    except SystemExit as e:
        code = exit_code(e.code)
    except netns_module.NetnsError as e:
        print(f"{Path(argv[0]).name}: error: NetnsError: {e}", file=sys.stderr)
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


def exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"), as an interpreter prints it
    return 1


def let_go_of_the_server() -> None:
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


def take_streams(stdio: Sequence[int]) -> None:
    """Make the caller's stdin, stdout and stderr (`stdio`, descriptors in that order) this
    process's 0, 1 and 2, with Python streams over them."""
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


def enter_network_namespace(netns: str | None, caller_netns: int) -> None:
    """Enter the namespace named `netns`, or with None the caller's (`caller_netns`, a descriptor
    of it, closed here either way). After the streams, so that a failure is said on the caller's
    stderr; while this process has one thread (setns moves only the calling thread, and the
    threads started later follow it) and before anything opens a socket."""
    try:
        if netns is not None:
            netns_module.enter(netns)
        else:
            netns_module.enter_same_as(caller_netns)
    finally:
        os.close(caller_netns)


def die_with_caller(lifeline: int) -> None:
    """SIGTERM to this process once the caller's end of `lifeline` closes (the caller exited, or
    is done with us), as PR_SET_PDEATHSIG gives an exec'd child of the caller: our parent is the
    server, not the caller, so the kernel's parent-death signal cannot say it."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(lifeline, 1):  # blocks for as long as the caller lives: that is its job
                pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="die-with-caller", daemon=True).start()


def take_command_line(argv: list[str], env: dict[str, str], cwd: str) -> None:
    """Become the command line `argv` in the caller's environment `env` and directory `cwd`."""
    # its own command line in ps and /proc/PID/cmdline, not the server's: for an operator, and
    # for what finds a run's processes by their arguments (a test's check that none is left).
    # Before the environment changes: it finds the memory it rewrites from the process's
    # original argv and environ, which clearing os.environ moves
    import setproctitle

    setproctitle.setproctitle(" ".join(argv))
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if (threads := env.get("OMP_NUM_THREADS", "")).isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))  # torch read the server's environment at import
