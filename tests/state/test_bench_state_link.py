"""scripts/bench/state.py --link: the flags (one line, nothing built), the link bound, and one real
run on shaped links (root and iproute2; skipped otherwise, with what is missing) that leaves no
namespace behind."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from scripts.bench import state as bench_state
from swarm.netlab import missing, parse_rate
from tests.bench_links import main_error, run_on_links, sigterm_on_links

ROOT = Path(__file__).resolve().parents[2]  # `python -m scripts.bench.state` runs from there
needs_links = pytest.mark.skipif(missing() is not None, reason=f"bench_state --link {missing()}")


def test_the_bound_is_the_newcomers_downlink_or_the_donors_uplinks_together() -> None:
    mbit100, gbit = parse_rate("100mbit"), parse_rate("1gbit")
    assert bench_state.link_bound_MBps(1, mbit100, gbit) == pytest.approx(12.5)  # one donor's uplink
    assert bench_state.link_bound_MBps(4, mbit100, gbit) == pytest.approx(50.0)  # four uplinks together
    assert bench_state.link_bound_MBps(4, mbit100, parse_rate("200mbit")) == pytest.approx(25.0)  # the downlink
    assert bench_state.link_bound_MBps(2, mbit100, mbit100) == pytest.approx(12.5)


def test_the_summary_gives_each_fetch_beside_its_bound(tmp_path: Path) -> None:
    opts = bench_state.Options("tiny", [1, 4], 1, 1 << 20, 2, 60.0, tmp_path, False,
                               link=parse_rate("100mbit"), newcomer_link=parse_rate("1gbit"))  # fmt: skip
    run = {"bytes": 100 * bench_state.MB, "peak_rss_MB": 300.0, "baseline_rss_MB": 250.0,
           **dict.fromkeys(("peak_rss_download_MB", "peak_rss_load_MB"), 280.0),
           **dict.fromkeys(("download_s", "hash_s", "write_s", "load_s", "cpu_s"), 1.0)}  # fmt: skip
    runs = {1: [{**run, "seconds": 10.0}], 4: [{**run, "seconds": 2.5}]}
    rates = {"sha256_MBps": 1.0, "write_MBps": 1.0}
    out = bench_state.summarize(opts, 100 * bench_state.MB, [1000.0], rates, runs, None)
    assert (out["link"], out["newcomer_link"]) == ("100mbit", "1gbit")
    assert out["link_bound_MBps_1"] == pytest.approx(12.5) and out["link_bound_MBps_4"] == pytest.approx(50.0)
    assert out["targets"]["fetch_1_of_link_bound"] == pytest.approx(0.8)
    assert out["targets"]["fetch_4_of_link_bound"] == pytest.approx(0.8)
    assert out["targets"]["fetch_4_over_1"] == pytest.approx(4.0)
    bench_state.print_table(out)  # the link columns render


def test_without_links_every_process_listens_on_loopback(tmp_path: Path) -> None:
    opts = bench_state.Options("tiny", [1], 1, 1 << 20, 2, 60.0, tmp_path, False)
    places = bench_state.Places(None, opts)
    assert places.bootstrap() == places.donor(0) == places.newcomer() == ([], bench_state.LOOPBACK)


def _main_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    return main_error(monkeypatch, capsys, bench_state, *args)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--link", "100mbps"), "tc reads 'mbps' as megabytes/s"),
        (("--link", "fast"), "'fast' is not a rate"),
        (("--link", "100mbit", "--newcomer-link", "1x"), "'1x' is not a rate"),
        (("--newcomer-link", "1gbit"), "--newcomer-link needs --link"),
        (("--link", "100mbit", "--compare", "hivemind"), "--compare hivemind runs on 127.0.0.1 only"),
    ],
)
def test_bad_link_flags_give_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], says: str
) -> None:
    monkeypatch.setattr(bench_state, "missing", lambda: None)  # the flags are checked as on a root machine
    assert says in _main_error(monkeypatch, capsys, *args)


def test_without_root_link_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lacking = "needs root to make network namespaces and shape links (run it with sudo)"
    monkeypatch.setattr(bench_state, "missing", lambda: lacking)
    assert _main_error(monkeypatch, capsys, "--link", "100mbit").endswith(f"error: --link {lacking}")


@needs_links
@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_tiny_fetch_on_shaped_links_runs_at_their_rate_and_leaves_nothing(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "scripts.bench.state",
        "--model",
        "tiny",
        "--peers",
        "1,2",
        "--repeat",
        "1",
        "--link",
        "50mbit",
        "--newcomer-link",
        "100mbit",
        "--json",
        "--dest",
        str(tmp_path),
        "--shard-bytes",
        str(1 << 20),
    ]  # fmt: skip  (tiny's 10.5 MB in 11 shards: two donors can share them)
    out = run_on_links(command, timeout=100)
    summary = json.loads(out.strip().splitlines()[-1])
    assert (summary["link"], summary["newcomer_link"]) == ("50mbit", "100mbit")
    # 1 donor: its 50mbit uplink (6.25 MB/s); 2 donors: the newcomer's 100mbit downlink (12.5 MB/s)
    assert summary["link_bound_MBps_1"] == pytest.approx(6.25) and summary["link_bound_MBps_2"] == pytest.approx(12.5)
    for n in (1, 2):  # shaped: never above the bound (10 ms of burst aside), and not far below it
        assert 0.6 < summary["targets"][f"fetch_{n}_of_link_bound"] < 1.05, summary["targets"]
    assert summary["targets"]["fetch_2_over_1"] > 1.4, summary["targets"]  # the second donor's uplink helps
    for n in ("1", "2"):
        (run,) = summary["detail"]["runs"][n]
        assert run["fetched_bytes"] == run["bytes"] and not run["corrupt_peers"] and not run["failed_peers"]
    assert list(tmp_path.iterdir()) == []  # fetched files and logs are deleted


@needs_links
@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_sigterm_mid_run_stops_the_donors_and_removes_the_links(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "scripts.bench.state", "--model", "tiny", "--peers", "1,2", "--repeat", "1",
               "--link", "50mbit", "--dest", str(tmp_path)]  # fmt: skip
    sigterm_on_links(command, children=2)  # the bootstrap and the first donor, in their namespaces
    assert list(tmp_path.iterdir()) == []  # the run's folder is deleted
