"""A fixed one-way delay on what a lab endpoint sends, for a lab whose kernel has no netem.

netem (tc's delay) and fq (which would honour a departure time set by BPF) are both missing from
this project's kernels, so the delay is our own: the endpoint's locally sent packets are routed
into a TUN device, and one small process (`python -m swarm.netlab.delay --ms 25`, run inside the
endpoint's namespace) reads each one, holds it for the delay and writes it back into the TUN
device, from where the kernel forwards it out of eth0 as usual. In order, one packet at a time,
after its exact delay; what the endpoint receives is not delayed. Two endpoints that each delay
by D then see an RTT of about 2D between them (each direction passes one delay), and D to an
endpoint without one.

What the plan sets in the endpoint's namespace (delay_commands), and why:
- tun0, and a routing rule sending what the endpoint itself sends (iif lo) to a table whose only
  route is tun0; packets written back come in on tun0, so the rule does not match them again and
  the main table routes them out of eth0;
- IPv4 forwarding on, reverse-path filtering off and accept_local on tun0: a packet arriving on
  tun0 carries one of the endpoint's own addresses as its source, which the kernel would
  otherwise drop as a martian.
A TUN device has no offloads, so the kernel hands it whole, checksummed packets of at most the
MTU. Throughput is what a Python loop moves (tens of thousands of packets a second): enough for
handshakes, punches and calls, not for measuring a shaped link (those tests use no delay).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import os
import struct
from collections import deque

from swarm.netlab.plan import Command

TUN_DEVICE = "tun0"
TABLE = "100"  # the routing table of what the endpoint sends; unused by anything else in a lab
MAX_DELAY_MS = 1000
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MAX_PACKET = 65535


def delay_commands(netns: str, ms: int) -> tuple[Command, ...]:
    """What routes an endpoint's own packets through the delay process's TUN device."""
    if not 1 <= ms <= MAX_DELAY_MS:
        raise ValueError(f"a delay is 1 to {MAX_DELAY_MS} ms, got {ms}")
    sysctl = ("ip", "netns", "exec", netns, "sysctl", "-q", "-w")
    return (
        ("ip", "-n", netns, "tuntap", "add", "dev", TUN_DEVICE, "mode", "tun"),
        ("ip", "-n", netns, "link", "set", TUN_DEVICE, "up"),
        (*sysctl, "net.ipv4.ip_forward=1"),
        (*sysctl, "net.ipv4.conf.all.rp_filter=0"),
        (*sysctl, f"net.ipv4.conf.{TUN_DEVICE}.rp_filter=0"),
        (*sysctl, f"net.ipv4.conf.{TUN_DEVICE}.accept_local=1"),
        ("ip", "-n", netns, "route", "add", "default", "dev", TUN_DEVICE, "table", TABLE),
        ("ip", "-n", netns, "rule", "add", "iif", "lo", "lookup", TABLE, "pref", "100"),
    )


def open_tun(name: str) -> int:
    """Attach to the TUN device `name` (made by delay_commands); a non-blocking fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class Delay:
    """Holds each packet read from `fd` for `seconds`, then writes it back, in arrival order."""

    def __init__(self, fd: int, seconds: float) -> None:
        self.fd, self.seconds = fd, seconds
        self._held: deque[tuple[float, bytes]] = deque()
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None

    def on_readable(self) -> None:
        now = self._loop.time()
        with contextlib.suppress(BlockingIOError):
            while packet := os.read(self.fd, MAX_PACKET):
                self._held.append((now + self.seconds, packet))
        if self._timer is None and self._held:
            self._timer = self._loop.call_at(self._held[0][0], self._release)

    def _release(self) -> None:
        self._timer = None
        now = self._loop.time()
        while self._held and self._held[0][0] <= now:
            with contextlib.suppress(BlockingIOError, OSError):  # a full queue drops, as a link would
                os.write(self.fd, self._held.popleft()[1])
        if self._held:
            self._timer = self._loop.call_at(self._held[0][0], self._release)


async def serve(device: str, ms: int) -> None:
    fd = open_tun(device)
    delay = Delay(fd, ms / 1000)
    asyncio.get_running_loop().add_reader(fd, delay.on_readable)
    print("ready", flush=True)
    await asyncio.Event().wait()  # until the lab stops the process (SIGTERM or SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description="Delay what this namespace sends (see the module docstring).")
    parser.add_argument("--ms", type=int, required=True)
    parser.add_argument("--dev", default=TUN_DEVICE)
    args = parser.parse_args()
    asyncio.run(serve(args.dev, args.ms))


if __name__ == "__main__":
    main()
