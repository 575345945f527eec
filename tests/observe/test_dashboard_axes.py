"""The run's page (swarm/observe/dashboard.html) in headless Chromium on a fixed snapshot: the
loss chart labels whole outer steps, evenly (it printed 0 1 2 4 5 6), the throughput axis never
says "-0 s", and 8 nodes with long relayed addresses fit a 1,400-pixel window without a
horizontal scroll. Skipped, with one line, where chromium is not installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from swarm.observe.dashboard import PAGE_MARK, page_template

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
NOW = 1_800_000_000.0
RELAYED = "/ip4/203.0.113.7/tcp/31400/p2p/12D3KooWRaEijLongRelayPeerIdentity0000000000/p2p-circuit/p2p/12D3KooWX"
# after the page has drawn (its script runs first): whether the node table's section scrolls sideways
PROBE = """<script>
const box = document.getElementById("nodes").closest("section");
document.body.dataset.scrolls = String(box.scrollWidth > box.clientWidth);
</script></body>"""


def snapshot() -> dict[str, object]:
    nodes = [{"peer_id": f"12D3KooWPeer{i:040d}", "step": 6, "progress": 0.5, "inner": 25, "H": 50,
              "train_loss": 2.1234, "eval_loss": 2.0123, "tokens_per_s": 123456.7, "group_size": 8, "client": False,
              "reach": "relayed", "last_seen_s": 1.5, "bytes_sent": 123_456_789, "bytes_received": 987_654_321,
              "maddr": RELAYED + str(i)} for i in range(8)]  # fmt: skip
    return {
        "run_id": "axes", "updated": NOW, "error": None, "step": 6, "settings": {"inner_steps": 50},
        "nodes": nodes, "curve": [[s, 3.0 - 0.1 * s] for s in range(7)],
        "throughput": [[NOW - 100.3 + 10 * i, 1000.0 + i] for i in range(11)],  # the last 0.3 s before the read
        "holders": [], "bytes": {"sent": 1, "received": 1, "nodes": 8},
    }  # fmt: skip


def x_labels(dom: str, chart: str) -> list[str]:
    svg = re.search(rf'<svg id="{chart}"[^>]*>(.*?)</svg>', dom, re.S)
    assert svg, f"no {chart} in the page"
    return re.findall(r'text-anchor="middle"[^>]*>([^<]*)<', svg.group(1))


@pytest.mark.swarm  # a browser process
@pytest.mark.timeout(120)
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium): no browser test")
def test_axes_label_whole_numbers_and_the_node_table_fits_1400_pixels(tmp_path: Path) -> None:
    assert CHROMIUM is not None
    page = page_template().replace(PAGE_MARK, json.dumps(snapshot()), 1).replace("</body>", PROBE, 1)
    (tmp_path / "run.html").write_text(page, encoding="utf-8")
    dom = subprocess.run(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-extensions", "--disable-background-networking", f"--user-data-dir={tmp_path / 'profile'}",
         "--window-size=1400,1000", "--virtual-time-budget=2000", "--dump-dom", (tmp_path / "run.html").as_uri()],
        capture_output=True, text=True, timeout=90,
    ).stdout  # fmt: skip
    assert x_labels(dom, "loss-chart") == ["0", "2", "4", "6"]
    seconds = x_labels(dom, "throughput-chart")
    assert seconds == ["-100 s", "-80 s", "-60 s", "-40 s", "-20 s"], seconds
    assert 'data-scrolls="false"' in dom
