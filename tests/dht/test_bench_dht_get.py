"""scripts/bench/dht_get.py measures what it says: every node's record comes back in each get."""

from __future__ import annotations

import pytest

from scripts.bench.dht_get import measure


@pytest.mark.timeout(60)
async def test_the_get_bench_reads_every_nodes_record_and_times_it() -> None:
    result = await measure(nodes=4, reps=1, value_bytes=10)
    assert result["subkeys_found"] == 4
    assert result["cpu_ms_per_get"] > 0 and result["wall_ms_per_get"] > 0
