"""scripts/bench/allreduce.py on shaped links with paced uploads: a bad rule is one error line
and builds nothing; one real run (root and iproute2; skipped otherwise, with what is missing)
paces every measured round, agrees, and leaves no namespace behind."""

from __future__ import annotations

import json
import sys

import pytest

from scripts.bench import allreduce as bench_allreduce
from swarm.netlab import missing
from tests.bench_links import run_on_links

needs_links = pytest.mark.skipif(missing() is not None, reason=f"bench_allreduce --link {missing()}")


@pytest.mark.parametrize("rule", ["median", "mean+fast", "robust+paced+", "+paced"])
def test_an_unknown_rule_or_extra_is_one_error_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], rule: str
) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_allreduce.py", "--aggregators", rule, "--link", "20mbit"])
    with pytest.raises(SystemExit) as exit_:  # before any lab or worker is built
        bench_allreduce.main()
    assert exit_.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("bench_allreduce.py: error: --aggregators") and repr(rule) in line


@needs_links
@pytest.mark.swarm
@pytest.mark.timeout(180)
def test_paced_rounds_on_shaped_links_pace_agree_and_leave_nothing() -> None:
    # 3 members at 20 Mbit/s, 2M elements of int8: about 1.2 s of link time a round, long enough
    # for the unmeasured first round to measure each member's upload (bandwidth.busy_rate)
    out = run_on_links([sys.executable, "-m", "scripts.bench.allreduce", "--sizes", "3", "--elements", "2M",
                        "--codecs", "int8", "--aggregators", "mean+paced", "--repeats", "2", "--link", "20mbit",
                        "--json"], timeout=170)  # fmt: skip
    (row,) = json.loads(out)["rows"]
    assert row["aggregator"] == "mean+paced" and row["paced_rounds"] == 2  # every measured round paced
    assert row["link"] == "20mbit" and row["round_s"] >= row["link_bound_s"]  # no faster than the link
    assert row["round_s"] < 3 * row["link_bound_s"]
