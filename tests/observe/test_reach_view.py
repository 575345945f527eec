"""The dashboard shows how each node is reached (its progress record's `reach`), and only one of
direct, punched or relayed: anything else a peer writes there shows as not said."""

from __future__ import annotations

import pytest

from swarm.dht.records import owner_subkey
from swarm.node.progress import OwnProgress
from swarm.observe.runview import RunView
from tests.observe.test_runview import PEERS, record


@pytest.mark.parametrize(
    ("said", "shown"),
    [
        ("direct", "direct"),
        ("punched", "punched"),
        ("relayed", "relayed"),
        ("upnp", None),
        ("x" * 10_000, None),
        (3, None),
        (None, None),
    ],
)
def test_a_nodes_reach_is_shown_when_it_is_one_we_know(said: object, shown: str | None) -> None:
    view = RunView("demo")
    view.update([(owner_subkey(PEERS[0]), record(3, reach=said))], [], now=1002.0)
    assert view.snapshot()["nodes"][0]["reach"] == shown


def test_a_node_publishes_its_reach() -> None:
    own = OwnProgress(maddrs=[], client=False, step=1, inner=0, H=4, sec_per_step=0.5, train_loss=None,
                      eval_loss=None, tokens_per_s=None, group_size=1, reach="punched")  # fmt: skip
    assert own.encode(now=5.0)["reach"] == "punched"
