"""NodeMetrics (swarm/observe/metrics.py): events fold into Prometheus metrics of their own
registry, with the names METRICS and the docs' "Watching a run" page document."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from swarm.observe.metrics import METRICS, NodeMetrics

WATCHING = Path(__file__).resolve().parents[2] / "docs" / "guides" / "watching.md"  # the metrics' table


def scrape(metrics: NodeMetrics) -> dict[str, float]:
    """sample name{labels} -> value, as a Prometheus server would parse the scrape."""
    return samples(generate_latest(metrics.registry).decode())


def samples(text: str) -> dict[str, float]:
    """sample name{labels} -> value of a Prometheus text exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def exposed_names(text: str) -> set[str]:
    """Family names as METRICS and the docs write them: counters with _total, infos with _info."""
    suffix = {"counter": "_total", "info": "_info"}
    return {f.name + suffix.get(f.type, "") for f in text_string_to_metric_families(text)}


def test_names_follow_the_conventions_and_match_the_list() -> None:
    metrics = NodeMetrics()
    assert exposed_names(generate_latest(metrics.registry).decode()) == set(METRICS)
    for name, (kind, _) in METRICS.items():
        assert name.startswith("swarm_")
        assert name.endswith("_total") == (kind == "counter"), name


def test_the_docs_list_every_metric() -> None:
    text = WATCHING.read_text()
    section = text.split("## The metrics", 1)[1].split("\n## ", 1)[0]
    listed = dict(re.findall(r"^\| `(swarm_[a-z_]+)` \| (\w+) \|", section, re.M))
    assert listed == {name: kind for name, (kind, _) in METRICS.items()}


def test_events_move_the_metrics() -> None:
    m = NodeMetrics(CollectorRegistry())
    m({"event": "start", "peer_id": "12D3KooWx", "run_id": "demo", "model": "tiny", "device": "cpu",
       "client_mode": False, "outer_step": 0, "maddrs": []})  # fmt: skip
    m({"event": "progress", "outer_step": 0, "inner_step": 3, "inner_steps": 8, "train_loss": 5.0})
    m({"event": "progress", "outer_step": 0, "inner_step": 6, "inner_steps": 8, "train_loss": 4.5})
    first = scrape(m)
    assert first["swarm_inner_steps_total"] == 6 and first["swarm_inner_step"] == 6
    assert first["swarm_node_info{client_mode=false,device=cpu,model=tiny,peer_id=12D3KooWx,run_id=demo}"] == 1
    m({"event": "outer_step", "outer_step": 0, "train_loss": 4.4, "eval_loss": 4.2, "group_size": 3,
       "group_id": "ab", "bytes_sent": 1000, "bytes_received": 900, "matchmaking_s": 0.3, "round_s": 0.7,
       "clipped": 1, "inner_s": 3.0, "wall_s": 4.0, "tokens": 512, "tokens_per_s": 128.0, "rss_bytes": 10**8,
       "inner_done": 8})  # fmt: skip
    m({"event": "network", "peers_known": 4, "connections": 3, "dht_records": 12, "wire_bytes_sent": 5000,
       "wire_bytes_received": 6000, "state_bytes_served": 2000, "rss_bytes": 2 * 10**8, "settled": True})  # fmt: skip
    m({"event": "fetch", "outer_step": 2, "bytes": 4000, "seconds": 2.0, "corrupt_peers": ["x"], "peers": 2})
    m({"event": "network", "wire_bytes_sent": 5100, "wire_bytes_received": 10_500, "settled": True})
    m({"event": "mystery", "whatever": [1]})  # unknown events and malformed fields are ignored
    m({"event": "progress", "outer_step": "two", "inner_step": None, "train_loss": float("nan")})
    s = scrape(m)
    assert s["swarm_outer_step"] == 2 and s["swarm_outer_steps_total"] == 1
    assert s["swarm_inner_steps_total"] == 8 and s["swarm_tokens_total"] == 512
    assert (s["swarm_eval_loss"], s["swarm_group_size"], s["swarm_utilization_ratio"]) == (4.2, 3, 0.75)
    assert s["swarm_round_seconds_count"] == 1 and s["swarm_matchmaking_seconds_sum"] == pytest.approx(0.3)
    assert s["swarm_sent_bytes_total{kind=allreduce}"] == 1000
    assert s["swarm_sent_bytes_total{kind=state}"] == 2000
    assert s["swarm_received_bytes_total{kind=state}"] == 4000
    # what the wire carried beyond the all-reduce, the state served and the state fetched
    assert s["swarm_sent_bytes_total{kind=other}"] == 5100 - 1000 - 2000
    assert s["swarm_received_bytes_total{kind=other}"] == 10_500 - 900 - 4000
    assert (s["swarm_peers_known"], s["swarm_connections"], s["swarm_dht_records"]) == (4, 3, 12)
    assert s["swarm_state_fetches_total"] == 1 and s["swarm_state_fetch_bytes_per_second"] == 2000
    assert s["swarm_state_rejected_peers_total"] == 1 and s["swarm_contributions_clipped_total"] == 1
    assert s["swarm_resident_memory_bytes"] == 2 * 10**8


def wire(sent: int, received: int, *, settled: bool = False) -> dict[str, object]:
    return {"event": "network", "wire_bytes_sent": sent, "wire_bytes_received": received, "settled": settled}


def test_other_bytes_count_consistent_wire_totals_only() -> None:
    """`other` = wire - all-reduce - state, from totals taken when no round was under way: right
    after an outer step (settled) or while training (a later progress event of the step shows it)."""
    m = NodeMetrics()
    other = lambda: scrape(m)["swarm_sent_bytes_total{kind=other}"]  # noqa: E731
    m({"event": "progress", "outer_step": 0, "inner_step": 2, "inner_steps": 8})
    m(wire(100, 100))  # taken while training: counted once the next progress event of the step shows it
    assert other() == 0
    m({"event": "progress", "outer_step": 0, "inner_step": 5, "inner_steps": 8})
    assert other() == 100
    m(wire(5_150, 5_150))  # taken while the round sends its 10 000 bytes, before it reports them: dropped
    m({"event": "outer_step", "outer_step": 0, "bytes_sent": 10_000, "bytes_received": 10_000, "inner_done": 8})
    assert other() == 100
    m(wire(10_200, 10_300, settled=True))  # right after the outer step: consistent
    assert other() == 200 and scrape(m)["swarm_received_bytes_total{kind=other}"] == 300
    m({"event": "progress", "outer_step": 1, "inner_step": 1, "inner_steps": 8})
    m(wire(10_400, 10_400))
    m({"event": "progress", "outer_step": 1, "inner_step": 1, "inner_steps": 8})  # no step since: not yet
    assert other() == 200
    m({"event": "progress", "outer_step": 1, "inner_step": 3, "inner_steps": 8})
    assert other() == 400


def test_warnings_and_errors_are_counted_by_layer() -> None:
    m = NodeMetrics()
    logger = logging.getLogger("swarm")
    handler = m.count_logs(logger)
    try:
        logging.getLogger("swarm.averaging.rounds.flat").warning("a round failed")
        logging.getLogger("swarm.node.loop").error("refusing the average")
        logging.getLogger("swarm.dht.node").info("not counted")
    finally:
        logger.removeHandler(handler)
    s = scrape(m)
    assert s["swarm_errors_total{kind=averaging,level=warning}"] == 1
    assert s["swarm_errors_total{kind=node,level=error}"] == 1
    assert s["swarm_errors_total{kind=dht,level=warning}"] == 0
