"""DHT benchmark: N real nodes on 127.0.0.1 spread over a few worker processes.

Workload (the same for swarm and, with --compare hivemind, for hivemind.DHT):
1. start N nodes (default 64) over P worker processes (default 4), one after another; each
   node joins through one random node started before it;
2. every node stores one key (64 random bytes, expiring in 10 minutes): store latency;
3. every node gets --gets-per-node random keys stored by others: get latency and success;
4. resident memory per node: the PSS (proportional set size: shared pages split among the
   processes that share them) of every process that makes up the nodes, summed, divided by N;
5. churn: 25% of the nodes, chosen at random, are killed at once (swarm: SIGKILL of whole worker
   processes, none of their nodes says goodbye; hivemind: SIGKILL of each DHT process and its
   p2pd), then the survivors immediately get random keys of all N nodes, the dead ones' too.
Workers run their nodes' operations one at a time, so P operations are in flight at once.

swarm's nodes run with S/Kademlia's defences: ids with a proof of work, solved before
the timed start (--id-bits; get and store latency do not depend on it: a proof is checked in
microseconds whatever its difficulty), and lookups over --disjoint-paths disjoint paths (a
comma-separated list runs swarm once per value: "1,3" shows what the extra paths cost). The
identity-making time (median of 5 proofs at DHTConfig's default difficulty, one core, hashlib)
and the time to check one proof are measured in the same run.

--simulate runs the real DHTNode code over an in-memory network (swarm.dht.simulation) at
N = 100, 1,000 and 10,000 and prints lookup rounds (hops) and success rates.
--json prints one JSON object instead of tables.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.tools import worker_process
from scripts.tools.worker_process import WorkerProcess
from swarm.utils.process_control import exit_on_sigterm
from swarm.utils.process_memory import pss_bytes

MARK = "BENCH_DHT "
VALUE_TTL = 600.0


def expected_value(key: str) -> bytes:
    """Every worker can check a get without being told the value."""
    return hashlib.sha256(key.encode()).digest() * 2


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def pss_mb(pids: list[int]) -> float:
    """Summed PSS of live processes in MiB (no psutil needed)."""
    return pss_bytes(pids) / 2**20


# --- worker processes ------------------------------------------------------------------------


class SwarmDHTBackend:
    """`count` swarm DHTNodes in this process (the same interface as hivemind_dht.HivemindDHTBackend)."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []
        self.prepared: list[tuple[Any, Path]] = []  # identities whose id proofs are solved
        self.config: Any = None
        self.proof_dir = Path(tempfile.mkdtemp(prefix="bench-dht-"))

    def prepare(self, count: int, id_bits: int, disjoint_paths: int) -> None:
        """Make identities and solve their id proofs (untimed: identity making is measured alone)."""
        from swarm.dht import DHTConfig
        from swarm.dht.id_proof import load_or_solve
        from swarm.p2p import Identity

        self.config = DHTConfig(id_bits=id_bits, disjoint_paths=disjoint_paths)
        for _ in range(count):
            identity = Identity.generate()
            path = self.proof_dir / f"{identity.peer_id}.dht-id"
            load_or_solve(path, identity.peer_id, id_bits)
            self.prepared.append((identity, path))

    async def start(self, count: int, initial_peers: list[str], rng: random.Random) -> list[str]:
        from swarm.dht import DHTNode
        from swarm.p2p import P2PConfig

        config = P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))
        maddrs: list[str] = []
        for identity, proof in self.prepared[:count]:
            pool = initial_peers + maddrs
            initial = [rng.choice(pool)] if pool else []
            node = DHTNode(identity, initial, config=self.config, p2p_config=config, id_proof_path=proof)
            self.nodes.append(await node.start())
            maddrs.append(node.visible_maddrs[0])
        return maddrs

    async def store(self, index: int, key: str, value: bytes, expiration_time: float) -> bool:
        return await self.nodes[index].store(key, value, expiration_time) > 0

    async def get(self, index: int, key: str) -> bytes | None:
        found = await self.nodes[index].get(key)
        return None if found is None else found.value

    def kill(self, indices: list[int]) -> None:
        raise NotImplementedError("the orchestrator SIGKILLs whole swarm workers instead")

    def memory_pids(self) -> list[int]:
        return [os.getpid()]

    async def close(self) -> None:
        await asyncio.gather(*(node.close() for node in self.nodes), return_exceptions=True)
        shutil.rmtree(self.proof_dir, ignore_errors=True)


def make_backend(system: str) -> Any:
    if system == "swarm":
        return SwarmDHTBackend()
    from scripts.compare.dht import HivemindDHTBackend

    return HivemindDHTBackend()


def reply(obj: dict[str, Any]) -> None:
    worker_process.reply(MARK, obj)


def start_worker(system: str, index: int) -> WorkerProcess:
    return WorkerProcess("scripts.bench.dht", ["--_worker", system], MARK, f"{system} worker {index}")


async def worker_main(system: str) -> None:
    backend = make_backend(system)
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "prepare":
                if system == "swarm":
                    await asyncio.to_thread(backend.prepare, cmd["count"], cmd["id_bits"], cmd["disjoint_paths"])
                reply({})
            elif op == "start":
                rng = random.Random(cmd["seed"])
                started = time.perf_counter()
                maddrs = await backend.start(cmd["count"], cmd["initial_peers"], rng)
                reply({"maddrs": maddrs, "seconds": time.perf_counter() - started})
            elif op in ("store", "get"):
                latencies, ok = [], 0
                expiration = time.time() + VALUE_TTL
                started = time.perf_counter()
                for index, key in cmd["ops"]:
                    t0 = time.perf_counter()
                    try:
                        if op == "store":
                            success = await backend.store(index, key, expected_value(key), expiration)
                        else:
                            success = await backend.get(index, key) == expected_value(key)
                    except Exception as e:  # a failed operation counts as a failure, not a crash
                        print(f"{op} {key} from node {index} failed: {e!r}", file=sys.stderr)
                        success = False
                    latencies.append((time.perf_counter() - t0) * 1e3)
                    ok += bool(success)
                reply({"latencies_ms": latencies, "ok": ok, "seconds": time.perf_counter() - started})
            elif op == "kill":
                backend.kill(cmd["indices"])
                reply({})
            elif op == "pids":
                reply({"pids": backend.memory_pids()})
            else:
                raise ValueError(f"unknown op {op}")
    finally:
        await backend.close()


def run_all(workers: list[WorkerProcess], cmds: dict[int, dict[str, Any]], timeout: float) -> dict[int, dict[str, Any]]:
    for index, cmd in cmds.items():
        workers[index].send(cmd)
    return {index: workers[index].receive(timeout) for index in cmds}


def measure(
    system: str, n: int, processes: int, gets_per_node: int, churn: float, seed: int, dht: dict[str, int]
) -> dict[str, Any]:
    rng = random.Random(seed)
    workers = [start_worker(system, i) for i in range(processes)]
    try:
        counts = [n // processes + (i < n % processes) for i in range(processes)]
        run_all(workers, {w: {"op": "prepare", "count": c, **dht} for w, c in enumerate(counts)}, 60 + 30 * n)
        owners: list[tuple[int, int]] = []  # global node index -> (worker, local index)
        maddrs: list[str] = []
        started = time.perf_counter()
        for w, count in enumerate(counts):  # one after another: each joins the DHT built so far
            workers[w].send({"op": "start", "count": count, "initial_peers": maddrs, "seed": seed + w})
            maddrs += workers[w].receive(timeout=60 + 10 * count)["maddrs"]
            owners += [(w, i) for i in range(count)]
        start_s = time.perf_counter() - started
        keys = [f"bench/{seed}/{i}" for i in range(n)]

        def phase(op: str, plan: list[tuple[int, str]]) -> tuple[list[float], int, float]:
            per_worker: dict[int, list[tuple[int, str]]] = {}
            for node, key in plan:
                w, local = owners[node]
                per_worker.setdefault(w, []).append((local, key))
            t0 = time.perf_counter()
            replies = run_all(workers, {w: {"op": op, "ops": ops} for w, ops in per_worker.items()}, 600)
            wall = time.perf_counter() - t0
            latencies = [x for r in replies.values() for x in r["latencies_ms"]]
            return latencies, sum(r["ok"] for r in replies.values()), len(plan) / wall

        store_lat, stored, _ = phase("store", list(enumerate(keys)))
        others = [[j for j in range(n) if j != node] for node in range(n)]
        get_plan = [(node, keys[rng.choice(others[node])]) for node in range(n) for _ in range(gets_per_node)]
        get_lat, got, get_ops = phase("get", get_plan)
        replies = run_all(workers, {w: {"op": "pids"} for w in range(processes)}, 60)
        pids = [pid for r in replies.values() for pid in r["pids"]]
        memory = pss_mb(pids) / n

        # churn: a quarter of the nodes die at once
        if system == "swarm":  # whole worker processes, SIGKILLed
            dead_workers = rng.sample(range(processes), max(1, round(processes * churn)))
            for w in dead_workers:
                workers[w].kill()
            dead = {node for node, (w, _) in enumerate(owners) if w in dead_workers}
        else:
            dead = set(rng.sample(range(n), round(n * churn)))
            by_worker: dict[int, list[int]] = {}
            for node in dead:
                by_worker.setdefault(owners[node][0], []).append(owners[node][1])
            run_all(workers, {w: {"op": "kill", "indices": idx} for w, idx in by_worker.items()}, 60)
        survivors = [node for node in range(n) if node not in dead]
        churn_plan = [(node, keys[rng.randrange(n)]) for node in survivors for _ in range(gets_per_node)]
        churn_lat, churn_got, _ = phase("get", churn_plan)
        return {
            "n": n,
            "processes": processes,
            "start_s_per_node": start_s / n,
            "store_p50_ms": percentile(store_lat, 50),
            "store_p99_ms": percentile(store_lat, 99),
            "store_success": stored / n,
            "get_p50_ms": percentile(get_lat, 50),
            "get_p99_ms": percentile(get_lat, 99),
            "get_success": got / len(get_plan),
            "get_ops_per_s": get_ops,
            "rss_MB_per_node": memory,
            "churn_get_success": churn_got / len(churn_plan),
            "churn_get_p50_ms": percentile(churn_lat, 50),
        }
    finally:
        for worker in workers:
            worker.close()


def single_node_mb(dht: dict[str, int]) -> float:
    """PSS of a process that runs one swarm DHT node: what a lone `swarm-dht serve` costs."""
    worker = start_worker("swarm", 0)
    try:
        worker.send({"op": "prepare", "count": 1, **dht})
        worker.receive(600)
        worker.send({"op": "start", "count": 1, "initial_peers": [], "seed": 0})
        worker.receive(60)
        worker.send({"op": "pids"})
        return pss_mb(worker.receive(60)["pids"])
    finally:
        worker.close()


def identity_making(runs: int = 5) -> dict[str, float]:
    """Seconds to solve one id proof at DHTConfig's default difficulty (median of `runs` fresh
    identities, one core) and microseconds to check one."""
    from swarm.dht.config import DEFAULT_ID_BITS
    from swarm.dht.id_proof import solve, verify
    from swarm.p2p import Identity

    times, tries = [], 0
    for _ in range(runs):
        peer = Identity.generate().peer_id
        t0 = time.perf_counter()
        nonce = solve(peer, DEFAULT_ID_BITS)
        times.append(time.perf_counter() - t0)
        tries += int.from_bytes(nonce, "big") + 1  # solve() tries nonces 0, 1, 2, ...
    t0 = time.perf_counter()
    for _ in range(10_000):
        verify(peer, nonce, DEFAULT_ID_BITS)
    verify_us = (time.perf_counter() - t0) / 10_000 * 1e6
    rate = tries / sum(times)
    return {
        "id_bits": DEFAULT_ID_BITS,
        "id_making_s_median": statistics.median(times),
        "id_making_s_max": max(times),
        "id_tries_per_s": rate,
        "id_making_s_expected": 2**DEFAULT_ID_BITS / rate,
        "id_verify_us": verify_us,
    }


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def simulate(sizes: list[int], gets: int) -> list[dict[str, Any]]:
    from swarm.dht.simulation import simulate as run_simulation
    from swarm.utils.eventloop import run

    reports = [run(run_simulation(n, gets=gets)) for n in sizes]
    return [{name: getattr(r, name) for name in r.__slots__} for r in reports]


ROWS = [
    ("get p50 / p99, ms", "get_p50_ms", "get_p99_ms"),
    ("store p50 / p99, ms", "store_p50_ms", "store_p99_ms"),
    ("get success", "get_success", None),
    ("gets per second", "get_ops_per_s", None),
    ("memory per node, MB (PSS)", "rss_MB_per_node", None),
    ("get success after 25% churn", "churn_get_success", None),
    ("start + bootstrap per node, s", "start_s_per_node", None),
]


def fmt(value: float) -> str:
    if value <= 1.0 and value != 0 and value == value and value > 0.5:
        return f"{value:.1%}"
    return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"


def print_tables(
    results: dict[str, dict[str, Any]], sim: list[dict[str, Any]], single_mb: float | None, ids: dict[str, float] | None
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if results:
        first = next(iter(results.values()))
        table = Table(title=f"DHT, N={first['n']} nodes on 127.0.0.1 over {first['processes']} processes (medians)")
        table.add_column("")
        for system in results:
            table.add_column(system, justify="right")
        if "hivemind" in results:
            table.add_column("swarm / hivemind", justify="right")
        for label, a, b in ROWS:
            cells = [fmt(r[a]) + (f" / {fmt(r[b])}" if b else "") for r in results.values()]
            if "hivemind" in results:
                ours, theirs = results["swarm"][a], results["hivemind"][a]
                cells.append(f"{ours / theirs:.3f}" if theirs else "-")
            table.add_row(label, *cells)
        console.print(table)
        if single_mb is not None:
            console.print(f"one swarm DHT node alone in a process: {single_mb:.1f} MB (PSS)")
    if ids:
        console.print(
            f"DHT id proof of {ids['id_bits']} bits: made in {ids['id_making_s_median']:.2f} s (median of 5, "
            f"max {ids['id_making_s_max']:.2f} s, one core; expected {ids['id_making_s_expected']:.2f} s at "
            f"{ids['id_tries_per_s'] / 1e6:.2f} M tries/s), checked in {ids['id_verify_us']:.1f} us"
        )
    if sim:
        table = Table(title="Simulated DHT (the real node code over an in-memory network)")
        for column in (
            "N",
            "join s",
            "rounds mean",
            "rounds p99",
            "get success",
            "after 25% churn",
            "msgs/get",
            "wall s",
        ):
            table.add_column(column, justify="right")
        for r in sim:
            table.add_row(
                f"{r['n']:,}", f"{r['join_s']:.1f}", f"{r['get_rounds_mean']:.2f}", f"{r['get_rounds_p99']:.0f}",
                f"{r['get_success']:.1%}", f"{r['churn_get_success']:.1%}", f"{r['messages_per_get']:.1f}",
                f"{r['wall_s']:.1f}",
            )  # fmt: skip
        console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", "-n", type=int, default=64)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--gets-per-node", type=int, default=8)
    parser.add_argument("--churn", type=float, default=0.25)
    parser.add_argument("--repeat", type=int, default=1, help="runs per system; medians are reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", choices=["hivemind"], help="also run the workload on hivemind.DHT")
    parser.add_argument("--simulate", action="store_true", help="run the in-memory simulation instead")
    parser.add_argument("--sim-sizes", default="100,1000,10000")
    parser.add_argument("--sim-gets", type=int, default=1000)
    parser.add_argument("--disjoint-paths", default="3", help="lookup paths of swarm's nodes; a list runs each")
    parser.add_argument(
        "--id-bits", type=int, default=None, help="difficulty of the nodes' id proofs (default: DHTConfig's)"
    )
    parser.add_argument("--no-id-making", action="store_true", help="skip the identity-making measurement")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--_worker", choices=["swarm", "hivemind"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._worker:
        from swarm.utils.eventloop import run

        run(worker_main(args._worker))
        return
    exit_on_sigterm()
    if not 0 < args.churn < 1 or args.nodes < args.processes or args.processes < 1:
        parser.error("need 0 < --churn < 1 and 1 <= --processes <= --nodes")

    from swarm.dht.config import DEFAULT_ID_BITS

    results: dict[str, dict[str, Any]] = {}
    sim: list[dict[str, Any]] = []
    single_mb = None
    ids = None
    paths = [int(x) for x in args.disjoint_paths.split(",")]
    dht = {"id_bits": DEFAULT_ID_BITS if args.id_bits is None else args.id_bits, "disjoint_paths": paths[-1]}
    if args.simulate:
        sim = simulate([int(x) for x in args.sim_sizes.split(",")], args.sim_gets)
    else:
        # the last --disjoint-paths value is "swarm"; the others are labelled with their path count
        systems = [(f"swarm, {p} path{'s' * (p != 1)}", "swarm", p) for p in paths[:-1]]
        systems += [("swarm", "swarm", paths[-1])] + ([(args.compare, args.compare, 0)] if args.compare else [])
        for label, system, p in systems:
            config = {**dht, "disjoint_paths": p or paths[-1]}
            runs = [
                measure(system, args.nodes, args.processes, args.gets_per_node, args.churn, args.seed + r, config)
                for r in range(args.repeat)
            ]
            results[label] = median_of(runs)
        single_mb = single_node_mb(dht)
    if not args.no_id_making:
        ids = identity_making()
    if args.json:
        out: dict[str, Any] = {}
        if results:
            out.update(results["swarm"])
            out["rss_MB_single_node_process"] = single_mb
            out["disjoint_paths"], out["node_id_bits"] = dht["disjoint_paths"], dht["id_bits"]
            for label, result in results.items():
                if label.startswith("swarm, "):  # "swarm, 1 path" -> paths1_get_p50_ms, ...
                    prefix = f"paths{label.split()[1]}"
                    out.update({f"{prefix}_{k}": v for k, v in result.items() if k not in ("n", "processes")})
            if "hivemind" in results:
                out.update({f"hivemind_{k}": v for k, v in results["hivemind"].items() if k not in ("n", "processes")})
        if ids:
            out.update(ids)
        if sim:
            out["simulation"] = sim
        print(json.dumps(out))
    else:
        print_tables(results, sim, single_mb, ids)


if __name__ == "__main__":
    main()
