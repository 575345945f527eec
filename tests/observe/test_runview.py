"""RunView (swarm/observe/runview.py): a run's records folded into what the dashboard draws;
peers' records are untrusted and every list is bounded."""

from __future__ import annotations

import json

from swarm.dht.records import owner_subkey
from swarm.observe import runview
from swarm.observe.runview import RunView
from swarm.p2p.identity import Identity

PEERS = [Identity.from_seed(bytes([i]) * 32).peer_id for i in range(1, 5)]
SETTINGS = {"model": "tiny", "inner_steps": 4, "lr": 0.001}


def record(step: int, **fields: object) -> dict[str, object]:
    return {"maddrs": ["/ip4/127.0.0.1/tcp/1"], "client": False, "step": step, "inner": 2, "H": 4,
            "sec_per_step": 0.5, "time": 1000.0, "train_loss": 4.0, "eval_loss": 4.1, "tokens_per_s": 100.0,
            "group_size": 3, "settings": SETTINGS, "bytes_sent": 10, "bytes_received": 20, **fields}  # fmt: skip


def test_nodes_curve_throughput_holders_and_bytes() -> None:
    view = RunView("demo")
    nodes = [
        (owner_subkey(PEERS[0]), record(3, evals=[[0, 5.0], [1, 4.5], [2, 4.2]])),
        (owner_subkey(PEERS[1]), record(3, evals=[[1, 4.7], [2, 4.2]], client=True, tokens_per_s=50.0)),
        (owner_subkey(PEERS[2]), record(2, eval_loss=float("nan"), tokens_per_s="fast", group_size=-1)),
        (owner_subkey(PEERS[3]), {"step": "bad"}),  # malformed: skipped
        ("not-owned", record(9)),
    ]
    holders = [(owner_subkey(PEERS[0]), {"step": 3, "manifest": "ab" * 32, "maddrs": ["/ip4/127.0.0.1/tcp/1"],
                                         "bytes": 1234}), (owner_subkey(PEERS[1]), {"step": "x"})]  # fmt: skip
    view.update(nodes, holders, now=1002.0)
    snap = view.snapshot()
    json.dumps(snap, allow_nan=False)  # what the page gets is strict JSON
    assert [n["step"] for n in snap["nodes"]] == [3, 3, 2] and snap["step"] == 3
    third = snap["nodes"][2]
    assert (third["eval_loss"], third["tokens_per_s"], third["group_size"]) == (None, None, 0)
    assert snap["nodes"][0]["last_seen_s"] == 2.0 and snap["nodes"][0]["progress"] == 0.5
    assert sum(n["client"] for n in snap["nodes"]) == 1
    assert snap["curve"] == [[0, 5.0], [1, 4.6], [2, 4.2]]  # the median over the nodes that report a step
    assert snap["throughput"] == [[1002.0, 150.0]]
    assert snap["holders"] == [{"peer_id": str(PEERS[0]), "step": 3, "manifest": "ab" * 6, "bytes": 1234}]
    assert snap["settings"] == SETTINGS
    assert snap["bytes"] == {"sent": 30, "received": 60, "nodes": 3}
    # a node leaves: its bytes moved still count; the curve keeps the steps its records no longer carry
    view.update(nodes[1:2], [], now=1004.0)
    snap = view.snapshot()
    assert snap["bytes"]["sent"] == 30 and len(snap["nodes"]) == 1
    assert snap["curve"][0] == [0, 5.0] and len(snap["throughput"]) == 2


def test_a_failed_read_keeps_the_view_and_says_why() -> None:
    view = RunView("demo")
    view.update([(owner_subkey(PEERS[0]), record(1))], [], now=1000.0)
    view.failed("could not read the DHT: timeout")
    snap = view.snapshot()
    assert snap["error"].endswith("timeout") and len(snap["nodes"]) == 1 and snap["updated"] == 1000.0


def test_what_the_view_remembers_is_bounded(monkeypatch) -> None:
    monkeypatch.setattr(runview, "MAX_CURVE_POINTS", 10)
    monkeypatch.setattr(runview, "MAX_PEERS_REMEMBERED", 2)
    view = RunView("demo")
    for i in range(3):
        evals = [[s, 3.0] for s in range(i * 20, i * 20 + 20)]
        view.update([(owner_subkey(PEERS[i]), record(i, evals=evals))], [], now=1000.0 + i)
    assert [s for s, _ in view.snapshot()["curve"]] == list(range(50, 60))
    assert len(view.moved) == 2
