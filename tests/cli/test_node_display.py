"""swarm-node's lines about state (swarm/cli/node_display.py): a fetch says where its state came from."""

from __future__ import annotations

from swarm.cli.node_display import state_line

FETCH = {"event": "fetch", "outer_step": 7, "reason": "behind", "bytes": 1_414_946, "peers": 1, "seconds": 1.3,
         "MBps": 1.1}  # fmt: skip


def test_a_fetch_says_whether_it_took_the_state_or_the_steps_update() -> None:
    whole = state_line({**FETCH, "by_update": False})
    assert whole.startswith("fetched the swarm's state of outer step 7 (behind)")
    by_update = state_line({**FETCH, "by_update": True})
    assert by_update.startswith("fetched the update to the swarm's state of outer step 7")
    assert state_line(FETCH) == whole  # events of nodes before by_update existed
