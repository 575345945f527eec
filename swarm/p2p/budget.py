"""InboundBudget: how much of our memory one connection's peer may fill, all its streams together.

A stream's receive side commits `outstanding` bytes: credit we granted that the peer has not
used yet, plus data that arrived and its reader has not taken yet. Each stream starts with the
initial window we announced in HELLO (the protocol grants it: wire.py, CREDIT). It gets more,
up to config.stream_window_bytes, only when its reader reads (Stream.read), and only from the
connection's budget (config.connection_buffer_bytes). So a handler that does not read (the
`avg.part` handler waiting for a group it does not know yet) pins one initial window, and a
connection commits at most

    connection_buffer_bytes + (streams open on it) * stream_initial_window_bytes

Streams that wanted more than the budget had left wait, in order, for what reads and finished
streams give back. A stream always keeps its initial window, so it never stalls for good.

Across connections, HostStreams bounds the inbound streams of the whole host (with a fair share
per connection once config.max_host_streams are open), so many connections together pin at
most (2 * max_host_streams + connections) * stream_initial_window_bytes.
"""

from __future__ import annotations

from collections.abc import Callable

MIN_SPLIT_BYTES = 16 * 1024  # a writer with less credit than this waits rather than send a sliver


def credit_to_grant(*, outstanding: int, window: int, floor: int, budget_free: int) -> int:
    """Bytes of CREDIT a reading stream should send now (0: none).

    outstanding: what the stream already commits (granted and unused, plus unread);
    window: the most it may commit; floor: its initial window, which it keeps whatever the
    budget; budget_free: what the connection's budget has left (may be negative)."""
    deficit = window - outstanding
    if deficit <= 0:
        return 0
    guaranteed = max(0, min(floor - outstanding, deficit))
    extra = max(0, min(deficit - guaranteed, budget_free - guaranteed))
    grant = guaranteed + extra
    # CREDIT frames in batches: a quarter window at a time, or whenever the stream runs low
    if grant >= window // 4 or (grant > 0 and outstanding <= floor // 2):
        return grant
    return 0


class InboundBudget:
    """The bytes one connection's streams commit (see the module docstring)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.committed = 0
        self._hungry: dict[int, Callable[[], None]] = {}  # call id -> the stream's top-up, oldest first

    @property
    def free(self) -> int:
        return self.limit - self.committed

    def take(self, nbytes: int) -> None:
        self.committed += nbytes

    def give_back(self, nbytes: int) -> None:
        self.committed -= nbytes

    def wants_more(self, call_id: int, top_up: Callable[[], None]) -> None:
        """A reading stream that got less than it asked for: offered budget as it frees."""
        self._hungry.setdefault(call_id, top_up)

    def satisfied(self, call_id: int) -> None:
        self._hungry.pop(call_id, None)

    def offer(self) -> None:
        """Let waiting streams take what is free now, oldest first."""
        for call_id, top_up in list(self._hungry.items()):
            if self.free <= 0:
                return
            if self._hungry.get(call_id) is top_up:
                top_up()


def may_open_stream(*, open_streams: int, mine: int, holders: int, limit: int) -> bool:
    """Whether a connection holding `mine` inbound streams may open one more, with
    `open_streams` open on all the host's connections, `holders` of which hold any. Below
    `limit` anyone may; past it only a connection below its fair share (limit / holders, itself
    counted), so a flood over many connections cannot lock out a peer that opens a few, and
    the host holds at most 2 * limit + one per connection."""
    if open_streams < limit:
        return True
    holders += mine == 0  # a connection with none would become one more
    return mine < limit / max(holders, 1)


class HostStreams:
    """Inbound streams open on all of one host's connections (see may_open_stream): each pins
    up to an initial window even if its handler never reads."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self._by_holder: dict[int, int] = {}  # id(connection) -> its inbound streams

    def admit(self, holder: object) -> bool:
        mine = self._by_holder.get(id(holder), 0)
        return may_open_stream(open_streams=self.open, mine=mine, holders=len(self._by_holder), limit=self.limit)

    def opened(self, holder: object) -> None:
        self.open += 1
        self._by_holder[id(holder)] = self._by_holder.get(id(holder), 0) + 1

    def closed(self, holder: object) -> None:
        self.open -= 1
        left = self._by_holder[id(holder)] - 1
        if left:
            self._by_holder[id(holder)] = left
        else:
            del self._by_holder[id(holder)]
