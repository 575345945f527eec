"""The processes and files a hivemind node leaves behind, for the hivemind comparisons.

hivemind's P2P starts a `p2pd` daemon; its DHT and averager run in forked processes that talk to
p2pd over unix sockets in /tmp. Its graceful shutdown can leave socket files behind, and a p2pd
whose parent died is re-parented to init. The hivemind_* scripts record these processes with
psutil (which refuses to signal a PID that has been reused) and clean up with the helpers here:

- running(proc) / exists(proc): alive and not a zombie / not yet reaped;
- socket_files(procs): the unix socket files of p2pd and of the p2p clients of these processes;
- remove_files(paths): delete them, quietly (one may be gone already).

Needs psutil (the `bench` extra), imported when first called.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from typing import Any

P2PD_LISTEN_ARG = "-listen=/unix"  # p2pd's argument: -listen=/unix/tmp/hivemind-p2pd-<id>.sock
SOCKET_PREFIX = "/tmp/hivemind-"  # where hivemind's P2P puts its daemon and client sockets


def running(proc: Any) -> bool:
    """A psutil.Process that exists and is not a zombie (False for a pid that has been reused)."""
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def exists(proc: Any) -> bool:
    """True while the psutil.Process exists, zombie or not (False for a pid that has been reused)."""
    import psutil

    try:
        return proc.is_running()
    except psutil.Error:
        return False


def socket_files(procs: Iterable[Any], *, connections: bool = True) -> set[str]:
    """Unix socket files of hivemind's p2pd among these psutil.Processes (from its `-listen=`
    argument, with the matching p2pclient socket of the P2P that started it) and, with
    `connections`, those the processes listen on under SOCKET_PREFIX (the other p2p clients, e.g.
    an averager's `replicate_p2p`: hivemind's shutdown leaves them). Processes gone are skipped."""
    import psutil

    paths: set[str] = set()
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            for arg in proc.cmdline():
                if arg.startswith(P2PD_LISTEN_ARG):
                    daemon = arg[len(P2PD_LISTEN_ARG) :]
                    paths |= {daemon, daemon.replace("/hivemind-p2pd-", "/hivemind-p2pclient-")}
        if connections:  # slower (it reads /proc/net/unix): not while a start is being timed
            with contextlib.suppress(psutil.Error):
                for unix in proc.net_connections(kind="unix"):
                    if isinstance(unix.laddr, str) and unix.laddr.startswith(SOCKET_PREFIX):
                        paths.add(unix.laddr)
    return paths


def remove_files(paths: Iterable[str]) -> None:
    """Delete these files; one already gone (or not ours to delete) is skipped."""
    for path in paths:
        with contextlib.suppress(OSError):
            os.remove(path)
