"""Adoption: whether the keeper may take a state it found, by the state's lineage (lineage.py).

    adoption = Adoption(book, vouching=initial_peer_ids, client=False)
    linked = await adoption.linked(holders, step, sha)   # None: not ours to take (logged once per holder)
    ... fetch the state ...
    await adoption.check_leads_to(state, sha, linked[0]) # RefusedManifest: the state is not the lineage's end
    book.adopt(*linked)

A candidate's lineage is fetched from its holders (from FORK_DEPTH steps before the node's own
state, or from its anchor) and judged against the node's own before any shard is asked for. A
state whose lineage was refused is not weighed again for UNLINKED_S, and its holders are
`forked` for FORKED_S: their progress records at its step or later do not make the node wait for
a result it will not take. Holders that could not be reached raise FetchError (with them as
`failed`), as a fetch from them would.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from swarm.model.state_hash import state_sha256
from swarm.p2p.peer_id import PeerID
from swarm.state.fetcher import FetchError, RefusedManifest
from swarm.state.holders import Holder
from swarm.state.lineage import Lineage, fork_step, judge, structure_problem
from swarm.state.lineage_book import LineageBook, LineageError
from swarm.state.receipts import Receipt
from swarm.utils.log_once import OncePerPeer

logger = logging.getLogger(__name__)

# a state whose lineage we refused is not weighed again for this long, nor its holders asked
# again for it
UNLINKED_S = 5.0
# ... unless only its newest round still lacks the signatures of the round before it: they meet
# in the DHT within a second or two of the round, and a newcomer that waited UNLINKED_S for them
# with one-second steps came in five steps late and never caught a group
PENDING_S = 0.5
# a peer that advertised a state whose lineage we refused is on a lineage we will not take: its
# progress record at that state's step or later says nothing of where our swarm is (SwarmView).
# Renewed at each refusal: the keeper weighs the state again every UNLINKED_S while it is advertised
FORKED_S = 30.0
MAX_FORKED = 4096  # holders of refused lineages remembered
FORK_DEPTH = 64  # steps back from our state where a candidate's lineage may fork from ours
Linked = tuple[Lineage, list[Receipt], bool]  # a lineage we may adopt, its receipts, and whether it is provisional


class Adoption:
    """Owns the states refused by their lineage (for UNLINKED_S) and the one warning a newcomer
    gets when it takes a lineage nobody vouched for."""

    def __init__(self, book: LineageBook, *, vouching: frozenset[PeerID], client: bool) -> None:
        self.book, self.vouching, self.client = book, vouching, client
        self._unlinked: dict[str, float] = {}  # manifest -> until when it is not weighed (monotonic)
        # manifests whose lineage a fork check found continuing ours -> until when they are not
        # checked as forks again; the other rules still weigh them meanwhile (a check made while
        # our own round's receipt was not kept yet must not hide the state from them)
        self._not_forks: dict[str, float] = {}
        # manifest -> step of states of our lineage (ours as we publish them, and those a fork
        # check found in it): a peer that holds one is behind us, not on a fork (trust.py, rule 5)
        self._ancestors: dict[str, int] = {}
        self._warned_unvouched = False
        self._distrusted = OncePerPeer(logger)
        # holder -> (step and manifest of the state whose lineage we refused, until when that is remembered)
        self._forked: dict[PeerID, tuple[int, str, float]] = {}

    def unlinked(self) -> set[str]:
        """The manifests whose lineage was refused lately: not weighed again yet."""
        now = time.monotonic()
        self._unlinked = {sha: until for sha, until in self._unlinked.items() if now < until}
        return set(self._unlinked)

    def forked(self) -> dict[PeerID, int]:
        """The peers that advertise, lately, a state whose lineage we refused: peer -> that
        state's step. Not a pending refusal: those rounds may still collect their endorsements."""
        now = time.monotonic()
        self._forked = {peer: entry for peer, entry in self._forked.items() if now < entry[2]}
        return {peer: step for peer, (step, _, _) in self._forked.items()}

    def advertised(self, holders: Sequence[Holder]) -> None:
        """The run's state records as read now: a forked peer that advertises another state than
        the one refused (it stepped back to ours, or moved on) is forked no longer, until that
        state is weighed in turn."""
        now_holding = {h.peer_id: h.manifest for h in holders}
        self._forked = {peer: entry for peer, entry in self._forked.items()
                        if now_holding.get(peer, entry[1]) == entry[1]}  # fmt: skip

    def not_forks(self) -> set[str]:
        """The manifests a fork check found continuing our lineage lately: not checked again yet."""
        now = time.monotonic()
        self._not_forks = {sha: until for sha, until in self._not_forks.items() if now < until}
        return set(self._not_forks)

    def ours(self, step: int, sha: str) -> None:
        """State `sha` of outer step `step` is of our lineage (we hold it now)."""
        self._ancestors[sha] = step
        self._ancestors = {m: s for m, s in self._ancestors.items() if step - FORK_DEPTH <= s <= step}

    def ancestors(self, below: int) -> frozenset[tuple[int, str]]:
        """(step, manifest) of the states of our lineage before step `below` that we know of."""
        return frozenset((step, sha) for sha, step in self._ancestors.items() if step < below)

    def left_lineage(self) -> None:
        """We took a fork's other lineage: the states we knew of ours are not of it."""
        self._ancestors.clear()

    async def linked(self, holders: Sequence[Holder], step: int, sha: str, *, fork_only: bool = False) -> Linked | None:
        """The lineage of state `sha` (outer step `step`) from its holders, with whether it will
        be provisional, when it is one we may adopt (lineage.judge); None otherwise (logged, and
        the state not weighed again for UNLINKED_S). FetchError when no holder answered.
        `fork_only`: only a lineage that forked from ours before our state (trust.py, rule 5);
        a continuation of our state is left, unlogged, to the rules that weigh how many back it."""
        own = self.book.lineage
        alone = all(len(link.members) == 1 for link in own.links)
        if step == own.anchor_step and self.client and alone:  # lineage.py rule 6: back to our anchor
            return Lineage(own.anchor_step, own.anchor), [], self.book.provisional
        since = max(own.anchor_step, min(own.step, step) - FORK_DEPTH)
        # its holders stand on a lineage we refuse (not one behind what we trust, nor of our own)
        on_a_fork = False
        if since >= step:
            why = f"its step {step} is not after the state we trust without receipts (step {own.anchor_step})"
        else:
            try:
                chain, receipts = await self.book.fetch(holders, since, step)
            except LineageError as e:
                if e.unreachable:
                    raise FetchError(f"no holder of state {sha[:12]} sent its lineage ({e})", e.unreachable) from None
                why, on_a_fork = f"no lineage from its holders ({e})", True
            else:
                forked_at = fork_step(own, chain)
                in_ours = forked_at is not None and forked_at >= step  # a state of our lineage: only behind
                on_a_fork = not in_ours
                if fork_only and step < own.step and in_ours:  # ours, behind us
                    self._ancestors[sha] = step
                    return None
                if fork_only and (forked_at is None or forked_at >= own.step):
                    self._not_forks[sha] = time.monotonic() + UNLINKED_S
                    return None
                vouched = any(h.peer_id in self.vouching for h in holders)
                adopted = self._judged(own, chain, sha, vouched)
                if isinstance(adopted, bool):
                    for holder in holders:  # a refusal of its lineage was early (endorsements came since)
                        self._forked.pop(holder.peer_id, None)
                    return chain, receipts, adopted
                why, pending = adopted
                if pending:  # not a refusal yet: asked again in PENDING_S
                    self._unlinked[sha] = time.monotonic() + PENDING_S
                    logger.info("state %s (step %d): waiting for its newest round's endorsements (%s)",
                                sha[:12], step, why)  # fmt: skip
                    return None
        self._unlinked[sha] = time.monotonic() + UNLINKED_S
        if len(self._forked) + len(holders) > MAX_FORKED:  # bounded: past it the memory starts over
            self._forked.clear()
        for holder in holders:
            if on_a_fork:  # its holders' records at its step or later are of a lineage we will not take
                self._forked[holder.peer_id] = (step, sha, time.monotonic() + FORKED_S)
            self._distrusted.log(holder.peer_id, "lineage", "not adopting the state it advertises (step %d): %s",
                                 step, why)  # fmt: skip
        return None

    def _judged(self, own: Lineage, chain: Lineage, sha: str, vouched: bool) -> bool | tuple[str, bool]:
        """Whether the adopted lineage is provisional (lineage.py rule 5), or why it is refused
        and whether the refusal is only pending (Judgement.pending)."""
        problem = structure_problem(chain, chain.step, chain.state)
        if problem is not None:
            return problem, False
        verdict = judge(own, chain, vouched=vouched, provisional=self.book.provisional, client=self.client)
        if not verdict.adopt:
            return verdict.why, verdict.pending
        logger.info("adopting the lineage of state %s (step %d): %s", sha[:12], chain.step, verdict.why)
        if verdict.fork_step != own.anchor_step:
            return self.book.provisional
        if not vouched and not self._warned_unvouched:  # taken at our anchor from peers nobody vouched for
            self._warned_unvouched = True
            logger.warning("adopting the run's state from peers none of our --initial-peers vouches for: a lineage "
                           "from the run's start cannot be told from one that identities of their own made up; join "
                           "through a peer that holds the run's state to be sure")  # fmt: skip
        return not vouched

    @staticmethod
    async def check_leads_to(state: dict[str, Any], sha: str, chain: Lineage) -> None:
        """RefusedManifest when the fetched state is not the one its lineage ends in."""
        got = bytes.fromhex(await asyncio.to_thread(state_sha256, state))
        if got != chain.state:
            raise RefusedManifest(sha, f"its lineage ends in state {chain.state.hex()[:12]}, not this one "
                                       f"({got.hex()[:12]})")  # fmt: skip
