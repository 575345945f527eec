"""Iterative, parallel Kademlia lookup (the paper's node lookup, alpha requests in flight).

Start from the k closest contacts the routing table knows; keep alpha requests in flight to the
closest contacts not yet asked; every reply may bring closer contacts. The lookup ends when the
k closest contacts seen (leaving out those that failed) have all answered, or, when looking for
a value and not asked for the latest one, as soon as some node returned it. A dead or slow peer
only holds one of the alpha slots until its request times out, and is then dropped.

`rounds` counts hops: the initial contacts are at depth 1, a contact learned from a node at
depth d is at depth d + 1; rounds is the deepest node that answered. It should grow like log N.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from swarm.dht.errors import RecordError
from swarm.dht.ids import Key
from swarm.dht.records import Record
from swarm.dht.routing import Contact
from swarm.dht.storage import RecordStorage
from swarm.p2p.peer_id import PeerID

NEW, ASKED, ANSWERED, FAILED = range(4)

# ask(contact) -> (contacts it knows closest to the target, records it holds for the key)
AskFn = Callable[[Contact], Awaitable[tuple[list[Contact], list[Record]]]]


@dataclass(slots=True)
class _Candidate:
    contact: Contact
    distance: int
    depth: int
    state: int = NEW


@dataclass(slots=True)
class LookupResult:
    closest: list[Contact]  # up to k nodes that answered, closest to the target first
    found: RecordStorage  # the freshest record per (key, subkey) seen, merged by the storage rules
    holders: set[PeerID] = field(default_factory=set)  # nodes that returned records
    rounds: int = 0
    asked: int = 0
    failed: int = 0

    def records(self, key: Key, now: float) -> list[Record]:
        return self.found.get(key, now)


def merge_into(found: RecordStorage, records: list[Record], now: float) -> None:
    for record in records:
        try:
            found.put(record, now)
        except RecordError:
            pass  # Outdated: an older copy than one we already have


async def iterative_lookup(
    target: int,
    initial: list[Contact],
    ask: AskFn,
    *,
    own_id: PeerID,
    k: int,
    alpha: int,
    stop_on_value: bool,
    found: RecordStorage,
    now: Callable[[], float],
) -> LookupResult:
    candidates: dict[PeerID, _Candidate] = {}
    result = LookupResult(closest=[], found=found)

    def consider(contact: Contact, depth: int) -> None:
        if contact.peer_id != own_id and contact.peer_id not in candidates:
            candidates[contact.peer_id] = _Candidate(contact, contact.node_id ^ target, depth)

    for contact in initial:
        consider(contact, 1)
    in_flight: dict[asyncio.Task[tuple[list[Contact], list[Record]]], _Candidate] = {}
    width = alpha
    try:
        while True:
            best = sorted((c for c in candidates.values() if c.state != FAILED), key=lambda c: c.distance)[:k]
            if all(c.state == ANSWERED for c in best):
                break
            for candidate in best:
                if len(in_flight) >= width:
                    break
                if candidate.state == NEW:
                    candidate.state = ASKED
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
                result.rounds = max(result.rounds, candidate.depth)
                contacts, records = task.result()
                for contact in contacts:
                    consider(contact, candidate.depth + 1)
                if records:
                    result.holders.add(candidate.contact.peer_id)
                    merge_into(found, records, now())
            if stop_on_value and result.holders:
                break
            # the paper's rule: replies that bring nothing closer mean we are near the end, so ask
            # all of the k closest not yet asked at once instead of alpha at a time
            live = [c.distance for c in candidates.values() if c.state != FAILED]
            width = k if live and min(live) >= closest_before else alpha
    finally:
        for task in in_flight:
            task.cancel()
        if in_flight:
            await asyncio.gather(*in_flight, return_exceptions=True)
    answered = sorted((c for c in candidates.values() if c.state == ANSWERED), key=lambda c: c.distance)
    result.closest = [c.contact for c in answered[:k]]
    return result
