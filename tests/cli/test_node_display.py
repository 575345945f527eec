"""swarm-node's display (swarm/cli/node_display.py): a fetch says where its state came from and from how
many peers; the live panel's clock runs on, and its exit leaves a summary line."""

from __future__ import annotations

import io

from rich.console import Console

from swarm.cli.node_display import LivePanel, join_lines, state_line
from swarm.node.config import NodeConfig

FETCH = {"event": "fetch", "outer_step": 7, "reason": "behind", "bytes": 1_414_946, "peers": 1, "seconds": 1.3,
         "MBps": 1.1}  # fmt: skip


def test_a_fetch_says_whether_it_took_the_state_or_the_steps_update() -> None:
    whole = state_line({**FETCH, "by_update": False})
    assert whole.startswith("fetched the swarm's state of outer step 7 (behind)")
    by_update = state_line({**FETCH, "by_update": True})
    assert by_update.startswith("fetched the update to the swarm's state of outer step 7")
    assert state_line(FETCH) == whole  # events of nodes before by_update existed


def test_a_fetch_from_one_peer_says_peer() -> None:
    assert "from 1 peer in 1.30s" in state_line(FETCH)
    assert "from 3 peers in" in state_line({**FETCH, "peers": 3})
    progress = {"event": "fetch_progress", "outer_step": 7, "done_bytes": 1, "total_bytes": 2, "MBps": 1.0, "peers": 1}
    assert state_line(progress).endswith("from 1 peer")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _shown(panel: LivePanel) -> str:
    out = io.StringIO()
    Console(file=out, width=120, force_terminal=False).print(panel.progress)
    return out.getvalue()


def test_the_panels_clock_runs_through_outer_steps_and_its_exit_leaves_a_summary() -> None:
    """Its clock stopped for good once the bar first filled (rich's elapsed column), while the
    values went on changing; and nothing of the panel said how the node ended."""
    clock, terminal = Clock(), io.StringIO()
    panel = LivePanel(console=Console(file=terminal, width=120, force_terminal=True), clock=clock)
    try:
        panel({"event": "progress", "outer_step": 0, "inner_step": 50, "inner_steps": 50})  # the bar fills
        clock.now += 30
        panel({"event": "outer_step", "outer_step": 0, "train_loss": 2.5, "eval_loss": 2.25, "group_size": 3,
               "tokens_per_s": 900.0, "bytes_sent": 1, "bytes_received": 1, "state_sha256": "ab" * 32})  # fmt: skip
        panel({"event": "progress", "outer_step": 1, "inner_step": 10, "inner_steps": 50})
        clock.now += 125
        assert "0:02:35" in _shown(panel)
        panel({"event": "exit", "reason": "stopped", "outer_step": 1})
    finally:
        panel.close()
    assert ("exit (stopped) with 1 outer steps done; last step: train loss 2.5000, eval loss 2.2500, "
            "state abababababab") in terminal.getvalue()  # fmt: skip


def test_the_join_line_of_a_new_run_carries_start_with() -> None:
    # a joiner without --start-with trains at once, and the first node then starts with it alone:
    # the first node's --start-with must reach the volunteers who paste its line
    start = {"peer_id": "12D3KooWabc", "maddrs": ["/ip4/192.0.2.7/tcp/31400/p2p/12D3KooWabc"], "outer_step": 0}
    join = join_lines(start, NodeConfig(run_id="demo", start_with=3))[-1]
    assert join == ("join with: swarm-node --run-id demo --model tiny --start-with 3 "
                    "--initial-peers /ip4/192.0.2.7/tcp/31400/p2p/12D3KooWabc")  # fmt: skip
    assert "--start-with" not in join_lines(start, NodeConfig(run_id="demo"))[-1]
    # a run under way is joined at once whatever the flag says: the line of a restarted node leaves it out
    assert "--start-with" not in join_lines({**start, "outer_step": 8}, NodeConfig(run_id="demo", start_with=3))[-1]
