"""Round receipts: what the members of one averaging round sign, and its wire form.

After a round of outer step N, every member holds the same new state (DESIGN invariant 4). Each
member signs one body:

    RoundBody   run id, settings digest, step N, group id, the members in the group's order
                with the weights they announced, the parent state (state_sha256 at step N, what
                the group averaged from) and the result (state_sha256 at step N + 1)

The signed message is SHA-256 over a canonical byte form (`RoundBody.digest`), so a receipt
cannot be replayed under another run, settings, step, group, member list or order, parent or
result. A node that applies its own Δ alone makes a receipt of a round of one, signed by itself.

    Receipt (msgpack)  {"v": 1, "run": str, "settings": bytes, "step": int, "group": bytes32,
                        "parent": bytes32, "result": bytes32, "m": [[peer id bytes, weight], ...],
                        "sigs": [[member index, Ed25519 signature (64 bytes)], ...]}

Signatures are exchanged through the DHT (lineage_book.py: one record per member under
`<run>/receipts/<N>`) and travel with the state (`state.lineage`). `decode_receipt` raises
BadReceipt on anything malformed; `valid_signers` checks the signatures (about 50 µs each: a
caller with many runs it in a thread). What a chain of receipts proves is lineage.py's.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from swarm.p2p.errors import IdentityError
from swarm.p2p.identity import Identity, verify_signature
from swarm.p2p.peer_id import PeerID

VERSION = 1
MAX_MEMBERS = 4096  # as a group (averaging/messages.py)
MAX_SETTINGS_BYTES = 64
SIGNATURE_BYTES = 64
HASH_BYTES = 32
MAX_STEP = 1 << 62


class BadReceipt(ValueError):
    """A receipt that is malformed or does not hold together."""


@dataclass(frozen=True, slots=True)
class RoundBody:
    """What every member of one round signs (the module docstring)."""

    run_id: str
    settings: bytes  # the run settings' digest (node/settings.py)
    step: int  # the outer step the round averaged
    group_id: bytes  # GroupInfo.group_id; 32 zero bytes for a round of one
    members: tuple[PeerID, ...]  # in the group's order
    weights: tuple[float, ...]  # what each member announced (tokens of its step)
    parent: bytes  # state_sha256 of the state the round started from (step `step`)
    result: bytes  # state_sha256 of the state it produced (step `step + 1`)

    def __post_init__(self) -> None:
        if not 0 < len(self.members) <= MAX_MEMBERS or len(self.weights) != len(self.members):
            raise BadReceipt(f"a round has 1 to {MAX_MEMBERS} members, each with a weight")
        if len(set(self.members)) != len(self.members):
            raise BadReceipt("a round lists a member twice")
        if any(isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w < 0
               for w in self.weights):  # fmt: skip
            raise BadReceipt("member weights must be finite numbers >= 0")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or not 0 <= self.step < MAX_STEP:
            raise BadReceipt("a round's step is an int >= 0")
        for name in ("group_id", "parent", "result"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != HASH_BYTES:
                raise BadReceipt(f"a round's {name} is {HASH_BYTES} bytes")
        if not isinstance(self.settings, bytes) or len(self.settings) > MAX_SETTINGS_BYTES:
            raise BadReceipt(f"a round's settings digest is at most {MAX_SETTINGS_BYTES} bytes")
        if not isinstance(self.run_id, str) or not 0 < len(self.run_id) <= 128:
            raise BadReceipt("a round's run id is 1 to 128 characters")

    def digest(self) -> bytes:
        """The message each member signs: SHA-256 over every field, lengths included."""
        h = hashlib.sha256(b"swarm-receipt/1\x00")
        run = self.run_id.encode()
        h.update(len(run).to_bytes(2, "big") + run)
        h.update(len(self.settings).to_bytes(1, "big") + self.settings)
        h.update(self.step.to_bytes(8, "big") + self.group_id + self.parent + self.result)
        h.update(len(self.members).to_bytes(4, "big"))
        for peer, weight in zip(self.members, self.weights, strict=True):
            raw = peer.to_bytes()
            h.update(len(raw).to_bytes(2, "big") + raw + struct.pack(">d", float(weight)))
        return h.digest()

    def weight_of(self) -> Mapping[PeerID, float]:
        return dict(zip(self.members, self.weights, strict=True))


@dataclass(frozen=True, slots=True)
class Receipt:
    """A round's body and the members' signatures over its digest (not yet checked: see
    `valid_signers`)."""

    body: RoundBody
    signatures: Mapping[PeerID, bytes]

    def with_signatures(self, more: Mapping[PeerID, bytes]) -> Receipt:
        return Receipt(self.body, {**self.signatures, **more})

    def encode(self) -> dict[str, Any]:
        b = self.body
        index = {peer: i for i, peer in enumerate(b.members)}
        return {"v": VERSION, "run": b.run_id, "settings": b.settings, "step": b.step, "group": b.group_id,
                "parent": b.parent, "result": b.result,
                "m": [[p.to_bytes(), float(w)] for p, w in zip(b.members, b.weights, strict=True)],
                "sigs": sorted([index[p], s] for p, s in self.signatures.items())}  # fmt: skip


def encoded_size(members: int, signatures: int) -> int:
    """An upper bound of a receipt's msgpack size: for limits on pages of receipts."""
    return 400 + members * (48 + 9) + signatures * (SIGNATURE_BYTES + 8)


def decode_receipt(item: Any, run_id: str | None = None) -> Receipt:
    """A receipt from its msgpack form (BadReceipt on anything malformed); with `run_id`, one of
    another run is refused too. Signatures are not checked here (valid_signers)."""
    if not isinstance(item, dict) or item.get("v") != VERSION:
        raise BadReceipt(f"a receipt is a map with v={VERSION}")
    raw_members, raw_sigs = item.get("m"), item.get("sigs")
    if not isinstance(raw_members, list) or not 0 < len(raw_members) <= MAX_MEMBERS:
        raise BadReceipt(f"a receipt lists 1 to {MAX_MEMBERS} members")
    members, weights = [], []
    for entry in raw_members:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], bytes)):
            raise BadReceipt("a receipt's member is [peer id bytes, weight]")
        try:
            members.append(PeerID(entry[0]))
        except IdentityError as e:
            raise BadReceipt(f"a receipt's member id: {e}") from None
        weights.append(entry[1])
    try:
        body = RoundBody(item.get("run"), item.get("settings"), item.get("step"), item.get("group"),  # type: ignore[arg-type]
                         tuple(members), tuple(weights), item.get("parent"), item.get("result"))  # type: ignore[arg-type]  # fmt: skip
    except TypeError as e:
        raise BadReceipt(f"a malformed receipt: {e}") from None
    if run_id is not None and body.run_id != run_id:
        raise BadReceipt(f"a receipt of run {body.run_id!r}, not {run_id!r}")
    if not isinstance(raw_sigs, list) or len(raw_sigs) > len(members):
        raise BadReceipt("a receipt has at most one signature per member")
    signatures: dict[PeerID, bytes] = {}
    for entry in raw_sigs:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)
                and not isinstance(entry[0], bool) and 0 <= entry[0] < len(members)):  # fmt: skip
            raise BadReceipt("a receipt's signature is [member index, 64 bytes]")
        if not isinstance(entry[1], bytes) or len(entry[1]) != SIGNATURE_BYTES:
            raise BadReceipt("a receipt's signature is [member index, 64 bytes]")
        signatures[members[entry[0]]] = entry[1]
    return Receipt(body, signatures)


def sign(body: RoundBody, identity: Identity) -> bytes:
    if identity.peer_id not in body.members:
        raise BadReceipt("only a member signs its round's receipt")
    return identity.sign(body.digest())


def signature_holds(body: RoundBody, peer: PeerID, signature: bytes, digest: bytes | None = None) -> bool:
    """Is `signature` member `peer`'s over `body`? (False for a non-member or a hashed id.)"""
    if peer not in body.members:
        return False
    try:
        key = peer.public_key()
    except IdentityError:
        return False
    return verify_signature(key, signature, body.digest() if digest is None else digest)


def valid_signers(receipt: Receipt) -> frozenset[PeerID]:
    """The members whose signature in `receipt` checks out (the others are ignored)."""
    digest = receipt.body.digest()
    return frozenset(p for p, s in receipt.signatures.items() if signature_holds(receipt.body, p, s, digest))
