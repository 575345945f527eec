"""PreloadedChild: what a caller holds of a child forked from the preloaded server (preloaded.py).

It stands in for the subprocess.Popen an exec'd child would have been: poll, wait, communicate,
send_signal, terminate and kill, with `pid`, `args`, `returncode` and the standard streams the
caller asked pipes for. The child's parent is the server, not the caller, so its exit code comes
on the server's status pipe (the child's PID first, then that code, a signal's death as -N, as
Popen reports it), and signals go through a pidfd, which can never reach another process once
the child is gone.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import struct
import subprocess
import time
from typing import IO, Any

__all__ = ["PreloadedChild"]

# the longest start() waits for the server to fork: a server started by this call imports torch
# first (3 s on a quiet 2-core machine, past 30 s at load 40); a server that died closes the pipe
# at once, so only a hung one costs the whole wait
FORK_TIMEOUT_S = 300.0
_STATUS = struct.Struct("q")  # the server's pipe: the child's PID, then its exit code (a signal's as -N)


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
