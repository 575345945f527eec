"""Named network namespaces (`ip netns add NAME`): enter one from inside a process, or run a
program in one.

    netns.enter("swarmlab-4242-sim-1a2b-node0")   # this thread, and the threads it starts later
    argv = [*netns.exec_prefix("swarmlab-4242-sim-1a2b-node0"), "sysctl", "-w", ...]

A forked swarm-node enters its namespace itself (preloaded.py), first thing while it has one
thread: setns on a network namespace moves only the calling thread, and a socket stays in the
namespace it was made in. Anything else that runs in a namespace is exec'd under `ip netns exec`.

What `ip netns exec` also does, and a node entering with setns goes without: it unshares the
mount namespace to remount /sys (so /sys/class/net lists the namespace's interfaces) and
bind-mounts the files of /etc/netns/NAME over /etc (a resolv.conf or hosts of the namespace's
own). A node needs neither: it listens on and dials the literal IP addresses of its
multiaddrs, it never reads /sys, and the labs that make these namespaces write no /etc/netns
files, so `ip netns exec` would leave /etc as it is too. (/proc/self/net follows the namespace
of the thread that reads it, with or without the remount.)

Pure stdlib: preloaded.py runs it in a child before anything else.
"""

from __future__ import annotations

import ctypes
import os
import shutil

__all__ = ["NetnsError", "enter", "enter_same_as", "exec_prefix", "path"]

RUN_NETNS = "/run/netns"  # where `ip netns add` mounts a named namespace
CLONE_NEWNET = 0x40000000  # <sched.h>
SBIN = ("/usr/sbin", "/sbin")  # where iproute2 lives, often outside a user's PATH


class NetnsError(OSError):
    """This process cannot enter the network namespace; the message says which and why."""


def path(name: str) -> str:
    """The file of a named namespace; a name that could leave RUN_NETNS is refused."""
    if not name or "/" in name or name in (".", ".."):
        raise NetnsError(f"{name!r} is not a network namespace name")
    return os.path.join(RUN_NETNS, name)


def enter(name: str) -> None:
    """Move the calling thread into the named network namespace. Call it while the process has
    one thread (a thread started before stays where it was) and before it opens a socket.
    Raises NetnsError (a missing namespace, no CAP_SYS_ADMIN)."""
    where = path(name)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise NetnsError(f"cannot enter network namespace {name!r}: {where}: {e.strerror}") from None
    try:
        _setns(fd, f"network namespace {name!r}")
    finally:
        os.close(fd)


def enter_same_as(fd: int) -> None:
    """Move the calling thread into the network namespace that `fd` (a /proc/PID/ns/net opened
    by another process) refers to, unless it is there already: setns needs CAP_SYS_ADMIN even
    for the namespace one is in, which an unprivileged user lacks. The same rules as enter()."""
    there, here = os.fstat(fd), os.stat("/proc/thread-self/ns/net")
    if (there.st_dev, there.st_ino) != (here.st_dev, here.st_ino):
        _setns(fd, "the caller's network namespace")


def _setns(fd: int, what: str) -> None:
    try:
        if hasattr(os, "setns"):  # Python 3.12 and later
            os.setns(fd, CLONE_NEWNET)
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
    except OSError as e:
        raise NetnsError(f"cannot enter {what}: setns: {e.strerror}") from None


def exec_prefix(name: str) -> list[str]:
    """The argv prefix that runs a program in the named namespace: `ip netns exec NAME`."""
    path(name)
    ip = shutil.which("ip", path=os.pathsep.join([os.environ.get("PATH", os.defpath), *SBIN]))
    if ip is None:
        raise NetnsError(f"ip (iproute2) not found on PATH or in {', '.join(SBIN)}")
    return [ip, "netns", "exec", name]
