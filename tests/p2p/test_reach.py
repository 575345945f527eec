"""How a host says it is reached (p2p/reach.py): a table of what it can know alone."""

from __future__ import annotations

import pytest

from swarm.p2p.reach import DIRECT, PUNCHED, RELAYED, own_reach, relayed_may_own


@pytest.mark.parametrize(
    ("reachable", "listen_port", "observed_port", "outcomes", "expected"),
    [
        (True, 4001, None, [], DIRECT),  # a dial-back worked: nothing else matters
        (True, 4001, 5555, [RELAYED], DIRECT),
        (False, 4001, 4001, [], PUNCHED),  # the NAT kept our port: it maps it alike for everyone
        (False, 4001, 4001, [RELAYED, RELAYED], PUNCHED),  # our peers' NATs (or no hairpinning) failed, not ours
        (False, 4001, 5555, [], RELAYED),  # a new port for the relay: a symmetric NAT, or one we cannot tell
        (False, 4001, 5555, [RELAYED], RELAYED),
        (False, 4001, 5555, [RELAYED, PUNCHED], PUNCHED),  # a punch worked: a NAT that translates ports alike
        (False, None, 4001, [], RELAYED),  # not listening on IPv4: no port to compare
        (False, 4001, None, [], RELAYED),  # no reservation told us what the relay sees
    ],
)
def test_a_host_behind_nat_is_punched_only_when_its_nat_lets_punches_through(
    reachable: bool, listen_port: int | None, observed_port: int | None, outcomes: list[str], expected: str
) -> None:
    assert own_reach(reachable=reachable, listen_port=listen_port, observed_port=observed_port,
                     outcomes=outcomes) == expected  # fmt: skip


@pytest.mark.parametrize(
    ("peers", "may_own"),
    [
        ([], True),  # nobody else: the relayed node owns the parts
        ([(False, RELAYED), (False, RELAYED)], True),  # all relayed: they average through the relays
        ([(True, DIRECT)], True),  # a direct client owns nothing either
        ([(False, RELAYED), (False, PUNCHED)], False),  # a punched peer owns the parts
        ([(False, DIRECT)], False),
        ([(False, None)], False),  # a peer that does not say counts as direct
    ],
)
def test_a_relayed_node_owns_parts_only_where_no_peer_could(
    peers: list[tuple[bool, str | None]], may_own: bool
) -> None:
    assert relayed_may_own(peers) is may_own
