"""Floods of throwaway identities in matchmaking: 3 honest SwarmNodes in one event loop
over real sockets while a relay stores, at every step, 16 "ready" announcements of another state
and a FORMED marker of the honest state, each signed by a fresh identity that never paid for a
DHT id (averaging/ready.py). Before announcements carried proofs, the fakes outvoted the swarm's
state (every honest node looked for a state nobody serves) or made every node wait for a group
that never formed."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from swarm.averaging.matchmaking.liveness import Liveness
from swarm.averaging.matchmaking.ready import announcement, formed_marker
from swarm.averaging.messages import MemberInfo
from swarm.dht import DHTConfig, Record, owner_subkey
from swarm.dht.id_proof import solve
from swarm.dht.run_keys import ready_key
from swarm.model.data import TokenData
from swarm.p2p import P2PHost
from swarm.p2p.errors import P2PError
from swarm.p2p.identity import Identity
from tests.averaging.test_ready import failing_nonce
from tests.node.inprocess import LOCAL, LocalSwarm, Running
from tests.node.test_attacks_bounds import (
    HONEST_SEEDS,
    RUN_ID,
    assert_agree,
    assert_within_clean,
    clean_run,
    fetches,
    finish,
    repeat,
    start_honest,
    story,
)
from tests.waiting import until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]

FAKES = 16  # the most one source may store under one key (dht/quotas.py); more than the honest nodes


def fake_records(
    step: int,
    honest_state: bytes,
    fakes: list[Identity],
    settings: bytes,
    proofs: list[bytes] | None = None,
    kind: str = "both",
    former: MemberInfo | None = None,
) -> list[dict[str, object]]:
    """Signed records of the run's settings (public: every ready record carries them), without
    a proof of a costly id unless `proofs` (one valid nonce per fake) are given. kind "both":
    ready announcements of another state from every fake but the last, and a FORMED marker of
    the honest state from the last; "other_state" / "same_state": announcements only, of
    another state / of the honest state; "formed": the last fake's FORMED marker only, naming
    `former` as where to reach it when given. Every other fake's address is a closed port: none
    of them answers."""
    expiration, other = time.time() + 30, b"\x07" * 32
    bits = DHTConfig().id_bits  # the tests' (conftest.py), as every node of this test uses
    nonces = proofs if proofs is not None else [failing_nonce(i.peer_id, bits) for i in fakes]
    announced = honest_state if kind == "same_state" else other
    values: list[object] = []
    if kind != "formed":
        values = [announcement(MemberInfo(i.peer_id, ("/ip4/127.0.0.1/tcp/9",), 1.0, 100.0, False, announced), n,
                               settings) for i, n in zip(fakes[:-1], nonces, strict=False)]  # fmt: skip
    if kind in ("both", "formed"):
        values.append(formed_marker(honest_state, b"g" * 32, nonces[-1], settings, former))
    else:
        values.append(announcement(MemberInfo(fakes[-1].peer_id, ("/ip4/127.0.0.1/tcp/9",), 1.0, 100.0, False,
                                              announced), nonces[-1], settings))  # fmt: skip
    fakes = fakes[-len(values) :]
    key = ready_key(RUN_ID, step)
    signed = zip(fakes, values, strict=True)
    return [Record.create(key, owner_subkey(i.peer_id), v, expiration, i).to_wire() for i, v in signed]


async def test_attack_g_a_flood_of_unproven_ready_records_does_not_stop_averaging(
    local: LocalSwarm, data: TokenData
) -> None:
    await run_flood(local, data, "both", proven=False)


@pytest.mark.parametrize("kind", ["other_state", "same_state", "formed"])
async def test_attack_g_proven_identities_that_never_answer_do_not_stop_averaging(
    local: LocalSwarm, data: TokenData, kind: str
) -> None:
    """The fakes paid for their ids (a valid proof each) but none answers at its address: 16
    announcements of another state (they would outvote the 3 honest nodes), 16 of the honest
    state (fake leaders, and a majority of the announced that never joins, so that no leader
    may finalize), or one FORMED marker of the honest state (every node "late", waiting for a
    result that never comes, for as long as the attacker renews the marker)."""
    await run_flood(local, data, kind, proven=True)


async def test_attack_g_a_live_identitys_formed_marker_delays_the_swarm_once(
    local: LocalSwarm, data: TokenData, caplog: pytest.LogCaptureFixture
) -> None:
    """The attacker paid for its id and answers liveness checks, and renews a FORMED marker of
    the honest state every 0.3 s: every honest node is "late" and waits for a result that never
    comes. After max_wait (10 s here) each ignores that identity's markers and the swarm goes
    on; before, it waited forever. The third honest node starts once the first two have ignored
    the marker and stepped twice: it finds the marker at its first step, and the result of the
    group the two formed without it (it never announced) comes. Taking that result for the
    marker's, it was late at every step after, fetching each and never averaging again (CI,
    under load: 36 steps of fetches); a marker whose owner is not in the round we fetched is
    ignored from then on, as one that brought no result."""
    caplog.set_level(logging.WARNING, logger="swarm.averaging.matchmaking.ready_board")
    honest = await run_flood(local, data, "formed", proven=True, live=True, third_late=True)
    late = honest[2]
    assert caplog.text.count("ignoring the FORMED markers of") == 3, caplog.text
    # the third: its start's fetch, and at most the one step the marker made it late for
    assert len(fetches(late)) <= 2, story(late)


async def run_flood(local: LocalSwarm, data: TokenData, kind: str, *, proven: bool, live: bool = False,
                    third_late: bool = False) -> list[Running]:  # fmt: skip
    clean = await clean_run(data)
    bootstrap = await local.start_bootstrap()
    honest = start_honest(local, bootstrap, seeds=HONEST_SEEDS[:2] if third_late else HONEST_SEEDS)
    fakes = [Identity.generate() for _ in range(FAKES)]
    bits = DHTConfig().id_bits
    proofs = [solve(i.peer_id, bits) for i in fakes] if proven else None
    stored: list[str] = []
    async with P2PHost(fakes[-1], config=LOCAL) as relay:
        # the last fake is the relay itself: it answers liveness checks (live) as a node would
        alive = Liveness(relay, RUN_ID, 2.0) if live else None
        former = MemberInfo(relay.peer_id, tuple(relay.visible_maddrs), 0.0, 100.0, False) if live else None

        async def flood() -> None:
            lead = max(honest, key=lambda n: n.node.diloco.outer_step).node
            step, state = lead.diloco.outer_step, lead.facts.state_sha
            targets = [bootstrap, *(m for n in honest for m in n.node.maddrs[:1])]
            for s in (step, step + 1):
                settings = honest[0].node.config.averaging_config(False).settings
                records = fake_records(s, state, fakes, settings, proofs, kind, former)
                for target in targets:
                    try:
                        reply = await relay.call(target, "dht.store", {"a": None, "records": records}, timeout=5)
                    except P2PError:  # a node that is starting: the next round reaches it
                        continue
                    stored.extend(str(r) for r in reply["results"])

        flooding = asyncio.ensure_future(repeat(0.3, flood))
        try:
            if third_late:
                await until(lambda: all(1 in n.steps() for n in honest), 60, "the first two's step 1")
                honest.extend(start_honest(local, bootstrap, seeds=HONEST_SEEDS[2:]))
            await finish(honest, timeout=90)
        finally:
            flooding.cancel()
            if alive is not None:
                alive.close()
    # the fakes were in the DHT: the attack ran
    assert stored.count("ok") >= (1 if kind == "formed" else FAKES), stored[:20]
    assert_agree(honest)
    steps = [e for n in honest for s, e in n.steps().items() if s >= 1]
    assert steps and all(e["group_size"] >= 2 for e in steps), [e["group_size"] for e in steps]  # never alone
    assert_within_clean(honest, clean)
    return honest
