"""One step numbering: for the same node, "steps done" is the same number in its log lines and
exit line (swarm-node's PlainLines), its live panel, its events, its Prometheus metric, swarm-sim's
table, and the progress record that `swarm-dht inspect` and the dashboard (RunView) show. Two
nodes train a run of 2 outer steps in one event loop; every output is fed from that run."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest

from swarm.cli.node_display import LivePanel, PlainLines
from swarm.cli.sim_report import COLUMNS, NodeRecord, table_rows
from swarm.dht.run_keys import nodes_key
from swarm.node.progress import decode_progress
from swarm.observe.metrics import NodeMetrics
from swarm.observe.runview import RunView
from tests.node.inprocess import LocalSwarm

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]


async def test_every_output_says_the_same_steps_done_for_a_node(
    local: LocalSwarm, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bootstrap = await local.start_bootstrap()
    nodes = [local.start((bootstrap,), max_outer_steps=2) for _ in range(2)]
    assert await local.finish(150) == ["finished"] * 2
    node = nodes[0]
    events = [e for e in node.events if e["event"] in ("start", "progress", "outer_step", "fetch", "exit")]

    said: dict[str, int] = {}
    said["events (exit)"] = [e for e in events if e["event"] == "exit"][-1]["outer_step"]
    said["events (last outer_step, 0-based, + 1)"] = max(node.steps()) + 1

    lines = PlainLines()
    for event in events:
        lines(event)
    log = capsys.readouterr().err
    said["log (last step line)"] = int(re.findall(r"\((\d+) outer steps done\)", log)[-1])
    said["log (exit line)"] = int(re.findall(r"with (\d+) outer steps done", log)[-1])

    panel = LivePanel()
    try:
        for event in events:
            panel(event)
        said["live panel"] = int(panel.progress.tasks[0].fields["step"])
    finally:
        panel.close()

    metrics = NodeMetrics()
    for event in events:
        metrics(event)
    said["prometheus swarm_outer_step"] = int(metrics.registry.get_sample_value("swarm_outer_step") or -1)

    record = NodeRecord(name="node0", log=tmp_path / "node0.log")
    for event in events:
        record.apply(event)
    said["swarm-sim table"] = int(table_rows([record])[0][COLUMNS.index("steps done")])

    assert local.bootstrap is not None
    found = await asyncio.wait_for(local.bootstrap[1].get(nodes_key("inproc"), latest=True), 30)
    assert found is not None and isinstance(found.value, dict)
    entries = [(subkey, getattr(entry, "value", None)) for subkey, entry in found.value.items()]
    ours = [p for p in (decode_progress(s, v) for s, v in entries) if p is not None and p.peer_id == node.node.peer_id]
    said["progress record (swarm-dht inspect)"] = ours[0].step
    view = RunView("inproc")
    view.update(entries, [], time.time())
    said["dashboard"] = next(r["step"] for r in view.nodes if r["peer_id"] == str(node.node.peer_id))

    assert set(said.values()) == {2}, said
