"""Swarm-scale benchmark: matchmaking + all-reduce with n members, many to a process, on 127.0.0.1.

For each swarm size n (default 4, 16, 64) the members are spread over `--processes` worker
processes (member i in process i % P, all of a process's members in one event loop), each with
its own P2PHost, DHTNode and Averager, bootstrapped from one extra DHT node; member i holds a
seeded random vector of `--elements` fp32. Each row is one path of the same swarm:

  flat           max_group_size = n: one butterfly all-reduce over the whole group
  hierarchical   max_group_size = --cap (2 when n <= cap): the grid butterfly (rounds/grid.py)
  <path>-unaudited  the same without the owner audit (audit/flat.py, audit/grid.py): its cost

A round: the parent broadcasts a wall-clock instant; at it every member calls form_group for the
same step, expecting every member's PeerID (matchmaking ends once all have announced; the
30 s window only bounds a wait for missing ones); once all have their group, a second instant
starts run_round everywhere. Reported per row (median over `--repeats` rounds):

  matchmaking_s           median over members of Matchmade.seconds (its form_group call to return)
  round_s                 the common start of run_round until the last member has its result
  wire_bytes_per_member   median over members of GroupReport.bytes_sent (payloads and headers)
  ideal_bytes_per_member  2(n-1)/n x the int8 encoding of the whole vector (codes + fp32 scales)
  identical               every member got the whole swarm as its group, and the very same bits
                          (sha256), within the int8 bound of the exact mean; otherwise "error" says why

    python -m scripts.bench.scale [--sizes 4,16,64] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scripts.tools import worker_process
from swarm.utils import process_control

MARK = "BENCH_SCALE "
PATHS = ("flat", "hierarchical")
UNAUDITED = "-unaudited"  # a path with this suffix runs without the owner audit (to measure what it costs)
MATCHMAKING_TIME = 30.0  # the window: it only bounds the wait for members that never announce
START_MARGIN = 0.3  # seconds between broadcasting a start instant and the instant


def make_input(seed: int, index: int, elements: int) -> Any:
    import torch

    return torch.randn(elements, generator=torch.Generator().manual_seed(seed * 100_003 + index))


def parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def group_cap(n: int, path: str, cap: int) -> int:
    """max_group_size of a row: n for the flat round; the cap for the grid (2 if n would fit it)."""
    return n if path.removesuffix(UNAUDITED) == "flat" else (cap if n > cap else 2)


def int8_bound(vectors_max: float, mean_max: float, path: str) -> float:
    """Max |error| vs the exact mean (tests/averaging/test_hierarchical.py): each int8 encoding is
    off by half a block scale, V/254 for an input, M/254 for the final average; the grid encodes
    row partials once more; fp32 rounding adds a relative 1e-6."""
    stages = 2 if path.removesuffix(UNAUDITED) == "hierarchical" else 1
    return stages * vectors_max / 254 + (mean_max + stages * vectors_max / 254) / 254 + 1e-6 * vectors_max


# --- worker process: a shard of the swarm's members ---------------------------------------------


class Shard:
    """The members living in one worker process, driven by the parent's commands."""

    def __init__(self) -> None:
        self.bootstrap: Any = None  # the swarm's first DHT node (worker 0 only)
        self.members: list[tuple[int, Any, Any, Any]] = []  # (global index, host, dht, vector)
        self.averagers: list[Any] = []  # one per member, for the current run
        self.run: str | None = None
        self.groups: list[Any] = []  # what each member's last form_group found

    async def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "bootstrap":
            from swarm.dht import DHTNode
            from swarm.p2p import P2PConfig

            self.bootstrap = await DHTNode(p2p_config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
            return {"maddr": self.bootstrap.visible_maddrs[0]}
        if op == "start":
            made = await asyncio.gather(*(self._member(i, cmd) for i in cmd["indices"]))
            self.members += made
            return {"peers": [[i, host.peer_id.to_bytes().hex()] for i, host, _, _ in made]}
        if op == "form":
            return {"members": await self._form(cmd)}
        if op == "reduce":
            return {"members": await self._reduce(cmd)}
        if op == "close":
            await self.close()
            return {}
        raise ValueError(f"unknown command {op!r}")

    async def _member(self, index: int, cmd: dict[str, Any]) -> tuple[int, Any, Any, Any]:
        from swarm.dht import DHTNode
        from swarm.p2p import P2PConfig, P2PHost

        host = await P2PHost(config=P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
        dht = await DHTNode(initial_peers=cmd["initial"], host=host).start()
        return index, host, dht, make_input(cmd["seed"], index, cmd["elements"])

    def _use_run(self, run: str, max_group_size: int, audit: bool) -> None:
        from swarm.averaging import Averager, AveragingConfig

        if run == self.run:
            return
        for averager in self.averagers:
            averager.close()
        config = AveragingConfig(max_group_size=max_group_size, matchmaking_time=MATCHMAKING_TIME, codec="int8",
                                 audit=audit)  # fmt: skip
        self.averagers = [Averager(dht, host, run, config) for _, host, dht, _ in self.members]
        self.run = run

    async def _form(self, cmd: dict[str, Any]) -> list[dict[str, Any]]:
        from swarm.p2p import PeerID

        self._use_run(cmd["run"], cmd["max_group_size"], cmd["audit"])
        expected = frozenset(PeerID(bytes.fromhex(p)) for p in cmd["expected"])
        await asyncio.sleep(max(0.0, cmd["at"] - time.time()))
        found = await asyncio.gather(
            *(a.form_group(1.0, cmd["step"], expected=expected) for a in self.averagers), return_exceptions=True
        )
        self.groups = [None if isinstance(f, BaseException) else f.group for f in found]
        out = []
        for (index, *_), f in zip(self.members, found, strict=True):
            if isinstance(f, BaseException):
                out.append({"index": index, "error": f"form_group raised {f!r}"})
            else:
                size = 0 if f.group is None else len(f.group.members)
                out.append({"index": index, "seconds": f.seconds, "group_size": size, "late": f.late})
        return out

    async def _reduce(self, cmd: dict[str, Any]) -> list[dict[str, Any]]:
        for averager in self.averagers:
            averager.registry.forget_finished()  # the parent's barrier: every member is done with them
        await asyncio.sleep(max(0.0, cmd["at"] - time.time()))
        jobs = [
            self._one_round(m, a, g, cmd) for m, a, g in zip(self.members, self.averagers, self.groups, strict=True)
        ]
        return list(await asyncio.gather(*jobs))

    async def _one_round(self, member: tuple[int, Any, Any, Any], averager: Any, group: Any, cmd: dict[str, Any]
                         ) -> dict[str, Any]:  # fmt: skip
        import torch

        index, _, _, vector = member
        if group is None:
            return {"index": index, "error": "no group"}
        try:
            (result,), report = await averager.run_round(group, [vector])
        except Exception as e:
            return {"index": index, "error": f"run_round raised {e!r}"}
        seconds = time.time() - cmd["at"]
        if index == 0 and cmd.get("save"):
            await asyncio.to_thread(torch.save, result, cmd["save"])
        digest = await asyncio.to_thread(worker_process.sha256_hex, result)
        return {"index": index, "round_s": seconds, "bytes_sent": report.bytes_sent,
                "bytes_received": report.bytes_received, "sha256": digest}  # fmt: skip

    async def close(self) -> None:
        for averager in self.averagers:
            averager.close()
        self.averagers, self.run, self.groups = [], None, []
        for _, host, dht, _ in self.members:
            await dht.close()
            await host.close()
        self.members = []
        if self.bootstrap is not None:
            await self.bootstrap.close()
            self.bootstrap = None


async def worker_main() -> None:
    import torch

    torch.set_num_threads(1)  # many members share 2 cores
    loop = asyncio.get_running_loop()
    shard = Shard()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            try:
                answer = await shard.handle(json.loads(line))
            except Exception as e:
                answer = {"error": repr(e)}
            worker_process.reply(MARK, answer)
    finally:
        await shard.close()


# --- the parent: owns the workers, runs the rows ------------------------------------------------


class Workers:
    """The worker processes, each in its own session; `stop` ends every one by its PID."""

    def __init__(self) -> None:
        self.procs: list[worker_process.WorkerProcess] = []

    def spawn(self, count: int) -> None:
        for i in range(count):
            self.procs.append(worker_process.WorkerProcess("scripts.bench.scale", ["--_worker"], MARK, f"worker {i}"))

    def ask(self, cmds: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
        """One command to each worker (in order), then every answer; a worker's error raises."""
        for proc, cmd in zip(self.procs, cmds, strict=True):
            proc.send(cmd)
        answers = [proc.receive(timeout) for proc in self.procs]
        for proc, answer in zip(self.procs, answers, strict=True):
            if "error" in answer:
                raise RuntimeError(f"{proc.name}: {answer['error']}")
        return answers

    def stop(self, grace: float = 10.0) -> None:
        """Close their stdin (the signal to finish), then SIGTERM, then SIGKILL, each by PID."""
        procs = [p.proc for p in self.procs]
        for proc in procs:
            process_control.close_stdin(proc)
        process_control.wait_all(procs, grace)
        process_control.stop_all(procs, 5.0)
        self.procs = []


@contextlib.contextmanager
def workers(count: int) -> Iterator[Workers]:
    pool = Workers()
    try:
        pool.spawn(count)
        yield pool
    finally:  # also on Ctrl-C and SIGTERM (exit_on_sigterm)
        pool.stop()


def start_swarm(pool: Workers, n: int, elements: int, seed: int) -> list[str]:
    """Members 0..n-1 (member i in worker i % P), bootstrapped from a DHT node in worker 0;
    returns their PeerIDs (hex) in member order."""
    pool.procs[0].send({"op": "bootstrap"})
    answer = pool.procs[0].receive(60)
    if "error" in answer:
        raise RuntimeError(f"bootstrap: {answer['error']}")
    maddr = answer["maddr"]
    count = len(pool.procs)
    cmds = [{"op": "start", "indices": list(range(w, n, count)), "initial": [maddr], "elements": elements,
             "seed": seed} for w in range(count)]  # fmt: skip
    peers = dict(p for answer in pool.ask(cmds, 120 + n) for p in answer["peers"])
    return [peers[i] for i in range(n)]


def one_round(pool: Workers, run: str, step: int, max_group_size: int, peers: list[str], save: str) -> list[dict]:
    """Matchmaking then the all-reduce, each started at a common instant; one dict per member."""
    count = len(pool.procs)
    form = {"op": "form", "run": run, "step": step, "max_group_size": max_group_size, "expected": peers,
            "audit": not run.endswith(UNAUDITED), "at": time.time() + START_MARGIN}  # fmt: skip
    formed = {m["index"]: m for a in pool.ask([form] * count, MATCHMAKING_TIME + 60) for m in a["members"]}
    reduce = {"op": "reduce", "at": time.time() + START_MARGIN, "save": save}
    for a in pool.ask([reduce] * count, 600):
        for m in a["members"]:
            formed[m["index"]] = {**formed[m["index"]], **m}
    return [formed[i] for i in range(len(peers))]


def summarize(n: int, path: str, rounds: list[list[dict]], exact: Any, vmax: float, errors: list[float]) -> dict:
    """One row from the rounds' per-member answers (and member 0's error vs the exact mean)."""
    from swarm.averaging import AveragingConfig
    from swarm_kernels import get_codec

    problems = []
    for r, members in enumerate(rounds):
        bad = [m for m in members if "error" in m]
        if bad:
            problems.append(f"round {r}: {len(bad)} members failed, e.g. member {bad[0]['index']}: {bad[0]['error']}")
        if any(m.get("group_size") != n for m in members):
            problems.append(f"round {r}: group sizes {sorted({m.get('group_size') for m in members})}, not {n}")
        if len({m.get("sha256") for m in members}) != 1:
            problems.append(f"round {r}: {len({m.get('sha256') for m in members})} different results")
    bound = int8_bound(vmax, exact.abs().max().item(), path)
    worst = max(errors, default=None)
    if worst is None or worst > bound:
        problems.append(f"max abs error {worst} vs the exact mean, not within the int8 bound {bound:.3g}")
    ok = [m for members in rounds for m in members if "error" not in m]
    encoded = get_codec("int8", block_size=AveragingConfig().block_size).encoded_nbytes(exact.numel())

    nan = float("nan")

    def median_of(key: str) -> float:
        return statistics.median(m[key] for m in ok) if ok else nan

    matchmaking = [statistics.median([m["seconds"] for m in ms if "seconds" in m] or [nan]) for ms in rounds]
    round_s = [max(m.get("round_s", nan) for m in ms) for ms in rounds]
    row = {"n": n, "path": path, "matchmaking_s": statistics.median(matchmaking),
           "round_s": statistics.median(round_s), "wire_bytes_per_member": median_of("bytes_sent"),
           "ideal_bytes_per_member": 2 * (n - 1) / n * encoded, "identical": not problems,
           "bytes_received_per_member": median_of("bytes_received"),
           "matchmaking_s_max": max(max(m.get("seconds", 0.0) for m in ms) for ms in rounds),
           "matchmaking_s_all": matchmaking, "round_s_all": round_s, "max_abs_err": worst,
           "err_bound": bound}  # fmt: skip
    if problems:
        row["error"] = "; ".join(problems)
    return row


def measure(n: int, paths: list[str], cap: int, pool: Workers, elements: int, repeats: int, seed: int,
            first_step: int) -> list[dict[str, Any]]:  # fmt: skip
    """The rows of swarm size n: a fresh swarm, `repeats` rounds per path."""
    import torch

    exact = torch.zeros(elements, dtype=torch.float64)
    vmax = 0.0
    for i in range(n):
        v = make_input(seed, i, elements)
        exact += v
        vmax = max(vmax, v.abs().max().item())
    exact /= n
    peers = start_swarm(pool, n, elements, seed)
    rows, step = [], first_step
    for path in paths:
        rounds, errors = [], []
        with tempfile.TemporaryDirectory() as tmp:
            save = str(Path(tmp) / "member0.pt")
            for _ in range(repeats):
                step += 1
                members = one_round(pool, f"bench-{n}-{path}", step, group_cap(n, path, cap), peers, save)
                rounds.append(members)
                if "sha256" in members[0]:
                    errors.append((torch.load(save).double() - exact).abs().max().item())
        rows.append(summarize(n, path, rounds, exact, vmax, errors) | {"max_group_size": group_cap(n, path, cap)})
    pool.ask([{"op": "close"}] * len(pool.procs), 120)  # on failure the pool kills the workers instead
    return rows


def run_bench(sizes: list[int], *, paths: tuple[str, ...] | list[str] = PATHS, cap: int = 4, elements: int = 1 << 20,
              repeats: int = 3, processes: int = 4, seed: int = 0) -> list[dict[str, Any]]:  # fmt: skip
    """Every row of the benchmark (the importable core; the CLI prints what it returns)."""
    if any(n < 2 for n in sizes) or cap < 2 or repeats < 1 or processes < 1:
        raise ValueError("sizes >= 2, cap >= 2, repeats >= 1, processes >= 1")
    rows: list[dict[str, Any]] = []
    with workers(processes) as pool:
        for k, n in enumerate(sizes):
            rows += measure(n, list(paths), cap, pool, elements, repeats, seed, first_step=k * 1000)
    return rows


def print_table(rows: list[dict[str, Any]], elements: int, processes: int) -> None:
    from rich.console import Console
    from rich.table import Table

    title = f"Matchmaking + int8 all-reduce of {elements / 2**20:g}M fp32, {processes} processes on 127.0.0.1"
    table = Table(title=title)
    for column in ("n", "path", "cap", "matchmaking s", "round s", "wire MB / member", "ideal MB", "vs ideal",
                   "max abs err", "identical"):  # fmt: skip
        table.add_column(column, justify="right")
    for row in rows:
        wire, ideal = row["wire_bytes_per_member"], row["ideal_bytes_per_member"]
        error = row["max_abs_err"]
        table.add_row(str(row["n"]), row["path"], str(row["max_group_size"]), f"{row['matchmaking_s']:.3f}",
                      f"{row['round_s']:.3f}", f"{wire / 1e6:.3f}", f"{ideal / 1e6:.3f}", f"{wire / ideal:.4f}",
                      "-" if error is None else f"{error:.4f}",
                      "yes" if row["identical"] else "[red]NO[/red]")  # fmt: skip
    Console(width=max(Console().width, 132)).print(table)
    for row in rows:
        if "error" in row:
            print(f"n={row['n']} {row['path']}: {row['error']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4,16,64", help="swarm sizes n")
    parser.add_argument("--elements", default="1M", help="fp32 elements per member (K/M suffixes)")
    parser.add_argument("--cap", type=int, default=4, help="max_group_size of the hierarchical path")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--repeats", type=int, default=3, help="rounds per row (medians)")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._worker:
        from swarm.utils.eventloop import run

        run(worker_main())
        return
    process_control.exit_on_sigterm()
    paths = args.paths.split(",")
    if any(p.removesuffix(UNAUDITED) not in PATHS for p in paths):
        parser.error(f"paths are {PATHS}, each also with the suffix {UNAUDITED} (no owner audit)")
    elements = parse_count(args.elements)
    sizes = [int(x) for x in args.sizes.split(",")]
    if any(n < 2 for n in sizes) or args.cap < 2 or args.repeats < 1 or args.processes < 1 or elements < 1:
        parser.error("sizes >= 2, --cap >= 2, --repeats >= 1, --processes >= 1, --elements >= 1")
    rows = run_bench(sizes, paths=paths, cap=args.cap, elements=elements, repeats=args.repeats,
                     processes=args.processes, seed=args.seed)  # fmt: skip
    if args.json:
        print(json.dumps({"elements": elements, "processes": args.processes, "rows": rows}))
    else:
        print_table(rows, elements, args.processes)
    if not all(row["identical"] for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
