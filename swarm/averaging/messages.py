"""The averaging protocol's messages: frozen values with explicit msgpack forms and limits.

    MemberInfo  [peer_id bytes, [maddr...], weight, bandwidth, client, state, reach]
    GroupInfo   {"v": 4, "id": bytes32, "run": str, "step": int, "m": [MemberInfo...]}

`state` is the SHA-256 (32 bytes) of the state a member starts the step from (θ_outer, outer
momentum, outer step): only members of equal state average together (b"": not given, only in tests
of the all-reduce alone). `reach` says how the others reach the member (p2p/reach.py): "direct",
"punched" (behind a NAT that hole punching gets through) or "relayed" (only through a circuit
relay). A relayed member is a client, so that no relay carries what every member sends an owner,
unless no member could be reached otherwise (p2p/reach.py, relayed_may_own). The group id is
SHA-256 over the run, the step and the ordered members' ids, states, weights, bandwidths, client
flags and reaches, so every member can check that a group message is self-consistent, and a member
that finds its own entry other than it announced refuses the group (matchmaking/matchmaker.py): a
leader cannot rewrite what members announced.
Decoders raise BadRequest on anything malformed.

Self-announced numbers are bounded by the run, so that no peer owns the average by what it says of itself: a
weight above the run's `max_weight` (the tokens of H inner steps) makes an announcement ignored
(matchmaking/ready.py) and a group refused; a bandwidth counts at most BANDWIDTH_CAP times the group's
median (partition.capped_bandwidths), so nobody owns the vector by announcing 1e12 MB/s.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from typing import Any

from swarm.p2p.errors import BadRequest, IdentityError
from swarm.p2p.maddr import PeerAddress, parse_address
from swarm.p2p.peer_id import PeerID
from swarm.p2p.reach import DIRECT, REACHES

VERSION = 4
MAX_MEMBERS = 4096  # beyond max_group_size the hierarchical butterfly averages them
MAX_MADDRS = 8
MAX_MADDR_CHARS = 256


@dataclass(frozen=True, slots=True)
class MemberInfo:
    peer_id: PeerID
    maddrs: tuple[str, ...]
    weight: float  # this member's contribution weight (tokens processed since the last step)
    bandwidth: float  # MB/s it announces; its part of the vector is proportional to it
    client: bool  # accepts no inbound connections: owns no part
    state: bytes = b""  # sha256 of the state it starts the step from (see the module docstring)
    reach: str = DIRECT  # how the others reach it (p2p/reach.py)
    # the part timeout its measured rounds give (rounds/timeouts.py); 0: none announced. The round
    # uses the group's largest (timeouts.group_part_timeout), so that every member waits as long:
    # members giving up on a slow owner at different times would take different results of its part
    timeout: float = 0.0

    def __post_init__(self) -> None:
        if self.reach not in REACHES:
            raise ValueError(f"a member's reach is one of {', '.join(REACHES)}, got {self.reach!r}")

    def encode(self) -> list[Any]:
        return [self.peer_id.to_bytes(), list(self.maddrs), self.weight, self.bandwidth, self.client, self.state,
                self.reach, self.timeout]  # fmt: skip

    def address(self) -> PeerAddress | PeerID:
        """Where to reach this member: its first parsable maddr, direct or relayed (with its
        PeerID), else the PeerID alone (works when a connection to it is already open)."""
        for maddr in self.maddrs:
            try:
                return parse_address(maddr).with_peer_id(self.peer_id)
            except ValueError:
                continue
        return self.peer_id

    @classmethod
    def decode(cls, item: Any) -> MemberInfo:
        if not isinstance(item, list) or len(item) not in (7, 8):
            raise BadRequest("a member is [peer_id, maddrs, weight, bandwidth, client, state, reach, timeout]")
        raw_id, maddrs, weight, bandwidth, client, state, reach = item[:7]
        timeout = item[7] if len(item) == 8 else 0.0  # a member that announces none
        if not isinstance(raw_id, bytes):
            raise BadRequest("member peer id must be bytes")
        try:
            peer_id = PeerID(raw_id)
        except IdentityError as e:
            raise BadRequest(f"bad member peer id: {e}") from None
        if not isinstance(maddrs, list) or len(maddrs) > MAX_MADDRS:
            raise BadRequest(f"member maddrs must be a list of at most {MAX_MADDRS}")
        if not all(isinstance(m, str) and 0 < len(m) <= MAX_MADDR_CHARS for m in maddrs):
            raise BadRequest("member maddrs must be short strings")
        for name, value in (("weight", weight), ("bandwidth", bandwidth), ("timeout", timeout)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise BadRequest(f"member {name} must be a finite number >= 0")
        if not isinstance(client, bool):
            raise BadRequest("member client flag must be a bool")
        if not isinstance(state, bytes) or len(state) not in (0, 32):
            raise BadRequest("member state must be a 32-byte sha256 (or empty)")
        if not isinstance(reach, str) or reach not in REACHES:
            raise BadRequest(f"member reach must be one of {', '.join(REACHES)}")
        return cls(peer_id, tuple(maddrs), float(weight), float(bandwidth), client, state, reach, float(timeout))


@dataclass(frozen=True, slots=True)
class GroupInfo:
    group_id: bytes
    run_id: str
    step: int
    members: tuple[MemberInfo, ...]  # the agreed order: part j belongs to members[j]

    @staticmethod
    def make_id(run_id: str, step: int, members: tuple[MemberInfo, ...]) -> bytes:
        digest = hashlib.sha256(f"swarm-group/4\x00{run_id}\x00{step}\x00".encode())
        for member in members:
            raw_id = member.peer_id.to_bytes()
            digest.update(len(raw_id).to_bytes(2, "big") + raw_id)
            digest.update(len(member.state).to_bytes(1, "big") + member.state)
            # what the member announced: a leader that rewrites it changes the id
            digest.update(
                struct.pack(">dd?B", member.weight, member.bandwidth, member.client, REACHES.index(member.reach))
            )
        return digest.digest()

    @classmethod
    def create(cls, run_id: str, step: int, members: tuple[MemberInfo, ...]) -> GroupInfo:
        return cls(cls.make_id(run_id, step, members), run_id, step, members)

    def index_of(self, peer_id: PeerID) -> int:
        for i, member in enumerate(self.members):
            if member.peer_id == peer_id:
                return i
        raise KeyError(peer_id)

    def encode(self) -> dict[str, Any]:
        return {"v": VERSION, "id": self.group_id, "run": self.run_id, "step": self.step,
                "m": [m.encode() for m in self.members]}  # fmt: skip

    @classmethod
    def decode(cls, msg: Any) -> GroupInfo:
        if not isinstance(msg, dict) or msg.get("v") != VERSION:
            raise BadRequest(f"a group is a map with v={VERSION}")
        run_id, step, raw_members = msg.get("run"), msg.get("step"), msg.get("m")
        if not isinstance(run_id, str) or isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise BadRequest("a group needs a run id and a step >= 0")
        if not isinstance(raw_members, list) or not 0 < len(raw_members) <= MAX_MEMBERS:
            raise BadRequest(f"a group has 1 to {MAX_MEMBERS} members")
        members = tuple(MemberInfo.decode(m) for m in raw_members)
        if len({m.peer_id for m in members}) != len(members):
            raise BadRequest("a group lists a member twice")
        group = cls.create(run_id, step, members)
        if msg.get("id") != group.group_id:
            raise BadRequest("group id does not match its run, step and members")
        return group
