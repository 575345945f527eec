"""A forged state cannot take over the swarm: 3 honest SwarmNodes in one event loop over real
sockets, K attacker identities (each with a proven DHT id) that copy the honest lineage from an
honest node's `state.lineage` and extend it with a round of their own that ends in a forged
state (an all-zero θ, or the honest state with one tensor scaled x1.5), at the honest swarm's
step or one step ahead, following the honest tip as it moves; then a newcomer that joins through
the bootstrap alone (a bare DHT node: it vouches for nothing). Before round receipts, 3 such
identities took every node (eval ln 256 = 5.5452 everywhere). Now no honest node and no newcomer
fetches a state the honest nodes did not compute, they agree at every step, and their final eval
loss is within 1.05x of the same run without the attackers."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from swarm.dht import DHTNode
from swarm.dht.records import owner_subkey
from swarm.dht.run_keys import nodes_key
from swarm.model.checkpoint import Snapshot, copy_state, make_snapshot
from swarm.model.data import TokenData
from swarm.model.state_hash import state_sha256
from swarm.p2p import P2PHost
from swarm.p2p.errors import P2PError
from swarm.p2p.identity import Identity
from swarm.state.holders import advertise
from swarm.state.lineage_book import LINEAGE, serve_lineage
from swarm.state.receipts import Receipt, RoundBody, decode_receipt, sign
from swarm.state.server import StateServer
from tests.node.inprocess import QUICK, LocalSwarm, Running
from tests.node.test_attacks_bounds import (
    FOURTH_SEED,
    LONG,
    RUN_ID,
    STEPS,
    assert_agree,
    assert_fetched_only_swarm_states,
    assert_within_clean,
    clean_run,
    fetches,
    finish,
    outsider,
    progress_record,
    start_honest,
    until_stepped,
)
from tests.waiting import until as until_true

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]
FOLLOW_S = 0.5  # how often the attackers look at the honest tip and move their forgery with it
# the turncoats' three rounds (steps 0-2), then three steps under their forgery: agreed on and
# compared with a clean run of as many steps (the module's one clean run: the other tests read
# their fewer steps from it)
TURNCOAT_STEPS = 6


def zero_state(state: dict[str, Any]) -> dict[str, Any]:
    for kind in ("params", "momentum"):
        state[kind] = {n: torch.zeros_like(t) for n, t in state[kind].items()}
    return state


def scaled_state(state: dict[str, Any]) -> dict[str, Any]:
    """The quieter forgery: the honest θ with its first tensor scaled x1.5."""
    first = next(iter(state["params"]))
    state["params"] = {**state["params"], first: state["params"][first] * 1.5}
    return state


class Forgers:
    """K attacker identities serving one forged state with a lineage copied from an honest node
    and extended by a round whose members are the attackers alone, all signing it."""

    def __init__(self, peers: list[tuple[P2PHost, DHTNode]], like: Running, *, ahead: int,
                 forge: Callable[[dict[str, Any]], dict[str, Any]], from_genesis: bool = False,
                 says_so: bool = False) -> None:  # fmt: skip
        self.peers, self.like, self.ahead, self.forge = peers, like, ahead, forge
        self.from_genesis = from_genesis  # every round of the lineage made up, not only the last
        self.says_so = says_so  # each also publishes a progress record of the step after the forged state
        self.receipts: list[Receipt] = []
        self.servers = [StateServer(host, RUN_ID) for host, _ in peers]
        for host, _ in peers:
            serve_lineage(host, RUN_ID, lambda: self.receipts)
        self.snapshot: Snapshot | None = None
        self.forged_at: int | None = None
        self.forgeries = 0

    async def follow(self, honest_maddr: str) -> None:
        while True:
            with contextlib.suppress(P2PError):
                await self._forge_at_the_tip(honest_maddr)
            if self.snapshot is not None:
                for host, dht in self.peers:
                    await advertise(dht, RUN_ID, self.snapshot.manifest, host.visible_maddrs, time.time() + 10)
                    if self.says_so:  # training on from the forged state: ahead of the honest nodes as they plan
                        h = QUICK["inner_steps"]
                        record = progress_record(dht, self.snapshot.manifest.step + 1, h, h, 0.5)
                        await dht.store(nodes_key(RUN_ID), record, time.time() + 10, owner_subkey(dht.peer_id))
            await asyncio.sleep(FOLLOW_S)

    async def _forge_at_the_tip(self, honest_maddr: str) -> None:
        host = self.peers[0][0]
        reply = await host.call(honest_maddr, LINEAGE, {"run": RUN_ID, "since": 0}, timeout=5.0)
        honest = [decode_receipt(item, RUN_ID) for item in reply["receipts"]]
        if not honest:
            return
        # at the honest step: a round of ours in place of the honest round that made its state;
        # one step ahead: a round of ours on top of the honest state
        base = honest if self.ahead else honest[:-1]
        tip = honest[-1].body
        step = tip.step + 1 if self.ahead else tip.step
        if step == self.forged_at:
            return
        parent = tip.result if self.ahead else tip.parent
        state = copy_state(self.like.node.diloco.state_dict())  # the honest θ now: the quiet forgery scales it
        state["outer_step"] = step + 1
        state = self.forge(state)
        result = bytes.fromhex(state_sha256(state))
        if self.from_genesis:  # made-up states from the honest genesis on, every round ours
            base, parent = [], honest[0].body.parent
            for made_up in range(step):
                base.append(self._round(tip.settings, made_up, parent, hashlib.sha256(b"%d" % made_up).digest()))
                parent = base[-1].body.result
        self.snapshot = make_snapshot(state, self.like.node.run_info, shard_bytes=1 << 20)
        for server in self.servers:
            server.publish(self.snapshot)
        self.receipts = [*base, self._round(tip.settings, step, parent, result)]
        self.forged_at = step
        self.forgeries += 1

    def _round(self, settings: bytes, step: int, parent: bytes, result: bytes) -> Receipt:
        """A round of the attackers alone, each signing it."""
        members = tuple(host.peer_id for host, _ in self.peers)
        group = hashlib.sha256(b"forged %d" % step).digest()
        body = RoundBody(RUN_ID, settings, step, group, members, tuple(1024.0 for _ in members), parent, result)
        return Receipt(body, {host.peer_id: sign(body, host.identity) for host, _ in self.peers})


async def attacked(local: LocalSwarm, bootstrap: str, honest: list[Running], k: int, newcomer_joins: str,
                   identities: list[Identity | None] | None = None, steps: int = STEPS,
                   **forging: Any) -> Running:  # fmt: skip
    """K attacker identities (fresh ones, or `identities`) forge (Forgers, with `forging`) while a
    newcomer joins through `newcomer_joins` and the honest nodes finish their `steps`, and until
    the attackers have followed the honest tip to a second step; the attackers stop with them.
    Returns the newcomer."""
    async with contextlib.AsyncExitStack() as stack:
        keys = list(identities) if identities is not None else [None] * k
        peers = [await stack.enter_async_context(outsider(bootstrap, key)) for key in keys]
        forgers = Forgers(peers, honest[0], **forging)
        following = asyncio.ensure_future(forgers.follow(honest[0].node.maddrs[0]))
        try:  # the newcomer comes when the forgery is there to be found
            await until_true(lambda: forgers.forgeries >= 1 or following.done(), 60, "a forgery", poll=0.05)
            # the newcomer trains and averages with the honest nodes once it holds their state: of
            # the identity (so the data) that the clean run it is compared with has as its fourth
            newcomer = local.start((newcomer_joins,), identity=Identity.from_seed(FOURTH_SEED), max_outer_steps=LONG)
            # the honest nodes go on until the forgery has moved with their tip once: on a busy machine
            # their last steps can come before it did, and then the test would show nothing
            await finish(honest, (newcomer,), timeout=180, until=lambda: forgers.forgeries >= 2, steps=steps)
        finally:
            following.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await following
    assert forgers.forgeries >= 2, "the attackers never followed the honest tip: the test shows nothing"
    return newcomer


ATTACKS = [
    # (attackers, steps ahead of the honest tip, the forged θ, whether their progress records say so)
    pytest.param(3, 0, zero_state, False, id="3 ids, zero state at the honest step"),
    # as many servers ahead as stand at an honest node's step (the newcomer's included): it plans
    # to fetch. Before the holders of a refused lineage were taken for a fork, each honest node
    # planned to fetch the forged state, refused its lineage, and planned it again for as long as
    # they said so: the run never ended (checked on that code)
    pytest.param(4, 1, zero_state, True, id="4 ids, zero state one step ahead, and their records say so"),
    pytest.param(4, 0, scaled_state, False, id="4 ids, the honest state with a tensor x1.5"),
    pytest.param(8, 0, zero_state, False, id="8 ids, more than the honest nodes twice over, at the honest step"),
    pytest.param(2, 1, zero_state, False, id="2 ids one step ahead (fewer than the honest nodes)"),
]


@pytest.mark.parametrize(("k", "ahead", "forge", "says_so"), ATTACKS)
async def test_a_forged_lineage_takes_no_honest_node_and_no_newcomer(
    local: LocalSwarm, data: TokenData, caplog: pytest.LogCaptureFixture, k: int, ahead: int,
    forge: Callable[[dict[str, Any]], dict[str, Any]], says_so: bool,
) -> None:  # fmt: skip
    clean = await clean_run(data, FOURTH_SEED, steps=TURNCOAT_STEPS)
    bootstrap = await local.start_bootstrap()
    honest = start_honest(local, bootstrap)
    await until_stepped(honest)
    await until_true(lambda: all(len(n.steps()) >= 2 for n in honest), 60, "two steps of every node", poll=0.1)
    newcomer = await attacked(local, bootstrap, honest, k, bootstrap, ahead=ahead, forge=forge,
                              says_so=says_so)  # joins through a bare bootstrap  # fmt: skip
    if says_so:  # the forgers' records ahead were read, and no node waited max_wait on them
        said = [r.getMessage() for r in caplog.records]
        assert any("of a lineage we refused" in m for m in said), "no record ahead was read: the test shows nothing"
        assert not any("no state of theirs came" in m for m in said), "a node waited max_wait on the forgers"
    nodes = [*honest, newcomer]
    assert_fetched_only_swarm_states(nodes)  # never the forged state: no honest node computed it
    assert_agree(honest, (newcomer,))
    assert_within_clean(honest, clean)
    assert fetches(newcomer), "the newcomer never took the swarm's state"


async def test_a_lineage_made_up_from_genesis_one_step_ahead_moves_no_node_in_sync_nor_a_vouched_newcomer(
    local: LocalSwarm, data: TokenData
) -> None:
    """The strongest forgery the lineage cannot refuse by itself: 4 identities sign every round
    from the run's genesis to a zero state one step ahead of the honest swarm. A node that
    averaged keeps its own lineage (a fork of genesis, not held by an initial peer), and a
    newcomer whose --initial-peers name an honest node takes the lineage that node holds."""
    clean = await clean_run(data, FOURTH_SEED, steps=TURNCOAT_STEPS)
    bootstrap = await local.start_bootstrap()
    honest = start_honest(local, bootstrap)
    await until_stepped(honest)
    vouched_by = honest[0].node.maddrs[0]  # the newcomer's initial peer: an honest node
    newcomer = await attacked(local, bootstrap, honest, 4, vouched_by, ahead=1, forge=zero_state, from_genesis=True)
    assert_fetched_only_swarm_states([*honest, newcomer])
    assert_agree(honest, (newcomer,))
    assert_within_clean(honest, clean)


TURNCOATS = [bytes([21]) * 32, bytes([22]) * 32]  # two identities that average honestly, then fork


async def test_members_that_averaged_honestly_for_three_rounds_then_fork_move_nobody(
    local: LocalSwarm, data: TokenData
) -> None:
    """Two of five nodes average honestly in the rounds of steps 0-2 (a minority of each round,
    with their signatures in its receipt), then leave and, under the same identities and with
    two fresh ones (four holders of the forgery against three honest), extend the honest lineage
    with a round of their own ending in a zero state, one step ahead of the tip (where the tip's
    round was theirs too, they hold 2 of its 5 members: fewer than half), while a newcomer joins
    through the bare bootstrap. Their earlier rounds earned them nothing: no honest node and not
    the newcomer takes the forged state. What stops it varies with timing: a node in sync has no
    reason to fetch a state of its own step; when the forgery is a step ahead of a node as it
    looks, its lineage is refused (its round "is endorsed by 0 of the 3 members of the round
    before it", seen in some runs); the newcomer finds the honest state held by more peers first.
    Checked with the endorsement rule switched off: this test then still passed, so it shows the
    outcome, not that the lineage alone gives it."""
    clean = await clean_run(data, FOURTH_SEED, steps=TURNCOAT_STEPS)
    bootstrap = await local.start_bootstrap()
    honest = start_honest(local, bootstrap)
    keys = [Identity.from_seed(seed) for seed in TURNCOATS]
    turncoats = [local.start((bootstrap,), identity=key, max_outer_steps=LONG) for key in keys]
    await until_true(lambda: all(len(n.steps()) >= 3 for n in turncoats), 120, "three rounds of theirs", poll=0.1)
    rounds = [n.steps()[s]["group_size"] for n in turncoats for s in range(3)]
    assert max(rounds) == 5, f"the turncoats never averaged in a round of all five: {rounds}"
    for n in turncoats:
        n.stop.set()
    await asyncio.wait_for(asyncio.gather(*(n.task for n in turncoats)), 60)
    forgers: list[Identity | None] = [*keys, None, None]
    newcomer = await attacked(local, bootstrap, honest, 4, bootstrap, identities=forgers, steps=TURNCOAT_STEPS,
                              ahead=1, forge=zero_state)  # fmt: skip
    nodes = [*honest, newcomer]
    assert_fetched_only_swarm_states(nodes)
    assert_agree(honest, (newcomer,), steps=TURNCOAT_STEPS)
    assert_within_clean(honest, clean, TURNCOAT_STEPS)
    assert fetches(newcomer), "the newcomer never took the swarm's state"
