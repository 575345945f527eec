"""Iterative, parallel Kademlia lookup over disjoint paths (the paper's node lookup, alpha
requests in flight per path; S/Kademlia's d disjoint paths).

Start from the k closest contacts the routing table knows, dealt round-robin to `paths` paths.
Each path runs the paper's lookup on its own: keep alpha requests in flight to its closest
contacts not yet asked; every reply may bring closer contacts, which only that path uses. No
node is asked by two paths: a contact another path asked first is skipped, so a few bad nodes
can sit on one path only, and the other paths reach the honest nodes around the target (Baumgart
and Mies, S/Kademlia, 2007, section 4.4). A path ends when the k closest contacts it may use
(leaving out those that failed) have all answered; the whole lookup ends when every path has
ended, or, when looking for a value and not asked for the latest one, as soon as any path found
it. A dead or slow peer only holds one of a path's alpha slots until its request times out.

The result keeps each path's own k closest: a store goes to all of them (`replicas`), so that
m nodes that sit closest to a key and drop what they get cannot hold every copy unless
m >= paths * k.

`rounds` counts hops: the initial contacts are at depth 1, a contact learned from a node at
depth d is at depth d + 1; rounds is the deepest node that answered. It should grow like log N.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from swarm.dht.freshest import FreshestRecords
from swarm.dht.records import Record
from swarm.dht.routing import Contact
from swarm.p2p.peer_id import PeerID

NEW, ASKED, ANSWERED, FAILED = range(4)

# ask(contact) -> (contacts it knows closest to the target, the records it returned for the key
# that are fresher than those found so far, whether it returned any for the key at all: copies
# of found ones make it a holder too)
AskFn = Callable[[Contact], Awaitable[tuple[list[Contact], list[Record], bool]]]


@dataclass(slots=True)
class _Candidate:
    contact: Contact
    distance: int
    depth: int
    state: int = NEW


@dataclass(slots=True)
class LookupResult:
    closest: list[Contact]  # up to k nodes that answered, closest to the target first
    found: FreshestRecords  # the freshest record per subkey seen, merged by the storage rules
    holders: set[PeerID] = field(default_factory=set)  # nodes that returned records
    rounds: int = 0
    asked: int = 0
    failed: int = 0
    path_closest: list[list[Contact]] = field(default_factory=list)  # each path's k closest that answered
    target: int = 0

    def records(self, now: float) -> list[Record]:
        return self.found.records(now)

    def replicas(self) -> list[Contact]:
        """Where a store goes: the k closest of every path (disjoint sets), closest first."""
        union = {c.peer_id: c for path in self.path_closest for c in path}
        return sorted(union.values(), key=lambda c: c.node_id ^ self.target)


async def iterative_lookup(
    target: int,
    initial: list[Contact],
    ask: AskFn,
    *,
    own_id: PeerID,
    k: int,
    alpha: int,
    stop_on_value: bool,
    found: FreshestRecords,
    paths: int = 1,
) -> LookupResult:
    result = LookupResult(closest=[], found=found, target=target)
    shared = _Shared(target, ask, own_id, k, alpha, stop_on_value, result)
    ordered = sorted(initial, key=lambda c: c.node_id ^ target)
    tasks = [asyncio.ensure_future(_run_path(shared, index, ordered[index::paths])) for index in range(paths)]
    result.path_closest = [[] for _ in range(paths)]
    claimed, answered = shared.claimed, shared.answered
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a bug in a path must surface, not vanish
            if stop_on_value and result.holders:
                break
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    ranked = sorted(answered.values(), key=lambda c: c.distance)
    result.closest = [c.contact for c in ranked[:k]]
    for index in range(paths):
        result.path_closest[index] = [c.contact for c in ranked if claimed.get(c.contact.peer_id) == index][:k]
    return result


@dataclass(slots=True)
class _Shared:
    """What the paths of one lookup share: the question, who asked whom, and the result."""

    target: int
    ask: AskFn
    own_id: PeerID
    k: int
    alpha: int
    stop_on_value: bool
    result: LookupResult
    claimed: dict[PeerID, int] = field(default_factory=dict)  # peer -> the path that asked it
    answered: dict[PeerID, _Candidate] = field(default_factory=dict)


async def _run_path(shared: _Shared, index: int, initial: list[Contact]) -> None:
    """One path of a lookup: the paper's algorithm over the contacts this path learns, skipping
    nodes another path asked. Writes answers, records and counts into the shared result."""
    target, ask, own_id, k, alpha = shared.target, shared.ask, shared.own_id, shared.k, shared.alpha
    stop_on_value, claimed, result = shared.stop_on_value, shared.claimed, shared.result
    candidates: dict[PeerID, _Candidate] = {}

    def consider(contact: Contact, depth: int) -> None:
        if contact.peer_id != own_id and contact.peer_id not in candidates:
            candidates[contact.peer_id] = _Candidate(contact, contact.node_id ^ target, depth)

    def usable(candidate: _Candidate) -> bool:
        return candidate.state != FAILED and claimed.get(candidate.contact.peer_id, index) == index

    for contact in initial:
        consider(contact, 1)
    in_flight: dict[asyncio.Task[tuple[list[Contact], list[Record]]], _Candidate] = {}
    width = alpha
    try:
        while True:
            best = sorted((c for c in candidates.values() if usable(c)), key=lambda c: c.distance)[:k]
            if all(c.state == ANSWERED for c in best):
                break
            for candidate in best:
                if len(in_flight) >= width:
                    break
                if candidate.state == NEW:
                    candidate.state = ASKED
                    claimed[candidate.contact.peer_id] = index
                    result.asked += 1
                    in_flight[asyncio.ensure_future(ask(candidate.contact))] = candidate
            if not in_flight:
                break
            done, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            closest_before = best[0].distance
            for task in done:
                candidate = in_flight.pop(task)
                if task.exception() is not None:
                    candidate.state = FAILED
                    result.failed += 1
                    continue
                candidate.state = ANSWERED
                shared.answered[candidate.contact.peer_id] = candidate
                result.rounds = max(result.rounds, candidate.depth)
                contacts, records, holds = task.result()
                for contact in contacts:
                    consider(contact, candidate.depth + 1)
                if holds:
                    result.holders.add(candidate.contact.peer_id)
                for record in records:
                    result.found.add(record)
            if stop_on_value and result.holders:
                break
            # the paper's rule: replies that bring nothing closer mean we are near the end, so ask
            # all of the k closest not yet asked at once instead of alpha at a time
            live = [c.distance for c in candidates.values() if usable(c)]
            width = k if live and min(live) >= closest_before else alpha
    finally:
        for task in in_flight:
            task.cancel()
        if in_flight:
            await asyncio.gather(*in_flight, return_exceptions=True)
