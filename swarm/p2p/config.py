"""P2PConfig: every limit and timeout of the transport, checked when it is built.

The limits an attacker meets first, and what they bound (admission.py, budget.py):
- a source (IPv4 address or IPv6 /64) holds at most max_pending_handshakes_per_ip handshakes
  and max_connections_per_ip authenticated inbound connections (except exempt_ips); at the
  global caps the host drops or evicts what the biggest source holds, and idle unknown peers
  before useful ones;
- a handshake has handshake_timeout seconds;
- one connection commits at most connection_buffer_bytes
  + max_concurrent_streams * stream_initial_window_bytes of our memory to received stream data
  (80 MiB by default), whatever its streams' handlers do; streams whose handlers do not read
  pin at most (2 * max_host_streams + connections) * stream_initial_window_bytes (768 MiB at
  1024 connections) on all connections together.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from swarm.p2p.maddr import parse_maddr

KiB = 1024
MiB = 1024 * KiB
MIN_INITIAL_WINDOW = 64 * KiB  # the smallest window a peer accepts in HELLO (handshake.MIN_WINDOW)


@dataclass(frozen=True, kw_only=True, slots=True)
class P2PConfig:
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)  # where to listen (port 0: any free)
    announce_maddrs: tuple[str, ...] = ()  # what to tell peers instead of the listen addresses
    # AES-256-GCM on every frame after the handshake (wire.py). Off only to measure what it
    # costs: a host with it off and one with it on refuse each other in the handshake.
    encryption: bool = True
    # Dial out from the listening port (SO_REUSEPORT on both sockets): a NAT then maps our
    # outbound connections the way it maps the listening port, which is the mapping that peers
    # observe and that hole punching (punch.py) must reuse. Off: dials use ephemeral ports.
    reuse_port: bool = False
    # sizes
    max_head_bytes: int = 1 * MiB  # largest msgpack head (call arguments, replies) we accept
    max_body_bytes: int = 16 * MiB  # largest raw body (one stream chunk) we accept
    stream_window_bytes: int = 16 * MiB  # most credit one stream is granted, as its reader reads
    stream_initial_window_bytes: int = 256 * KiB  # credit each stream starts with (HELLO ``w``)
    connection_buffer_bytes: int = 64 * MiB  # credit beyond the initial windows, all streams of a connection
    chunk_bytes: int = 4 * MiB  # Stream.write splits data into chunks of at most this size
    write_buffer_high_bytes: int = 8 * MiB  # writers wait while more is queued in the kernel/loop
    # counts
    max_concurrent_calls: int = 256  # inbound calls in flight per connection; more get "busy"
    max_concurrent_streams: int = 64  # of which stream calls; more get "busy"
    max_host_streams: int = 1024  # inbound streams, all connections; past it each gets a fair share
    max_connections: int = 1024  # authenticated connections; at the cap idle unknown peers make room
    max_connections_per_ip: int = 16  # authenticated inbound connections from one source
    max_pending_handshakes: int = 64  # inbound connections still handshaking (the biggest source yields)
    max_pending_handshakes_per_ip: int = 8  # of which from one source; more are refused
    # sources the per-IP caps do not apply to (the global caps still do): this machine's own
    # default address, where local swarms and tests run many nodes; add a NAT your nodes share
    exempt_ips: tuple[str, ...] = ("127.0.0.1", "::1")
    listen_backlog: int = 512
    # timeouts, seconds
    connect_timeout: float = 10.0
    handshake_timeout: float = 5.0  # short: a silent socket holds a pending slot this long
    call_timeout: float = 30.0  # default for unary calls
    stream_timeout: float = 60.0  # default for each stream read or write wait
    handler_timeout: float = 300.0  # callee-side deadline for one unary handler
    idle_timeout: float = 300.0  # a connection with no calls for this long is closed

    def __post_init__(self) -> None:
        if not self.host_maddrs:
            raise ValueError("host_maddrs must name at least one address to listen on")
        for text in (*self.host_maddrs, *self.announce_maddrs):
            parse_maddr(text)  # raises MultiaddrError with the reason
        positive = {
            "max_head_bytes": self.max_head_bytes,
            "max_body_bytes": self.max_body_bytes,
            "stream_window_bytes": self.stream_window_bytes,
            "stream_initial_window_bytes": self.stream_initial_window_bytes,
            "connection_buffer_bytes": self.connection_buffer_bytes,
            "chunk_bytes": self.chunk_bytes,
            "write_buffer_high_bytes": self.write_buffer_high_bytes,
            "max_concurrent_calls": self.max_concurrent_calls,
            "max_concurrent_streams": self.max_concurrent_streams,
            "max_host_streams": self.max_host_streams,
            "max_connections": self.max_connections,
            "max_connections_per_ip": self.max_connections_per_ip,
            "max_pending_handshakes": self.max_pending_handshakes,
            "max_pending_handshakes_per_ip": self.max_pending_handshakes_per_ip,
            "connect_timeout": self.connect_timeout,
            "handshake_timeout": self.handshake_timeout,
            "call_timeout": self.call_timeout,
            "stream_timeout": self.stream_timeout,
            "handler_timeout": self.handler_timeout,
            "idle_timeout": self.idle_timeout,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"P2PConfig.{name} must be positive, got {value}")
        if self.max_head_bytes < 4 * KiB:
            raise ValueError("P2PConfig.max_head_bytes must be at least 4 KiB")
        if self.chunk_bytes > min(self.max_body_bytes, self.stream_window_bytes):
            raise ValueError("P2PConfig.chunk_bytes must fit in max_body_bytes and stream_window_bytes")
        if not MIN_INITIAL_WINDOW <= self.stream_initial_window_bytes <= self.stream_window_bytes:
            raise ValueError("P2PConfig.stream_initial_window_bytes must be 64 KiB to stream_window_bytes")
        for ip in self.exempt_ips:
            ipaddress.ip_address(ip)  # ValueError names it
        if self.max_head_bytes >= 2**31 or self.max_body_bytes >= 2**31:
            raise ValueError("frame limits must be below 2 GiB (the u32 length fields, the AEAD's limit)")
