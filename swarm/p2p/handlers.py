"""What a handler is: the context of the call it serves, and the two kinds a host registers.

A unary handler answers one request with one reply; a stream handler reads and writes chunks on
the call's Stream until it returns (the stream is then ended). P2PHost.add_handler and
add_stream_handler register them; serving.py runs them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from swarm.p2p.peer_id import PeerID
from swarm.p2p.stream import Stream


@dataclass(frozen=True, slots=True)
class CallContext:
    """What a handler knows about the call it serves."""

    peer_id: PeerID  # the authenticated caller
    method: str
    remote_address: tuple[str, int]  # the caller's IP and port as seen by us


UnaryHandler = Callable[[CallContext, Any], Awaitable[Any]]
StreamHandler = Callable[[CallContext, Any, Stream], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Handler:
    fn: UnaryHandler | StreamHandler
    is_stream: bool
