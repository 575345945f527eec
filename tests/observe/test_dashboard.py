"""Dashboard (swarm/observe/dashboard.py) with the DHT read handed in: what the routes answer, a
read that fails or hangs, the lazy start, and peers' strings that must not escape into the page."""

from __future__ import annotations

import asyncio
import json

import pytest

from swarm.dht.records import owner_subkey
from swarm.observe.dashboard import Dashboard, Entries
from swarm.p2p.identity import Identity

pytestmark = pytest.mark.timeout(30)
PEER = Identity.from_seed(b"\x07" * 32).peer_id
HOSTILE = "</script><script>alert(1)</script>"
RECORD = {"maddrs": [], "client": False, "step": 2, "inner": 1, "H": 4, "sec_per_step": 0.5, "time": 1000.0,
          "settings": {"model": HOSTILE}, "evals": [[0, 5.0], [1, 4.0]]}  # fmt: skip


async def records() -> tuple[Entries, Entries, Entries]:
    return [(owner_subkey(PEER), RECORD)], [], []


async def test_the_routes_serve_the_last_read_and_the_page_embeds_it_safely() -> None:
    dashboard = Dashboard("demo", records)
    await dashboard.poll_once()
    routes = dashboard.routes()
    snapshot = json.loads(routes["/api/run"]("").body)
    assert snapshot["nodes"][0]["step"] == 2 and snapshot["curve"] == [[0, 5.0], [1, 4.0]]
    page = routes["/"]("").body.decode()
    assert HOSTILE not in page and "\\u003c/script>" in page  # the peer's string stays inside the JSON
    assert page.count("</script>") == 1
    live = routes["/"]("live").body.decode()
    assert "const INITIAL = /*INITIAL*/null;" in live
    await dashboard.close()


async def test_a_read_that_fails_or_hangs_keeps_the_view_and_says_why() -> None:
    calls = 0

    async def flaky() -> tuple[Entries, Entries, Entries]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise TimeoutError("no answer")
        if calls == 3:
            await asyncio.sleep(3600)
        return await records()

    dashboard = Dashboard("demo", flaky, timeout=0.2)
    await dashboard.poll_once()
    await dashboard.poll_once()
    snapshot = json.loads(dashboard.routes()["/api/run"]("").body)
    assert "no answer" in snapshot["error"] and len(snapshot["nodes"]) == 1
    await asyncio.wait_for(dashboard.poll_once(), 5)  # bounded by the dashboard's timeout
    assert dashboard.view.error is not None and dashboard.view.error.startswith("could not read the DHT")
    await dashboard.poll_once()
    assert dashboard.view.error is None
    await dashboard.close()


async def test_a_lazy_dashboard_reads_nothing_until_asked() -> None:
    reads = 0

    async def counted() -> tuple[Entries, Entries, Entries]:
        nonlocal reads
        reads += 1
        return await records()

    dashboard = Dashboard("demo", counted, interval=0.05, lazy=True)
    await asyncio.sleep(0.2)
    assert reads == 0
    dashboard.routes()["/api/run"]("")
    await asyncio.sleep(0.3)
    assert reads >= 2
    await dashboard.close()
    after = reads
    dashboard.routes()["/"]("")  # closed: asking again starts nothing
    await asyncio.sleep(0.2)
    assert reads == after


async def test_the_swarms_way_through_its_data_from_the_chunk_claims() -> None:
    """`data`: the run's chunk claims, read off the event loop as a node's claim reader reads them."""
    import time

    import numpy as np

    from swarm.data.chunks import CHUNK_TOKENS
    from swarm.data.claims import ClaimRecord, encode_claim
    from swarm.dht.config import DHTConfig
    from swarm.dht.id_proof import solve

    n, now, bits = 8, time.time(), 4
    peers = [Identity.from_seed(bytes([i]) * 32).peer_id for i in (1, 2, 3)]

    def claim(i: int, done: list[int], tokens: int, proof_bits: int = bits) -> tuple[object, object]:
        marks = np.zeros(n, dtype=bool)
        marks[done] = True
        rec = ClaimRecord(peers[i], 0, ((7 - i, now - 1),), now + 30, {0: marks}, tokens)
        return owner_subkey(peers[i]), encode_claim(rec, n, solve(peers[i], proof_bits))

    chunks: Entries = []

    async def read() -> tuple[Entries, Entries, Entries]:
        return [(owner_subkey(PEER), RECORD)], [], chunks

    dashboard = Dashboard("demo", read, dht_config=DHTConfig(id_bits=bits))
    await dashboard.poll_once()
    assert json.loads(dashboard.routes()["/api/run"]("").body)["data"] is None  # the built-in corpus: no section
    chunks += [claim(0, [0, 1], 300), claim(1, [2], 1 << 40), claim(2, [3, 4, 5], 100, proof_bits=0)]
    await dashboard.poll_once()
    # the third record has no proof of a costly id: it counts for nothing; the second's tokens are
    # capped at a whole chunk for each chunk it trained or holds
    assert json.loads(dashboard.routes()["/api/run"]("").body)["data"] == {
        "epoch": 0, "chunks_done": 3, "chunks": n, "share": 0.375, "tokens": 300 + 2 * CHUNK_TOKENS, "nodes": 2,
        "claiming": 2}  # fmt: skip
    chunks.clear()  # the claims gone from the DHT: the section goes
    await dashboard.poll_once()
    assert json.loads(dashboard.routes()["/api/run"]("").body)["data"] is None
    await dashboard.close()
