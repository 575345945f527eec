"""scripts/bench/diloco.py --link / --links: the flags (one line, nothing built), each node's rate,
and one real run on shaped links (root and iproute2; skipped otherwise, with what is missing):
every node listens in its own namespace, its rounds take at least what its link allows, and no
namespace is left."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from scripts.bench import diloco as bench_diloco
from swarm.netlab import missing, parse_rate
from tests.bench_links import main_error, run_on_links, sigterm_on_links

ROOT = Path(__file__).resolve().parents[2]  # `python -m scripts.bench.diloco` runs from there
needs_links = pytest.mark.skipif(missing() is not None, reason=f"bench_diloco --link {missing()}")


def test_each_node_gets_its_rate() -> None:
    fast, slow = parse_rate("100mbit"), parse_rate("20mbit")
    assert bench_diloco.node_rates(3, None, None) is None
    assert bench_diloco.node_rates(3, fast, None) == [fast, fast, fast]
    assert bench_diloco.node_rates(2, None, (fast, slow)) == [fast, slow]
    with pytest.raises(ValueError, match="--links has 1 rate"):
        bench_diloco.node_rates(2, None, (fast,))
    assert bench_diloco.place(None, "node0", fast) == (None, bench_diloco.LOOPBACK)


def test_the_round_bound_is_the_slowest_nodes_bytes_through_its_link() -> None:
    summary = {"bytes_sent": [2_500_000, 1_000_000], "bytes_received": [1_000_000, 3_750_000], "rounds": [2, 3]}
    fast, slow = parse_rate("100mbit"), parse_rate("10mbit")
    # node 0: 1.25 MB sent per step at 12.5 MB/s = 0.1 s; node 1: 1.25 MB received per step at 1.25 MB/s = 1 s
    assert bench_diloco.round_bound_s(summary, [fast, slow]) == pytest.approx(1.0)
    assert bench_diloco.round_bound_s(summary, [slow, fast]) == pytest.approx(1.0)  # node 0 sends 1.25 MB/step
    assert bench_diloco.round_bound_s(summary, [fast, fast]) == pytest.approx(0.1)


def test_the_summary_gives_the_round_time() -> None:
    def step(k: int, round_s: float) -> dict[str, object]:
        return {
            "event": "outer_step", "outer_step": k, "eval_loss": 1.5, "state_sha256": "ab", "group_size": 2,
            "bytes_sent": 10, "bytes_received": 10, "inner_s": 8.0, "wall_s": 10.0, "tokens_per_s": 100.0,
            "round_s": round_s,
        }  # fmt: skip

    nodes = [[step(0, 1.0), step(1, 3.0), step(2, 2.0)], [step(0, 0.5), step(1, 0.5)]]
    assert bench_diloco.summarize(bench_diloco.SwarmConfig.parse("H50_int8"), nodes)["round_s"] == [2.0, 0.5]


def test_a_node_that_missed_the_last_round_and_fetched_its_result_ends_in_the_same_state() -> None:
    def step(k: int, sha: str, loss: float | None) -> dict[str, object]:
        return {
            "event": "outer_step", "outer_step": k, "eval_loss": loss, "state_sha256": sha, "group_size": 2,
            "bytes_sent": 10, "bytes_received": 10, "inner_s": 8.0, "wall_s": 10.0, "tokens_per_s": 100.0,
        }  # fmt: skip

    fetch = {"event": "fetch", "outer_step": 2, "state_sha256": "end"}
    nodes = [[step(0, "a", None), step(1, "end", 1.5)], [step(0, "a", None), fetch]]
    summary = bench_diloco.summarize(bench_diloco.SwarmConfig.parse("H50_int8"), nodes)
    assert summary["states_agree"] and summary["eval_losses"] == [1.5, 1.5] and summary["outer_steps"] == [2, 2]
    assert summary["caught_up_by_fetch"] == [False, True] and summary["rounds"] == [2, 1]
    unmeasured = [[step(0, "a", None), step(1, "end", 1.5)], [step(0, "a", None), {**fetch, "state_sha256": "x"}]]
    with pytest.raises(RuntimeError, match="no eval loss"):  # a state no node measured: no loss to report
        bench_diloco.summarize(bench_diloco.SwarmConfig.parse("H50_int8"), unmeasured)


def _main_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    return main_error(monkeypatch, capsys, bench_diloco, *args)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--link", "20mbps"), "tc reads 'mbps' as megabytes/s"),
        (("--link", "slow"), "'slow' is not a rate"),
        (("--links", "100mbit,,20mbit"), "separated by commas"),
        (("--nodes", "3", "--links", "100mbit,20mbit"), "--links has 2 rate(s) for 3 nodes"),
        (("--link", "1gbit", "--links", "1gbit,1gbit,1gbit,1gbit"), "not both"),
    ],
)
def test_bad_link_flags_give_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], says: str
) -> None:
    monkeypatch.setattr(bench_diloco, "missing", lambda: None)  # the flags are checked as on a root machine
    assert says in _main_error(monkeypatch, capsys, *args)


@pytest.mark.parametrize("flag", [("--link", "50mbit"), ("--links", "50mbit,50mbit,50mbit,50mbit")])
def test_without_root_link_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flag: tuple[str, str]
) -> None:
    lacking = "needs root to make network namespaces and shape links (run it with sudo)"
    monkeypatch.setattr(bench_diloco, "missing", lambda: lacking)
    assert _main_error(monkeypatch, capsys, *flag).endswith(f"error: {flag[0]} {lacking}")


@needs_links
@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_two_nodes_on_unequal_links_average_at_the_slow_links_rate(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "scripts.bench.diloco", "--nodes", "2", "--steps", "4", "--configs", "H2_int8",
               "--seq-len", "16", "--batch-size", "1", "--warmup-steps", "1", "--skip-baselines",
               "--links", "100mbit,20mbit", "--keep", str(tmp_path), "--json"]  # fmt: skip
    out = run_on_links(command, timeout=100)
    res = json.loads(out.strip().splitlines()[-1])
    assert res["link"] == ["100mbit", "20mbit"] and res["states_agree"] == {"H2_int8": True}
    (run,) = res["runs"]["H2_int8"]
    assert run["link"] == ["100mbit", "20mbit"] and run["full_group_share"] == 1.0
    # each node listened on its own address in its namespace, the bootstrap on the first one
    (workdir,) = tmp_path.iterdir()
    starts = [json.loads((workdir / f"node{i}.jsonl").read_text().splitlines()[0]) for i in range(2)]
    assert [s["maddrs"][0].split("/")[2] for s in starts] == ["10.77.0.2", "10.77.0.3"]
    # shaped: a round takes at least what the 20mbit node's traffic needs through its link
    slowest = max(run["bytes_sent"][1], run["bytes_received"][1]) / 2 / parse_rate("20mbit").bytes_per_s
    assert run["round_bound_s"] == pytest.approx(slowest) and res["round_bound_s"]["H2_int8"] == run["round_bound_s"]
    assert min(run["round_s"]) > 0.9 * slowest, (run["round_s"], slowest)


@needs_links
@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_sigterm_mid_run_stops_the_nodes_and_removes_the_links(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "scripts.bench.diloco", "--nodes", "2", "--steps", "400", "--configs", "H200_int8",
               "--seq-len", "16", "--batch-size", "1", "--skip-baselines", "--link", "50mbit",
               "--keep", str(tmp_path)]  # fmt: skip
    sigterm_on_links(command, children=3)  # the bootstrap and both nodes run in their namespaces
