"""Capping a TCP socket's send rate with the kernel's own pacing (SO_MAX_PACING_RATE).

Why a round paces its uploads: a volunteer's uplink is one FIFO queue (a home router's buffer; in
our lab a tc token bucket). Several TCP streams leaving through it do not share it evenly: one
gets ahead, finishes early, and at the end the link idles while the last one trickles in. On
4 x 100 Mbit/s links, plain TCP sending a round's traffic to three peers at once took 1.19x the
payload's time on the wire; each stream capped at its fair share, 1.00x
(`scripts/bench/tcp_exchange.py --modes at-once,paced`). Since Linux 4.13 TCP paces a socket
that has a max pacing rate by itself, with no fq qdisc needed. Elsewhere the option is missing
and `set_max_pacing_rate` says so by returning False: the round then runs unpaced, as before.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # Linux's number; Python names it from 3.12 on
UNLIMITED = 2**64 - 1  # ~0UL: no cap (the kernel's default)
MIN_RATE = 1 << 10  # bytes/s: below this a cap is a mistake, not a pace
# struct tcp_info (linux/tcp.h, since 4.1): tcpi_bytes_acked, a u64 at byte 120 of at least 128
TCP_INFO_BYTES_ACKED = struct.Struct("=Q"), 120


def set_max_pacing_rate(sock: Any, bytes_per_s: float | None) -> bool:
    """Cap `sock`'s sending at `bytes_per_s` (None: lift the cap). False where the platform or
    the socket does not take it (not TCP, closed, not Linux)."""
    if bytes_per_s is not None and not bytes_per_s >= MIN_RATE:  # NaN too
        raise ValueError(f"a pacing rate must be at least {MIN_RATE} bytes/s, got {bytes_per_s}")
    value = UNLIMITED if bytes_per_s is None else min(UNLIMITED - 1, int(bytes_per_s))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("=Q", value))
    except (OSError, AttributeError, TypeError):
        return False
    return True


def max_pacing_rate(sock: Any) -> int | None:
    """The socket's cap in bytes/s, None when it has none (or it cannot be read)."""
    try:
        value = struct.unpack("=Q", sock.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, 8))[0]
    except (OSError, AttributeError, TypeError, struct.error):
        return None
    return None if value in (UNLIMITED, 2**32 - 1) else value  # ~0U: no cap, as a 32-bit value


def bytes_acked(sock: Any) -> int | None:
    """The bytes of ours the peer acknowledged over this TCP connection's life (what left through
    the link, not what waits in buffers), None where the kernel does not say (not Linux >= 4.1)."""
    layout, offset = TCP_INFO_BYTES_ACKED
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, offset + layout.size)
    except (OSError, AttributeError, TypeError):
        return None
    if len(info) < offset + layout.size:
        return None
    return int(layout.unpack_from(info, offset)[0])
