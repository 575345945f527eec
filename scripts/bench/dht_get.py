"""DHT get of a run's records: the CPU of one get of a key with one owned subkey per node.

A training node reads the run's progress records (one subkey per node, each signed by its owner,
under one key) every publish interval with latest=True: every holder of the key answers, each
with all the records. This measures what such a read costs: process CPU per get (the asker's and
the holders' work together, as all N nodes run in this process's one event loop) and wall time,
the median of --reps rounds of 10 gets by each node.

    python -m scripts.bench.dht_get                       # 16 nodes, 16 subkeys
    python -m scripts.bench.dht_get --nodes 32 --json

No --compare: hivemind's DHT runs each node in a process of its own beside a Go daemon, so the
CPU of one event loop serving every node has no counterpart there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from swarm.dht import DHTConfig, DHTNode, owner_subkey
from swarm.p2p import P2PConfig

LOCAL = P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))
KEY = "bench-run_nodes"
GETS_PER_NODE = 10  # in each round


async def measure(nodes: int, reps: int, value_bytes: int) -> dict[str, Any]:
    config = DHTConfig(id_bits=0)  # ids without a proof of work: starting is not what is measured
    first = await DHTNode(config=config, p2p_config=LOCAL).start()
    started = [first]
    try:
        for _ in range(nodes - 1):
            started.append(await DHTNode(config=config, initial_peers=first.visible_maddrs, p2p_config=LOCAL).start())
        for node in started:
            value = {"step": 1, "pad": "x" * value_bytes}
            await node.store(KEY, value, time.time() + 600, subkey=owner_subkey(node.peer_id))
        found = 0
        cpu, wall = [], []
        for _ in range(reps + 1):  # the first round warms the connections and caches: not counted
            cpu_began, wall_began = time.process_time(), time.perf_counter()
            for node in started * GETS_PER_NODE:
                result = await node.get(KEY, latest=True)
                found = len(result.value) if result is not None else 0
            gets = nodes * GETS_PER_NODE
            cpu.append((time.process_time() - cpu_began) / gets * 1e3)
            wall.append((time.perf_counter() - wall_began) / gets * 1e3)
        return {"nodes": nodes, "subkeys_found": found, "value_bytes": value_bytes, "reps": reps,
                "cpu_ms_per_get": round(statistics.median(cpu[1:]), 3),
                "cpu_ms_per_get_range": [round(min(cpu[1:]), 3), round(max(cpu[1:]), 3)],
                "wall_ms_per_get": round(statistics.median(wall[1:]), 3)}  # fmt: skip
    finally:
        for node in started:
            await node.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16, help="DHT nodes, each with one subkey (default 16)")
    parser.add_argument("--reps", type=int, default=5, help="measured rounds (default 5)")
    parser.add_argument("--value-bytes", type=int, default=300, help="padding of each record (default 300)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args()
    if not 2 <= args.nodes <= 256 or not 1 <= args.reps <= 100 or not 0 <= args.value_bytes <= 4000:
        parser.error("need 2 <= --nodes <= 256, 1 <= --reps <= 100 and 0 <= --value-bytes <= 4000")
    result = asyncio.run(measure(args.nodes, args.reps, args.value_bytes))
    if args.json:
        print(json.dumps(result))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"get(latest=True) of one key with a subkey per node ({args.reps} rounds, median)")
    for column in ("nodes", "subkeys found", "CPU ms per get", "CPU range", "wall ms per get"):
        table.add_column(column, justify="right")
    low, high = result["cpu_ms_per_get_range"]
    table.add_row(str(result["nodes"]), str(result["subkeys_found"]), f"{result['cpu_ms_per_get']:.2f}",
                  f"{low:.2f}-{high:.2f}", f"{result['wall_ms_per_get']:.2f}")  # fmt: skip
    Console().print(table)


if __name__ == "__main__":
    main()
