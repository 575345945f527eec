"""Which advertised state a node may adopt, and which manifests it may fetch: pure, no I/O.

Anyone can advertise a correctly hashed state under `<run>/state` (holders.py), at any step.
Were a node to take the newest step it saw, one peer advertising an all-zero θ at outer
step 1,000,000 would take the whole run. The rule (`choose_trusted`), for a node that holds the
state of step K (a newcomer holds its initial state of step 0, or its checkpoint's), and knew
itself at step K0 some seconds ago (when it started, or last fetched):

1. **Reachable.** A state of step S is implausible when S > horizon, where
   horizon = K0 + (seconds since K0 was known) / (fastest plausible outer step) + SLACK_STEPS
   (`step_horizon`; the fastest plausible step is H inner steps at a quarter of the pace the node
   and the median of its peers show). With no pace known there is no time bound (a newcomer).
2. **Agreed.** The candidates are the (step, manifest) pairs, each backed by the distinct peers
   that advertise it. A state newer than K is adopted only when at least as many peers back it
   as stand at the node's own step (the node itself and the peers advertising step K): a node in
   sync with its group is never pulled off by fewer peers than it computed its state with; a
   newcomer (at its own step alone) takes the best-backed state. A node that *missed* its step
   (a group of its state formed without it: `Known.missed`) asks for MISSED_STEP_BACKERS (2)
   backers at most: otherwise peers parked at the old step (other late nodes, or one attacker
   that never moves on) outnumber a group of 2 that moved on, and the late nodes wait forever
   (seen with a 1e30 attacker: 2 honest late nodes and the attacker at step 0, 2 at step 1). One
   identity alone still cannot pull a late node anywhere.
3. **Vouched.** States backed by one of the node's own --initial-peers are preferred: when one
   is among the newer candidates, only those are considered (the operator chose to trust them).
   **Earned.** Otherwise, states backed by peers that signed the node's recent rounds of two or
   more (`Lineage.round_mates`: identities that averaged in its lineage) are preferred, ranked by
   how many such peers back them. Seniority is earned by rounds, never by time in the DHT: an
   identity that sat there for an hour has averaged with nobody. A newcomer has no rounds yet
   and earns nothing; what guards it is its initial peers (rule 3) and the lineage it must
   check before it adopts anything (adoption.py).
4. **Best backed.** Among the newer candidates left: the most backers, then the older step
   (a tie between a step and a later one is no reason to jump), then the smaller hash.
   With no newer candidate left, the newest step at or below K, by most backers (fetch_reason
   decides whether the node takes it: it does only when it missed its group or is of another
   state than the swarm).

5. **A fork's other side.** Rules 1 and 2 weigh advertisements, which identities cost nothing
   to make; they also keep a fork's smaller side from ever taking the larger side's state when
   that side is some steps ahead (beyond the horizon counted from the smaller side's own last
   step) or holds fewer records than stand at the node's step, and rule 4 never goes back to an
   older step. So, beside the choice, the best state other than the node's own, at most
   FORK_STEPS from the node's step, backed by peers that signed the node's recent rounds (earned),
   is named as a fork to check (`Verdict.fork`). Not a fork: the node's own state, one that the
   members of its last round advertise at its step (they hold its state), and a state of its own
   lineage behind it (`Known.ancestors`: peers that are merely behind). A state behind the node is
   checked only when as many earned peers back it as stand at the node's step, the node included:
   a smaller half that trained ahead while the network was split, at the same pace as the larger
   one, is never caught up with, and the larger half is what it must step back to. The node
   fetches that state's lineage and takes it only when it is a fork of its own lineage that more
   members of the fork's round signed (lineage.py, rule 4): proof made of signatures, not of
   records. Taking one behind it loses the steps the node took apart.

`fetch_reason` then says whether the node takes the chosen state (the cases of keeper.py's
docstring), or keeps its own.

`manifest_problem` refuses, before anything is allocated, a manifest whose tensors are not the
node's model's (the names of θ_outer and momentum) or whose shards are larger than those
tensors plus the safetensors header (a 2 x 1 GiB manifest for a 10 MB model).

What this does not stop: a quorum of peers that is itself malicious. Against a newcomer that
joins through a bare DHT node (which holds no state and so vouches for nothing), more proven
identities than the honest holders win rule 4; the lineage check is then what stands between
it and their state, and a lineage they made up from the run's start is not told apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from swarm.model.checkpoint import Manifest
from swarm.p2p.peer_id import PeerID
from swarm.state.holders import Holder

MISSED_STEP_BACKERS = 2  # what a node that missed its step's group asks of a newer state (rule 2)
SLACK_STEPS = 2  # steps beyond what the observed pace allows (clock skew, a step under way)
# how far ahead of or behind the node a fork's other side is checked (rule 5): a lineage fetch of
# that many steps is what one check costs, and two lineages of one swarm drift apart by a step or
# two a minute
FORK_STEPS = 64
# the recent rounds whose signers back a state more than others (rules 3 and 5): as many as a
# fork's side is checked over. With 32, two nodes that had averaged alone for 40 rounds of a
# 60-minute soak no longer counted the 11 holders of the larger lineage behind them as round
# mates, never checked it, and kept their own to the end
EARNED_ROUNDS = FORK_STEPS
PACE_FACTOR = 4.0  # the swarm is taken to step at most this many times faster than observed
HEADER_BYTES = 4096  # safetensors header allowance per shard (its JSON length prefix + padding) ...
HEADER_BYTES_PER_TENSOR = 512  # ... plus this much JSON per tensor (name, dtype, shape, offsets)


@dataclass(frozen=True, slots=True)
class Known:
    """What a node knows when it weighs the advertised states."""

    step: int  # the step of the state it holds
    horizon: int | None = None  # the highest reachable step now (step_horizon); None: no bound
    vouching: frozenset[PeerID] = frozenset()  # its --initial-peers
    # it knows a group of its own state formed at its step without it (a FORMED marker): it is
    # behind by the swarm's lineage, and the peers parked at its step are no reason to stay
    missed: bool = False
    # the signers of its recent rounds (Lineage.round_mates; rule 3)
    earned: frozenset[PeerID] = frozenset()
    sha: str | None = None  # the manifest of the state it holds (rule 5: a state of its step and hash is its own)
    # the members of the round that made its state: they hold it too (rule 5), even while its
    # own manifest is still being made (`sha` is then the previous step's)
    last_round: frozenset[PeerID] = frozenset()
    # (step, manifest) of states of its lineage before its step, its own and those a fork check
    # found in it: their holders are behind it, not a fork (rule 5)
    ancestors: frozenset[tuple[int, str]] = frozenset()


@dataclass(frozen=True, slots=True)
class Verdict:
    choice: tuple[int, str, list[Holder]] | None  # (step, manifest sha, its holders), as choose_state
    refused: tuple[tuple[PeerID, str], ...] = ()  # holders whose advertisement was refused, and why
    fork: tuple[int, str, list[Holder]] | None = None  # a state whose lineage to check (rule 5)


def step_horizon(known_step: int, since_s: float, pace_s: float, inner_steps: int) -> int | None:
    """The highest outer step the run can have reached `since_s` seconds after the node knew it
    was at `known_step`, when an inner step takes about `pace_s` seconds (0: unknown, no bound)."""
    if pace_s <= 0 or inner_steps <= 0:
        return None
    fastest_step_s = inner_steps * pace_s / PACE_FACTOR
    return known_step + int(max(0.0, since_s) / fastest_step_s) + SLACK_STEPS


def choose_trusted(holders: Sequence[Holder], known: Known) -> Verdict:
    """The state to consider fetching, by the rules of the module docstring."""
    refused = []
    backers: dict[tuple[int, str], set[PeerID]] = {}
    for h in holders:
        if known.horizon is not None and h.step > known.horizon:
            refused.append((h.peer_id, f"step {h.step} is not reachable from step {known.step} in the time seen"))
            continue
        backers.setdefault((h.step, h.manifest), set()).add(h.peer_id)
    # the node itself and the peers at its step (whatever their hash: a node whose snapshot of a
    # step just finished is not made yet still counts them)
    own_backing = 1 + len({peer for (step, _), peers in backers.items() if step == known.step for peer in peers})
    if known.missed:
        own_backing = min(own_backing, MISSED_STEP_BACKERS)
    newer = {c: peers for c, peers in backers.items() if c[0] > known.step and len(peers) >= own_backing}
    for (step, sha), peers in backers.items():
        if step > known.step and (step, sha) not in newer:
            for peer in peers:
                refused.append((peer, f"step {step} is backed by {len(peers)} peer(s), ours by {own_backing}"))
    vouched = {c: peers for c, peers in newer.items() if peers & known.vouching}
    earned = {c: peers for c, peers in newer.items() if peers & known.earned}
    pool = vouched or earned or newer
    choice: tuple[int, str] | None = None
    if pool:
        senior = known.earned if pool is earned else frozenset()  # rank by backers who earned it first
        choice = min(pool, key=lambda c: (-len(pool[c] & senior), -len(pool[c]), c[0], c[1]))
    else:
        older = {c: peers for c, peers in backers.items() if c[0] <= known.step}
        if older:
            newest = max(c[0] for c in older)
            choice = min((c for c in older if c[0] == newest), key=lambda c: (-len(older[c]), c[1]))
    fork = _fork_to_check(holders, known)
    if choice is None:
        return Verdict(None, tuple(refused), fork)
    return Verdict((*choice, _held(holders, choice)), tuple(refused), fork)


def _fork_to_check(holders: Sequence[Holder], known: Known) -> tuple[int, str, list[Holder]] | None:
    """Rule 5: the state other than our own, at most FORK_STEPS from our step (the horizon
    aside), that the most of our earned peers back; one behind us only when it is not of our
    lineage and at least as many earned peers back it as stand at our step. It may be the choice
    too: one that fetch_reason lets the node keep its own state beside (a fork at its own step)."""
    backers: dict[tuple[int, str], set[PeerID]] = {}
    at_our_step: set[PeerID] = set()  # earned peers at our step, whatever their hash
    for h in holders:
        if h.peer_id not in known.earned or abs(h.step - known.step) > FORK_STEPS:
            continue
        if h.step == known.step:
            at_our_step.add(h.peer_id)
            if h.peer_id in known.last_round:  # they hold our state
                continue
        if h.step < known.step and (h.step, h.manifest) in known.ancestors:
            continue
        backers.setdefault((h.step, h.manifest), set()).add(h.peer_id)
    backers.pop((known.step, known.sha or ""), None)
    ours = 1 + len(at_our_step)
    backers = {c: peers for c, peers in backers.items() if c[0] >= known.step or len(peers) >= ours}
    if not backers:
        return None
    best = min(backers, key=lambda c: (-len(backers[c]), c[0], c[1]))
    return (*best, _held(holders, best))


def _held(holders: Sequence[Holder], state: tuple[int, str]) -> list[Holder]:
    return [h for h in holders if (h.step, h.manifest) == state]


def manifest_problem(manifest: Manifest, expected: Mapping[str, int]) -> str | None:
    """Why a manifest cannot be this node's state (None: it can): `expected` maps each tensor
    name of the state ("params/<name>", "momentum/<name>") to its raw byte size."""
    listed = [name for shard in manifest.shards for name in shard.tensors]
    if set(listed) != set(expected) or len(listed) != len(expected):
        return f"it lists {len(listed)} tensors, not the model's {len(expected)}"
    for shard in manifest.shards:
        raw = sum(expected[name] for name in shard.tensors)
        most = raw + HEADER_BYTES + HEADER_BYTES_PER_TENSOR * len(shard.tensors)
        if not raw < shard.nbytes <= most:
            return f"{shard.name} is {shard.nbytes} bytes; its tensors take {raw} (at most {most} with the header)"
    return None


def fetch_reason(step: int, sha: str, holders: int, own_step: int, own_sha: str | None, *,
                 alone_last_step: bool, client: bool, servers_behind: bool = False,
                 other_state: bool = False) -> str | None:  # fmt: skip
    """Why a node should fetch the swarm's chosen state (`step`, `sha`, advertised by `holders`
    peers), or None when its own state is right (see the module docstring). servers_behind:
    every live server is at an earlier step, and none is about to publish ours. other_state:
    matchmaking found that the swarm starts our step from another state than ours."""
    if step > own_step:
        return "behind"
    if other_state and step == own_step and own_sha != sha:
        return "not the swarm's state"
    agreed = holders >= (1 if client else 2)  # a client's own state can never be served: it follows
    if alone_last_step and step == own_step and agreed and own_sha != sha:
        return "missed its group"
    if client and alone_last_step and servers_behind and step < own_step:
        return "ahead of every server"
    return None
