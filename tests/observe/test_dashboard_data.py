"""The run's page (swarm/observe/dashboard.html) in headless Chromium: the swarm's way through its
prepared data (epoch, share trained, chunks, tokens, nodes claiming) is drawn from the snapshot's
`data`, and the section stays hidden on the built-in corpus (no `data`). Skipped, with one line,
where chromium is not installed."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from swarm.observe.dashboard import PAGE_MARK, page_template
from tests.observe.test_dashboard_axes import CHROMIUM, snapshot

DATA = {"epoch": 2, "chunks_done": 3, "chunks": 8, "share": 0.375, "tokens": 12_582_912, "nodes": 4, "claiming": 3}


def rendered(tmp_path: Path, snap: dict[str, object]) -> str:
    assert CHROMIUM is not None
    page = tmp_path / "run.html"
    page.write_text(page_template().replace(PAGE_MARK, json.dumps(snap), 1), encoding="utf-8")
    return subprocess.run(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-extensions", "--disable-background-networking", f"--user-data-dir={tmp_path / 'profile'}",
         "--virtual-time-budget=2000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=90,
    ).stdout  # fmt: skip


def card(dom: str, name: str) -> str:
    found = re.search(rf'<b id="{name}">([^<]*)</b>', dom)
    assert found, f"no {name} in the page"
    return found.group(1)


@pytest.mark.swarm  # a browser process
@pytest.mark.timeout(180)
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium): no browser test")
def test_the_data_section_shows_the_epochs_progress_and_hides_without_data(tmp_path: Path) -> None:
    dom = rendered(tmp_path, {**snapshot(), "data": DATA})
    section = re.search(r'<section class="wide" id="data"([^>]*)>', dom)
    assert section and "hidden" not in section.group(1)
    assert card(dom, "d-epoch") == "2" and card(dom, "d-share") == "37.5%" and card(dom, "d-chunks") == "3 / 8"
    assert card(dom, "d-tokens") == "12.6M" and card(dom, "d-claiming") == "3 of 4"
    assert re.search(r'<i id="d-bar" style="width: 38%;?">', dom), "the bar is not drawn to the share"
    dom = rendered(tmp_path, {**snapshot(), "data": None})
    section = re.search(r'<section class="wide" id="data"([^>]*)>', dom)
    assert section and "hidden" in section.group(1)
