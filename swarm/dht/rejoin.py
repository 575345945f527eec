"""Back to the initial peers: when to ping an initial peer our routing table has lost.

A contact that fails a request leaves the routing table (node.py, `_call`). After a network
split, each side's nodes have dropped the other side's, and nothing brings them back: no node
of one side ever hears from a node of the other, so the two sides go on as two DHTs, two
swarms with two states, long after the network healed. A node whose initial peer (the join
line's bootstrap, say) is missing from its table therefore pings it again now and then; once it
answers, the node looks up its own id through it, as at start-up, and both sides know each
other again. The same brings a node back to a bootstrap that restarted.

The schedule is pure (facts in, times out): a missing peer is tried after `base` seconds, then
after twice as long each time it fails, up to `cap`; a peer that answered but stays out of the
table (its bucket is full of live contacts: Kademlia keeps old contacts) waits `cap`, so that a
large swarm does not ping its bootstrap every `base` seconds from every node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class RejoinSchedule:
    base: float  # seconds before the first try, and after a try that got it back
    cap: float  # the longest wait between tries
    _next: dict[str, float] = field(default_factory=dict)  # maddr -> when to try it next
    _wait: dict[str, float] = field(default_factory=dict)  # maddr -> the wait after its next failure

    def __post_init__(self) -> None:
        if not 0 < self.base <= self.cap:
            raise ValueError(f"rejoin waits must satisfy 0 < base <= cap, got {self.base} and {self.cap}")

    def due(self, maddrs: Iterable[str], in_table: Callable[[str], bool], now: float) -> list[str]:
        """The initial peers to ping now: missing from the table and past their wait. A peer
        found in the table starts afresh (its next loss waits `base` only)."""
        due = []
        for maddr in maddrs:
            if in_table(maddr):
                self._next.pop(maddr, None)
                self._wait.pop(maddr, None)
                continue
            first = self._next.setdefault(maddr, now + self.base)
            if now >= first:
                due.append(maddr)
        return due

    def tried(self, maddr: str, now: float, *, answered: bool, kept: bool) -> None:
        """After a ping: `answered` it, and `kept` in the routing table afterwards."""
        if answered and kept:
            wait = self.base
        elif answered:  # a full bucket keeps its old contacts: no use asking again soon
            wait = self.cap
        else:
            wait = min(self.cap, 2 * self._wait.get(maddr, self.base / 2))
        self._wait[maddr] = wait
        self._next[maddr] = now + wait
