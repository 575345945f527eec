"""LineageBook: a node's own lineage (lineage.py), the signatures of its rounds, and the wire
that carries lineages between peers.

    book = LineageBook(host, dht, run_id, settings_digest, serve=True)
    book.start(anchor_step, anchor_state)          # genesis, or a checkpoint (restore: with its receipts)
    book.record_round(step, group_id, members, parent, result)  # after a round: sign; store, collect later
    book.record_alone(step, weight, parent, result)  # after applying our own Δ alone
    chain = await book.fetch(holders, since, until)  # a holder's lineage, its newest rounds' missing
                                                   # signatures read from the DHT, all checked in a thread
    book.judge(chain) ... book.adopt(chain)        # after fetching the state it leads to

Signatures travel through the DHT, one record per member and step:

    <run>/receipts/<N>  subkey [owner:<PeerID>] -> {"g": group id, "r": result state, "s": signature}

A member stores its own after its round and reads the others' a few times over the next seconds
(COLLECT_AFTER_S); each is checked against the body the member itself built, so a record of
another group or result, or a forged signature, is ignored.

`state.lineage` (unary; served by every node that serves its state)
    args   {"run": run id, "since": first step wanted}
    reply  {"receipts": [Receipt.encode()...] from `since` on, at most PAGE_BYTES of them,
            "more": bool (ask again from the next step)}
    errors bad_request (wrong run, malformed), not_found (no receipt of that step here)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from swarm.dht.errors import DHTError
from swarm.dht.node import DHTNode
from swarm.dht.records import owner_subkey
from swarm.dht.run_keys import owned_map, receipts_key
from swarm.p2p.errors import BadRequest, NotFound, P2PError
from swarm.p2p.handlers import CallContext
from swarm.p2p.host import P2PHost
from swarm.p2p.peer_id import PeerID
from swarm.state.holders import Holder
from swarm.state.lineage import Lineage, Link
from swarm.state.receipts import (
    BadReceipt,
    Receipt,
    RoundBody,
    decode_receipt,
    encoded_size,
    sign,
    signature_holds,
    valid_signers,
)
from swarm.utils.supervised import Supervised

logger = logging.getLogger(__name__)

LINEAGE = "state.lineage"
PAGE_BYTES = 512 << 10  # a reply's receipts (the RPC head limit is 1 MiB)
MAX_LINEAGE_BYTES = 64 << 20  # receipts taken from one holder for one lineage (rounds of 8: ~45,000 steps)
MAX_LINKS = 100_000  # steps of a lineage fetched or restored (a liar's would cost a newcomer minutes of checks)
RECEIPT_TTL_S = 900.0  # a signature record outlives its round long enough for every member to read it
COLLECT_AFTER_S = (0.3, 1.0, 3.0, 10.0)  # when, after its round, a member reads the others' signatures
SOLO_GROUP = bytes(32)  # the group id of a round of one
FETCH_TIMEOUT_S = 10.0
MAX_HOLDERS_ASKED = 3
# the newest rounds of a fetched lineage whose missing signatures are read from the DHT: the ones
# a judgement weighs most (the rounds after a fork), a DHT lookup each at most
MERGE_NEWEST = 8


Checked = tuple[Receipt, frozenset[PeerID]]  # a receipt and the members whose signature in it holds


class LineageError(RuntimeError):
    """No holder sent a lineage that holds together; `unreachable`: those that sent nothing."""

    def __init__(self, message: str, unreachable: frozenset[PeerID] = frozenset()) -> None:
        super().__init__(message)
        self.unreachable = unreachable


class LineageBook:
    """Owns the node's lineage (receipts and their checked links, from its anchor), the
    `state.lineage` handler when it serves, and the supervised collection of its rounds'
    signatures. `close` stops both."""

    def __init__(self, host: P2PHost, dht: DHTNode, run_id: str, settings: bytes, *, serve: bool) -> None:
        self.host, self.dht, self.identity, self.run_id, self.settings = host, dht, host.identity, run_id, settings
        self.lineage = Lineage(0, bytes(32))
        self.receipts: list[Receipt] = []  # one per link of self.lineage
        self.provisional = False  # taken at our anchor from peers nobody vouched for (lineage.py rule 5)
        self._due: dict[int, int] = {}  # step -> collections done, for our rounds still collecting
        self._recorded_at: dict[int, float] = {}
        self._unstored: dict[int, dict[str, Any]] = {}  # step -> our signature record, not stored yet
        self._wake = asyncio.Event()
        self._collector = Supervised("receipt signatures", self._collect_forever).start()
        self._serving = serve
        if serve:
            serve_lineage(host, run_id, lambda: self.receipts)

    async def close(self) -> None:
        if self._serving:
            self.host.remove_handler(LINEAGE)
        if (error := await self._collector.close()) is not None:
            logger.warning("collecting receipt signatures had failed %d time(s), last: %r",
                           self._collector.failures, error)  # fmt: skip

    # --- our own lineage -------------------------------------------------------------------------

    def start(self, step: int, state: bytes, provisional: bool = False) -> None:
        """Anchor the lineage at a state trusted without receipts (genesis, an old checkpoint).
        `provisional`: the node joins a run that exists elsewhere (it has initial peers) and has
        averaged with nobody yet (lineage.py rule 5); a round with others ends it."""
        self.lineage, self.receipts, self._due, self.provisional = Lineage(step, state), [], {}, provisional

    def restore(self, data: bytes, step: int, state: bytes) -> bool:
        """The lineage written with our checkpoint of `step` (whose state is `state`); False (and
        anchored at that checkpoint) when it does not lead there."""
        try:
            receipts = [decode_receipt(item, self.run_id) for item in msgpack.unpackb(data)][-MAX_LINKS:]
            chain = _chain([(r, frozenset(r.signatures)) for r in receipts])  # our own disk: not re-checked
        except (BadReceipt, ValueError, TypeError, msgpack.ExtraData) as e:
            logger.warning("ignoring the lineage of the checkpoint of step %d: %s", step, e)
            chain = None
        if chain is None or chain.step != step or chain.state != state:
            self.start(step, state)
            return False
        self.lineage, self.receipts = chain, receipts
        return True

    def record_round(self, step: int, group_id: bytes, members: Sequence[tuple[PeerID, float]], parent: bytes,
                     result: bytes) -> None:  # fmt: skip
        """Sign the receipt of our round of `step` (its members in the group's order, with the
        weights they announced) and add it to our lineage. Our signature is stored for the other
        members, and theirs collected, in the background over the next seconds (COLLECT_AFTER_S):
        the step goes on meanwhile."""
        body = RoundBody(self.run_id, self.settings, step, group_id, tuple(p for p, _ in members),
                         tuple(float(w) for _, w in members), parent, result)  # fmt: skip
        signature = sign(body, self.identity)
        self._append(Receipt(body, {self.identity.peer_id: signature}))
        self.provisional = False  # we averaged with others from our own state: it is ours to keep
        self._due[step] = 0
        self._recorded_at[step] = time.monotonic()
        self._unstored[step] = {"g": group_id, "r": result, "s": signature}
        self._wake.set()

    async def _store(self, step: int, value: dict[str, Any]) -> None:
        try:
            stored = await self.dht.store(receipts_key(self.run_id, step), value, time.time() + RECEIPT_TTL_S,
                                          owner_subkey(self.dht.peer_id))  # fmt: skip
        except (P2PError, DHTError, TimeoutError) as e:
            stored = 0
            logger.info("could not store our signature of the round of step %d: %s", step, e)
        if not stored:
            logger.warning("our signature of the round of step %d is stored nowhere: peers see the round "
                           "endorsed by its other members only", step)  # fmt: skip

    def record_alone(self, step: int, weight: float, parent: bytes, result: bytes) -> None:
        """Our own Δ applied alone: a round of one, signed by us."""
        me = self.identity.peer_id
        body = RoundBody(self.run_id, self.settings, step, SOLO_GROUP, (me,), (float(weight),), parent, result)
        self._append(Receipt(body, {me: sign(body, self.identity)}))

    def _append(self, receipt: Receipt) -> None:
        body = receipt.body
        if body.step != self.lineage.step or body.parent != self.lineage.state:
            # a state we hold without its lineage (a fetch whose receipts we could not keep):
            # from here on our lineage starts at the parent
            logger.info("our lineage restarts at step %d (it ended at step %d)", body.step, self.lineage.step)
            self.start(body.step, body.parent)
        link = Link.of(receipt, frozenset(receipt.signatures))
        held = self.lineage
        self._keep(held.anchor_step, held.anchor, [*held.links, link], [*self.receipts, receipt])

    def _keep(self, anchor_step: int, anchor: bytes, links: list[Link], receipts: list[Receipt]) -> None:
        """Hold these links and their receipts, at most MAX_LINKS: past it the oldest go, and the
        lineage is anchored at the state the last dropped one made."""
        drop = max(0, len(links) - MAX_LINKS)
        if drop:
            anchor_step, anchor = anchor_step + drop, links[drop - 1].result
            links, receipts = links[drop:], receipts[drop:]
        self.lineage, self.receipts = Lineage(anchor_step, anchor, tuple(links)), receipts

    def adopt(self, chain: Lineage, receipts: Sequence[Receipt], provisional: bool) -> None:
        """The lineage of a state we fetched (judged first): ours up to where it begins, then its.
        `provisional`: taken at our anchor from peers nobody vouched for (lineage.py rule 5)."""
        self.provisional = provisional
        keep = max(0, chain.anchor_step - self.lineage.anchor_step)
        if chain.anchor_step < self.lineage.anchor_step or self.lineage.state_at(chain.anchor_step) != chain.anchor:
            self.lineage, self.receipts = chain, list(receipts)
        else:
            self._keep(self.lineage.anchor_step, self.lineage.anchor, [*self.lineage.links[:keep], *chain.links],
                       [*self.receipts[:keep], *receipts])  # fmt: skip
        self._due, self._recorded_at = {}, {}

    # --- signatures of our rounds -----------------------------------------------------------------

    async def _collect_forever(self) -> None:
        while True:
            while self._unstored:
                step = min(self._unstored)
                await self._store(step, self._unstored.pop(step))
            now = time.monotonic()
            due = [s for s, n in self._due.items() if now - self._recorded_at[s] >= COLLECT_AFTER_S[n]]
            for step in due:
                await self.collect(step)
                if step not in self._due:  # an adopted lineage replaced ours meanwhile
                    self._recorded_at.pop(step, None)
                    continue
                self._due[step] += 1
                if self._due[step] >= len(COLLECT_AFTER_S) or self._complete(step):
                    self._due.pop(step, None)
                    self._recorded_at.pop(step, None)
            waits = [self._recorded_at[s] + COLLECT_AFTER_S[n] - now for s, n in self._due.items()]
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.05, min(waits, default=60.0)))
            except asyncio.TimeoutError:
                pass

    def _complete(self, step: int) -> bool:
        link = self.lineage.link_into(step + 1)
        return link is not None and link.signers == frozenset(link.members)

    async def collect(self, step: int) -> None:
        """Read the members' signatures of our round of `step` from the DHT and keep those that
        hold (over the body we signed)."""
        index = step - self.lineage.anchor_step
        if not 0 <= index < len(self.receipts) or self._complete(step):
            return
        receipt = self.receipts[index]
        good = await self._stored_signatures(receipt, frozenset(receipt.signatures))  # ours: checked already
        index = step - self.lineage.anchor_step  # our lineage may have moved meanwhile
        if good and 0 <= index < len(self.receipts) and self.receipts[index].body == receipt.body:
            self.receipts[index] = self.receipts[index].with_signatures(good)
            old = self.lineage.links[index]
            link = Link(old.step, old.parent, old.result, old.members, old.signers | frozenset(good))
            links = list(self.lineage.links)
            links[index] = link
            self.lineage = Lineage(self.lineage.anchor_step, self.lineage.anchor, tuple(links))

    async def _stored_signatures(self, receipt: Receipt, signed: frozenset[PeerID]) -> dict[PeerID, bytes]:
        """The signatures of `receipt`'s round that its members other than `signed` (those whose
        signature we hold and checked) stored in the DHT, those that hold over its body ({} when
        the DHT cannot be read)."""
        body = receipt.body
        try:
            found = await self.dht.get(receipts_key(self.run_id, body.step), latest=True)
        except (P2PError, DHTError, TimeoutError) as e:
            logger.info("could not read the signatures of the round of step %d: %s", body.step, e)
            return {}
        if found is None or not isinstance(found.value, dict):
            return {}
        offered: dict[PeerID, bytes] = {}
        for subkey, entry in found.value.items():
            owned = owned_map(subkey, getattr(entry, "value", None))
            if owned is None:
                continue
            peer, value = owned
            if peer in signed or peer not in body.members or not isinstance(value.get("s"), bytes):
                continue
            if value.get("g") != body.group_id or value.get("r") != body.result:
                continue
            offered[peer] = value["s"]
        if not offered:
            return {}
        digest = body.digest()
        return await asyncio.to_thread(
            lambda: {p: s for p, s in offered.items() if signature_holds(body, p, s, digest)}
        )

    async def _with_stored_signatures(self, checked: list[Checked]) -> list[Checked]:
        """Receipts with the members whose signatures hold (`checked`), their newest rounds
        (MERGE_NEWEST) completed from the DHT, where each member stores its own: the members
        whose signature is missing, or does not hold, there. A holder may lack some it could
        not read (during a network split, or under load) while they are there to read now;
        judged without them, a lineage looks endorsed by fewer of its members than signed it (a
        healed split's smaller half refused the larger half's lineage so: "endorsed by 2 of 5",
        its holder short of a third member's signatures on all six of its receipts). A holder
        that put garbage in a member's place does not hide that member's real signature either."""
        newest = range(max(0, len(checked) - MERGE_NEWEST), len(checked))
        lacking = [i for i in newest if len(checked[i][1]) < len(checked[i][0].body.members)]
        found = await asyncio.gather(*(self._stored_signatures(*checked[i]) for i in lacking))
        completed = list(checked)
        for i, more in zip(lacking, found, strict=True):
            if more:
                receipt, signers = completed[i]
                completed[i] = (receipt.with_signatures(more), signers | frozenset(more))
        return completed

    # --- the wire ---------------------------------------------------------------------------------

    async def fetch(self, holders: Sequence[Holder], since: int, until: int) -> tuple[Lineage, list[Receipt]]:
        """The lineage of one of `holders` from step `since` up to step `until` (the state they
        advertise), with the signatures of its newest rounds that the holder lacks read from the
        DHT, all checked in a thread. LineageError when none sends one."""
        if until - since > MAX_LINKS:  # before a byte is asked for: a state a million steps on
            raise LineageError(f"a lineage of {until - since} steps is more than we check ({MAX_LINKS})")
        reasons, unreachable = [], set()
        for holder in holders[:MAX_HOLDERS_ASKED]:
            try:
                receipts = await self._fetch_from(holder, since, until)
            except P2PError as e:
                reasons.append(f"{str(holder.peer_id)[-8:]}: {e}")
                unreachable.add(holder.peer_id)
                continue
            except (BadReceipt, LineageError) as e:
                reasons.append(f"{str(holder.peer_id)[-8:]}: {e}")
                continue
            checked = await asyncio.to_thread(lambda rs=receipts: [(r, valid_signers(r)) for r in rs])
            checked = await self._with_stored_signatures(checked)
            receipts = [r for r, _ in checked]
            chain = _chain(checked)
            if chain is None:
                reasons.append(f"{str(holder.peer_id)[-8:]}: its receipts do not chain")
                continue
            return chain, receipts
        raise LineageError("; ".join(reasons)[:400] or "no holder to ask", frozenset(unreachable))

    async def _fetch_from(self, holder: Holder, since: int, until: int) -> list[Receipt]:
        receipts: list[Receipt] = []
        step, size = since, 0
        while step < until:
            reply = await self.host.call(holder.maddrs[0], LINEAGE, {"run": self.run_id, "since": step},
                                         timeout=FETCH_TIMEOUT_S)  # fmt: skip
            page = reply.get("receipts") if isinstance(reply, dict) else None
            if not isinstance(page, list) or not page:
                raise LineageError("an empty or malformed page of receipts")
            for item in page:
                receipt = decode_receipt(item, self.run_id)
                if receipt.body.step != step:
                    raise LineageError(f"a receipt of step {receipt.body.step} where step {step} was due")
                if receipt.body.settings != self.settings:
                    raise LineageError(f"a receipt of other run settings at step {step}")
                receipts.append(receipt)
                size += encoded_size(len(receipt.body.members), len(receipt.signatures))
                if size > MAX_LINEAGE_BYTES:  # stuffed receipts: stop before their signatures are checked
                    raise LineageError(f"more than {MAX_LINEAGE_BYTES >> 20} MiB of receipts")
                step += 1
                if step >= until:
                    break
            if len(receipts) > MAX_LINKS:
                raise LineageError(f"a lineage of more than {MAX_LINKS} steps")
            if step < until and not reply.get("more"):
                raise LineageError(f"its receipts end at step {step}, before the state it advertises (step {until})")
        return receipts


def serve_lineage(host: P2PHost, run_id: str, receipts: Callable[[], Sequence[Receipt]]) -> None:
    """Answer `state.lineage` on `host` from `receipts()`: the receipts of consecutive steps
    that lead to the state the node serves (`host.remove_handler(LINEAGE)` stops it)."""

    async def answer(ctx: CallContext, args: Any) -> dict[str, Any]:
        if not isinstance(args, dict) or args.get("run") != run_id:
            raise BadRequest(f"{LINEAGE}: wrong or missing run id")
        since = args.get("since")
        if isinstance(since, bool) or not isinstance(since, int) or since < 0:
            raise BadRequest(f"{LINEAGE}: since must be an int >= 0")
        held = receipts()
        anchor = held[0].body.step if held else 0
        first = since - anchor
        if not 0 <= first < len(held):
            raise NotFound(f"{LINEAGE}: no receipt of step {since} here ({len(held)} from step {anchor})")
        page, size = [], 0
        for receipt in held[first:]:
            size += encoded_size(len(receipt.body.members), len(receipt.signatures))
            if page and size > PAGE_BYTES:
                break
            page.append(receipt.encode())
        return {"receipts": page, "more": first + len(page) < len(held)}

    host.add_handler(LINEAGE, answer)


def encode_receipts(receipts: Sequence[Receipt]) -> bytes:
    """A lineage's receipts as written beside a checkpoint (LineageBook.restore reads them)."""
    return msgpack.packb([r.encode() for r in receipts])


def _chain(checked: Sequence[Checked]) -> Lineage | None:
    """A lineage of consecutive receipts (with the signers that hold); None when they do not chain."""
    if not checked:
        return None
    first = checked[0][0].body
    links = tuple(Link.of(r, signers) for r, signers in checked)
    chain = Lineage(first.step, first.parent, links)
    for i, link in enumerate(links):
        if link.step != first.step + i or (i and link.parent != links[i - 1].result):
            return None
    return chain
