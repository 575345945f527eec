"""Watching a live swarm (swarm/observe/): the Prometheus endpoint of a node's --metrics-port,
scraped and parsed while 3 in-process nodes train, and the run's dashboard loaded in headless
Chromium (skipped, with one line, where chromium is not installed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from swarm.observe.dashboard import Dashboard, DhtReader
from swarm.observe.http import HttpConfig, HttpServer
from swarm.observe.metrics import METRICS
from swarm.observe.serve import MetricsServer
from tests.node.inprocess import LocalSwarm, Running
from tests.observe.test_metrics import exposed_names, samples

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
BROWSER_TIMEOUT = 90.0  # one headless load on a busy 2-core machine (seconds)


async def get(url: str, timeout: float = 10.0) -> bytes:
    def fetch() -> bytes:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.read()

    return await asyncio.wait_for(asyncio.to_thread(fetch), timeout + 5)


async def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


def completed(nodes: list[Running], step: int) -> bool:
    """Every node is past `step`: a node that fell behind and fetched skips step numbers, so its
    last step counts, not each one (CI once timed out here waiting for every node's step 2)."""
    return all(max(n.steps(), default=-1) >= step for n in nodes)


async def test_the_metrics_endpoint_moves_while_three_nodes_train(local: LocalSwarm) -> None:
    bootstrap = await local.start_bootstrap()
    servers = [MetricsServer("inproc", HttpConfig(), initial_peers=(bootstrap,)) for _ in range(3)]
    async with contextlib.AsyncExitStack() as stack:
        for server in servers:
            await stack.enter_async_context(server)
        # more steps than the test watches: it stops them at the end
        nodes = [local.start((bootstrap,), on_event=s.observe, max_outer_steps=40) for s in servers]
        await wait_for(lambda: completed(nodes, 0), 120, "outer step 0 on every node")
        firsts = [(await get(s.url + "metrics")).decode() for s in servers]
        await wait_for(lambda: completed(nodes, 2), 120, "outer step 2 on every node")
        await asyncio.sleep(1.0)  # a network event (every publish_interval, 0.5 s) after the step
        seconds = [(await get(s.url + "metrics")).decode() for s in servers]
        assert all(exposed_names(text) == set(METRICS) for text in firsts + seconds)
        before, after = [samples(t) for t in firsts], [samples(t) for t in seconds]
        for first, second in zip(before, after, strict=True):  # every node, whatever its groups were
            for name in ("swarm_outer_steps_total", "swarm_inner_steps_total", "swarm_tokens_total",
                         "swarm_matchmaking_seconds_count", "swarm_sent_bytes_total{kind=other}",
                         "swarm_received_bytes_total{kind=other}"):  # fmt: skip
                assert second[name] > first[name], (name, first[name], second[name])
            assert second["swarm_outer_step"] >= 3 and second["swarm_group_size"] >= 1
            assert 0 < second["swarm_utilization_ratio"] <= 1 and second["swarm_eval_loss"] > 0
            assert second["swarm_peers_known"] >= 2 and second["swarm_connections"] >= 2
            assert second["swarm_dht_records"] > 0 and second["swarm_resident_memory_bytes"] > 1e7
        # the rounds: a node may step alone now and then (a known gap of one swarm, one state), not all of them
        for name in ("swarm_round_seconds_count", "swarm_sent_bytes_total{kind=allreduce}",
                     "swarm_received_bytes_total{kind=allreduce}"):  # fmt: skip
            assert sum(s[name] for s in after) > sum(s[name] for s in before), name
        assert max(s["swarm_group_size"] for s in after) >= 2
        info = [k for k in after[0] if k.startswith("swarm_node_info{")]
        assert len(info) == 1 and str(nodes[0].node.peer_id) in info[0]
        # the same port serves the run's dashboard, read from the DHT through this node
        snapshot: dict = {}

        async def dashboard_sees_three() -> bool:
            snapshot.update(json.loads(await get(servers[1].url + "api/run")))
            return len(snapshot["nodes"]) == 3

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while not await dashboard_sees_three():
            assert loop.time() < deadline, f"the node's dashboard did not see 3 nodes: {snapshot}"
            await asyncio.sleep(0.5)
        page = (await get(servers[1].url)).decode()
        assert '<svg id="loss-chart"' in page and "inproc" in page
        for n in nodes:
            n.stop.set()
        assert await local.finish(60) == ["stopped"] * 3


def dom_figures(dom: str) -> tuple[int, int, int | None]:
    """(node rows, loss-curve points, outer step) of the dashboard as the browser rendered it."""
    rows = len(re.findall(r'<tr class="node"', dom))
    points = re.search(r'<svg id="loss-chart" data-points="(\d+)"', dom)
    step = re.search(r'<b id="run-step">(\d+)</b>', dom)
    return rows, int(points.group(1)) if points else 0, int(step.group(1)) if step else None


async def chromium(tmp_path: Path, *args: str) -> str:
    """Run headless Chromium (its own profile under tmp_path); its stdout."""
    assert CHROMIUM is not None
    profile = tmp_path / "chromium-profile"
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
        "--disable-extensions", "--disable-background-networking", f"--user-data-dir={profile}",
        "--virtual-time-budget=4000", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), BROWSER_TIMEOUT)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail(f"chromium did not finish within {BROWSER_TIMEOUT:g}s: {args}")
    return out.decode(errors="replace")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium): no browser test")
async def test_the_dashboard_renders_and_updates_in_a_browser(local: LocalSwarm, tmp_path: Path) -> None:
    bootstrap = await local.start_bootstrap()
    reader = DhtReader("inproc", lambda: (bootstrap,))
    dashboard = Dashboard("inproc", reader, interval=0.5, timeout=10.0)
    try:
        async with HttpServer(dashboard.routes()) as server:
            # more steps than the test waits for: it stops them once it has seen the page update
            nodes = [local.start((bootstrap,), max_outer_steps=40) for _ in range(3)]
            dashboard.start()
            view = dashboard.view
            await wait_for(lambda: len(view.nodes) == 3 and len(view.curve) >= 2, 150,
                           "3 nodes and 2 eval losses on the dashboard")  # fmt: skip
            first = dom_figures(await chromium(tmp_path, "--dump-dom", server.url + "?live"))
            assert first[:2] >= (3, 2) and first[0] == 3, first
            assert first[2] is not None
            await wait_for(lambda: max(n["step"] for n in view.nodes) > first[2], 120, "a later outer step")
            second = dom_figures(await chromium(tmp_path, "--dump-dom", server.url + "?live"))
            assert second[0] == 3 and second[1] >= first[1] and second[2] > first[2], (first, second)
            shot = tmp_path / "dashboard.png"
            await chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,1400", server.url)
            assert shot.stat().st_size > 10_000
            print(f"dashboard screenshot: {shot}")
            for n in nodes:
                n.stop.set()
    finally:
        await dashboard.close()
        await reader.close()
