"""--relay and its limits (swarm-node, swarm-dht serve), and peers given by a relayed multiaddr."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from swarm.cli.dht import main as dht_main
from swarm.cli.node import main as node_main
from swarm.cli.options import maddr_argument, peer_maddr_list
from swarm.p2p.identity import Identity

RELAY, PEER = (Identity.generate().peer_id for _ in range(2))
RELAYED = f"/ip4/10.77.0.2/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PEER}"


def test_a_peer_to_dial_may_be_a_relayed_multiaddr() -> None:
    assert peer_maddr_list(None, None, (f"{RELAYED}, /ip4/1.2.3.4/tcp/1",)) == (RELAYED, "/ip4/1.2.3.4/tcp/1")  # type: ignore[arg-type]
    assert maddr_argument(None, None, RELAYED) == RELAYED  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [f"/ip4/10.77.0.2/tcp/4001/p2p-circuit/p2p/{PEER}", f"{RELAYED}/p2p-circuit/p2p/{RELAY}", "/ip4/1.2.3.4"],
    ids=["anonymous-relay", "circuit-of-circuits", "no-port"],
)
def test_a_bad_relayed_peer_is_a_bad_parameter(bad: str) -> None:
    with pytest.raises(click.BadParameter):
        peer_maddr_list(None, None, (bad,))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("main", "prog"), [(node_main, "swarm-node"), (dht_main, "swarm-dht")], ids=["swarm-node", "swarm-dht"]
)
@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--relay", "maybe"], "'maybe' is not one of 'on', 'off'"),
        (["--relay-circuits", "0"], "x>=1"),
        (["--relay-circuit-mib", "1e12"], "circuit limits out of range"),
    ],
    ids=["relay", "circuits", "bytes"],
)
def test_relay_limits_out_of_range_are_refused_with_a_reason(main: click.Command, prog: str, flags: list[str],
                                                             why: str) -> None:  # fmt: skip
    args = (["serve"] if prog == "swarm-dht" else []) + [*flags, "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    result = CliRunner().invoke(main, args, prog_name=prog)
    assert result.exit_code == 2 and "Traceback" not in result.stderr and why in result.stderr, result.stderr
