"""State-exchange benchmark: how fast a newcomer fetches and verifies the swarm state
from 1, 2, 4 local peers, how much memory that takes, and how close it comes to the loopback limit.

    python -m scripts.bench.state --model small --peers 1,2           # quick (25.8M params, 206 MB)
    python -m scripts.bench.state --model 150m --repeat 3 --compare hivemind --json

Workload. A `swarm-dht serve` bootstrap node, then up to max(--peers) donors started one after the
other (scripts/tools/state_seeder.py: the `--model` preset's deterministic state, θ_outer + outer
momentum in fp32, in shards of --shard-bytes, served by the real StateServer). For each n in
--peers (ascending; the n first donors), --repeat newcomers, each a fresh child process that starts
a P2PHost and a client-mode DHTNode bootstrapped from the bootstrap node, waits until
holders.find_holders lists its n donors, and calls fetcher.fetch_state (streams_per_peer 2, the
default) into a fresh directory under --dest, deleted after the run.

Timed: fetch_state alone: the manifest, every shard streamed into memory and hashed, its
verification, and the load into tensors (zero-copy views of the received shards); with
--to-disk each verified shard is also kept on disk by a writer thread (what lets an interrupted
fetch resume; a node does it when it has a --checkpoint-dir). The DHT lookup before it is not
timed (hivemind's load_state_from_peers includes one DHT get; tens of ms). Checked outside the
timed span: the loaded state (step, θ_outer, momentum) hashes to the donors' `state_sha256`. Memory: the newcomer's peak
resident set (VmHWM of its whole process at the end: Python, torch, its DHT node and the fetch),
its resident set just before the fetch, and the peak of each phase (download + verify, load),
sampled every 10 ms. MB = 1e6 bytes; MB/s = state bytes / fetch seconds; figures are medians.

In the same run: the raw loopback limit (plain sockets between two processes on 127.0.0.1: a TCP
transfer of the state's byte count, sendall from a 64 MiB buffer, recv_into a 4 MiB one; one at
the start and one just before each newcomer, so that the median sees the machine's load of the
fetches: these machines are shared and noisy), and, to show where a fetch's time goes, this
machine's SHA-256 and file-write rates in --dest (4 MiB blocks, as the fetcher writes); in each
newcomer, the seconds its fetcher threads spent hashing and writing chunks. Targets:
fetch >= 50% of the loopback limit; the newcomer's peak RSS <= 1.5x the state.

`--link RATE` (as root) puts the bootstrap, each donor and the newcomer in a network namespace
of its own behind a link shaped to RATE both ways (swarm.netlab, as `swarm-sim --link`), instead
of 127.0.0.1; `--newcomer-link RATE` gives the newcomer a link of its own rate (a
newcomer on 1gbit fetching from donors on 100mbit). Each newcomer in turn runs in the same
namespace (one at a time); the bootstrap gets the faster of the two rates. The table then gives
the link bound beside each fetch: the newcomer's downlink, or the donors' uplinks together when
they are the smaller, min(newcomer rate, n x donor rate) / 8 bytes per second. The bound counts
the link's raw rate: a bulk TCP transfer's payload is ~95% of it (Ethernet, IP and TCP headers).
With --link the raw loopback limit is still measured (on 127.0.0.1, as a check of the machine),
but the targets are against the bound. Donors share a fetch by whole shards: to see n donors'
uplinks add up, give each several (`--shard-bytes`; the default 64 MiB cuts `small` into 4).

    sudo python -m scripts.bench.state --model small --peers 1,2,4 --link 100mbit --newcomer-link 1gbit \
        --shard-bytes 8388608 --compare hivemind runs on 127.0.0.1 only: with --link it
is refused with one line.

--compare hivemind: hivemind 1.1.12's DecentralizedAverager.load_state_from_peers of the same
tensors from one donor averager (it never downloads from more than one; see
scripts/compare/state.py), timed and checked the same way.

Memory: a 150m donor holds about 2.4x the state (its tensors, its serialized snapshot, torch) and
peaks near 3x while it builds them; hivemind's donor and newcomer ~2.5x each. The run refuses to
start a process that would not fit in MemAvailable. Cost (150m, --repeat 1, hivemind included):
about 4 minutes and 12 GB at the peak (4 donors).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from scripts.bench.p2p import sink_one_transfer
from scripts.tools.worker_process import ROOT, module_command
from swarm.netlab import Lab, Rate, exec_prefix, missing, parse_rate
from swarm.utils import process_control
from swarm.utils.process_control import console_script
from swarm.utils.process_memory import status_kib

MARK = "BENCH_STATE "
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
RUN_ID = "bench"
SEED = 0
STEP = 5
INNER_STEPS = 100  # state_seeder's default: part of the manifest's run info
MB = 1e6
MiB = 1 << 20
SEND_BLOCK = 64 * MiB
RECV_BLOCK = 4 * MiB
ENV = {k: v for k, v in os.environ.items() if k != "SWARM_INITIAL_PEERS"} | {"OMP_NUM_THREADS": "1"}
# memory estimates (bytes per state byte, measured on small and 150m): refuse to start what won't fit
DONOR_PEAK_PER_STATE_BYTE = 3.2
NEWCOMER_PEAK_PER_STATE_BYTE = 1.3
PROCESS_FIXED_BYTES = 600 * MiB
TARGET_OF_LOOPBACK = 0.5
TARGET_RSS_OF_STATE = 1.5
STOP_GRACE_S = 15.0  # between SIGTERM and SIGKILL when stopping a child


# --- the newcomer: a child process that fetches once ---------------------------------------------


class RssSampler:
    """Samples this process's VmRSS every `period` seconds in a thread; keeps the peak per phase."""

    def __init__(self, period: float = 0.01) -> None:
        self.period = period
        self.phase = "download"
        self.peaks: dict[str, int] = {}  # phase -> KiB
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            rss = status_kib("VmRSS")
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)
            if self._stop.wait(self.period):
                return


def run_info(model: str) -> Any:
    """The RunInfo state_seeder.py writes into its manifest for these arguments."""
    from swarm.model.checkpoint import RunInfo
    from swarm.model.presets import preset

    config = dataclasses.asdict(preset(model))
    return RunInfo(run_id=RUN_ID, model=model, model_config=config, seed=SEED, data="stdlib", inner_steps=INNER_STEPS)


def param_names(model: str) -> list[str]:
    """The model's tensor names in its order (the order state_sha256 hashes them in)."""
    from swarm.model.llama import build_model
    from swarm.model.presets import preset

    return [name for name, _ in build_model(preset(model), SEED, device="meta").named_parameters()]


async def _wait_for_holders(dht: Any, wanted: set[str], timeout: float) -> list[Any]:
    from swarm.state.holders import find_holders

    deadline = time.monotonic() + timeout
    while True:
        holders = [h for h in await find_holders(dht, RUN_ID) if str(h.peer_id) in wanted]
        if len(holders) == len(wanted):
            return holders
        if time.monotonic() > deadline:
            raise TimeoutError(f"the DHT lists {len(holders)} of the {len(wanted)} donors after {timeout:.0f}s")
        await asyncio.sleep(0.2)


class ChunkTimer:
    """Times the fetcher's per-shard work in its worker threads (the SHA-256 of each received
    shard; with --to-disk, keeping it on disk) by wrapping fetcher._sha256 and fetcher._keep.
    Seconds are summed over threads, so with several streams they can exceed the wall time."""

    def __init__(self) -> None:
        self.hash_s = self.write_s = 0.0
        self.chunks = self.nbytes = 0  # shards hashed, and their bytes
        self._lock = threading.Lock()

    def install(self) -> None:
        from swarm.state import shard_fetch as fetcher

        for name in ("_sha256", "_keep"):
            if not callable(getattr(fetcher, name, None)):
                raise RuntimeError(f"swarm.state.shard_fetch.{name} is gone: update bench_state.ChunkTimer")
        sha256, keep = fetcher._sha256, fetcher._keep

        def timed_sha256(data: bytearray) -> str:
            t0 = time.perf_counter()
            digest = sha256(data)
            with self._lock:
                self.hash_s += time.perf_counter() - t0
                self.chunks += 1
                self.nbytes += len(data)
            return digest

        def timed_keep(path: Path, data: bytearray) -> None:
            t0 = time.perf_counter()
            keep(path, data)
            with self._lock:
                self.write_s += time.perf_counter() - t0

        fetcher._sha256 = timed_sha256  # type: ignore[assignment]
        fetcher._keep = timed_keep  # type: ignore[assignment]


async def newcomer_main(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from swarm.dht.node import DHTNode
    from swarm.model.state_hash import state_sha256
    from swarm.p2p import P2PConfig, P2PHost
    from swarm.state.config import FetchConfig
    from swarm.state.fetcher import FetchProgress, fetch_state, remove_fetch_dir

    torch.set_num_threads(1)
    expect = run_info(args.model)
    names = param_names(args.model)
    marks: dict[str, float] = {}
    timer = ChunkTimer()
    timer.install()
    async with P2PHost(config=P2PConfig(host_maddrs=(args.listen,))) as host:
        dht = await DHTNode(host=host, initial_peers=[args.bootstrap], client_mode=True).start()
        try:
            holders = await _wait_for_holders(dht, set(args.holders.split(",")), args.timeout)
            with RssSampler() as sampler:

                def on_progress(p: FetchProgress) -> None:
                    if p.done_bytes and "first" not in marks:
                        marks["first"] = time.perf_counter()
                    if p.shards_done == p.shards_total and "shards" not in marks:
                        marks["shards"] = time.perf_counter()
                        sampler.phase = "load"  # fetch_state now reads the shards back into tensors

                baseline_kib = status_kib("VmRSS")
                cpu_before = resource.getrusage(resource.RUSAGE_SELF)
                started = time.perf_counter()
                manifest, state, report = await fetch_state(
                    host, RUN_ID, holders, expect=expect, dest=Path(args.fetch_dest) if args.fetch_dest else None,
                    config=FetchConfig(streams_per_peer=args.streams_per_peer, timeout=args.timeout),
                    on_progress=on_progress,
                )  # fmt: skip
                finished = time.perf_counter()
                cpu_after = resource.getrusage(resource.RUSAGE_SELF)
        finally:
            await dht.close()
    peak_kib = status_kib("VmHWM")
    in_model_order = {"outer_step": state["outer_step"], **{key: {n: state[key][n] for n in names}
                                                             for key in ("params", "momentum")}}  # fmt: skip
    got_sha = await asyncio.to_thread(state_sha256, in_model_order)  # not timed
    if args.fetch_dest:
        await asyncio.to_thread(remove_fetch_dir, Path(args.fetch_dest), manifest)
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    return {
        "seconds": finished - started,
        "bytes": manifest.total_bytes,
        "fetched_bytes": report.fetched_bytes,
        "shards": len(manifest.shards),
        "bytes_by_peer": report.bytes_by_peer,
        "first_chunk_s": marks.get("first", finished) - started,  # the manifest, then the first 4 MiB
        "download_s": marks.get("shards", finished) - started,  # every shard on disk and verified
        "load_s": finished - marks.get("shards", finished),  # state_from_shards
        "cpu_s": cpu,
        "hash_s": timer.hash_s,  # summed over the fetcher's threads
        "write_s": timer.write_s,
        "chunks": timer.chunks,
        "chunk_bytes_mean": timer.nbytes / max(1, timer.chunks),
        "state_sha256": got_sha,
        "step": manifest.step,
        "baseline_rss_MB": baseline_kib * 1024 / MB,
        "peak_rss_MB": peak_kib * 1024 / MB,
        "peak_rss_download_MB": sampler.peaks.get("download", 0) * 1024 / MB,
        "peak_rss_load_MB": sampler.peaks.get("load", 0) * 1024 / MB,
        "corrupt_peers": report.corrupt_peers,
        "failed_peers": report.failed_peers,
    }


def reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


# --- the raw loopback limit ------------------------------------------------------------------------


def sink_main(transfers: int) -> None:
    """Child process: accept `transfers` connections and sink one transfer on each."""
    listener = socket.create_server(("127.0.0.1", 0))
    reply({"port": listener.getsockname()[1]})
    view = memoryview(bytearray(RECV_BLOCK))
    for _ in range(transfers):
        conn, _ = listener.accept()
        with conn:
            sink_one_transfer(conn, view)


class LoopbackProbe:
    """The raw loopback limit: plain-socket transfers of `nbytes` to a sink child process, one per
    measure() call, spread over the run so that they see the same machine load as the fetches."""

    def __init__(self, children: Children, nbytes: int, transfers: int) -> None:
        self.children, self.nbytes = children, nbytes
        self.proc = children.start("sink", module_command("scripts.bench.state", "--_sink", str(transfers)))
        self.port = children.first_line(self.proc, "sink", 60, prefix=MARK)["port"]
        self.block = memoryview(bytes(range(256)) * (SEND_BLOCK // 256))  # real pages, not the shared zero page
        self.rates: list[float] = []

    def measure(self) -> float:
        with socket.create_connection(("127.0.0.1", self.port)) as sock:
            started = time.perf_counter()
            sock.sendall(self.nbytes.to_bytes(8, "big"))
            left = self.nbytes
            while left:
                piece = self.block[: min(left, len(self.block))]
                sock.sendall(piece)
                left -= len(piece)
            got = int.from_bytes(sock.recv(8, socket.MSG_WAITALL), "big")
            rate = self.nbytes / (time.perf_counter() - started) / MB
        if got != self.nbytes:
            raise RuntimeError(f"loopback sink received {got} of {self.nbytes} bytes")
        self.rates.append(rate)
        return rate


def machine_rates(dest: Path, nbytes: int = 256 * MiB) -> dict[str, float]:
    """SHA-256 and file-write throughput (MB/s) in 4 MiB blocks: what the fetcher does per chunk."""
    block = bytes(range(256)) * (RECV_BLOCK // 256)
    count = nbytes // len(block)
    started = time.perf_counter()
    digest = hashlib.sha256()
    for _ in range(count):
        digest.update(block)
    sha = nbytes / (time.perf_counter() - started) / MB
    path = dest / f"bench_state_write_{os.getpid()}.tmp"
    try:
        started = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(count):
                f.write(block)
        write = nbytes / (time.perf_counter() - started) / MB
    finally:
        path.unlink(missing_ok=True)
    return {"sha256_MBps": sha, "write_MBps": write}


# --- processes -------------------------------------------------------------------------------------


class Children:
    """The processes of one run, each in its own session with its stderr in `<workdir>/<name>.err`;
    close() stops all that are left, each by its pid (SIGTERM, then SIGKILL)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []

    def start(self, name: str, command: list[str], prefix: list[str] | None = None) -> subprocess.Popen[bytes]:
        """`prefix`: an argv prefix the child runs under (`ip netns exec NS`: a shaped link); `ip`
        execs the command, so the child's PID is the command's and close() reaches it."""
        err = open(self.workdir / f"{name}.err", "wb")  # noqa: SIM115 (closed in close())
        self._logs.append(err)
        # cwd: `python -m scripts.bench.state` children import the scripts package from there
        proc = process_control.start([*(prefix or []), *command], stdout=subprocess.PIPE, stderr=err, env=ENV, cwd=ROOT,
                                     die_with_parent=True)  # fmt: skip
        self.procs.append(proc)
        return proc

    def first_line(self, proc: subprocess.Popen[bytes], name: str, timeout: float, prefix: str = "") -> dict[str, Any]:
        """The JSON object the process prints once it is ready (after `prefix`)."""
        try:
            return process_control.read_json_line(proc, timeout, prefix=prefix, what=name)
        except (TimeoutError, process_control.ChildExited) as e:
            raise RuntimeError(f"{name} did not start: {e}: {self.tail(name)}") from None

    def tail(self, name: str, chars: int = 2000) -> str:
        path = self.workdir / f"{name}.err"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def close(self) -> None:
        process_control.stop_all(self.procs, STOP_GRACE_S)
        for log in self._logs:
            log.close()


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def require_memory(need: float, what: str) -> None:
    available = mem_available()
    if need > available:
        raise RuntimeError(f"{what} needs ~{need / 2**30:.1f} GiB, only {available / 2**30:.1f} GiB available")


def estimated_state_bytes(model: str) -> int:
    """θ_outer + momentum in fp32 (the shards' headers add a few KB)."""
    from swarm.model.llama import build_model
    from swarm.model.presets import preset

    return 2 * 4 * sum(p.numel() for p in build_model(preset(model), SEED, device="meta").parameters())


# --- the swarm side --------------------------------------------------------------------------------


@dataclasses.dataclass
class Options:
    model: str
    peers: list[int]
    repeat: int
    shard_bytes: int
    streams_per_peer: int
    timeout: float
    dest: Path
    to_disk: bool
    link: Rate | None = None  # the donors' links (and the newcomer's, without newcomer_link); None: 127.0.0.1
    newcomer_link: Rate | None = None

    @property
    def newcomer_rate(self) -> Rate | None:
        return self.newcomer_link or self.link


def link_bound_MBps(n: int, donor: Rate, newcomer: Rate) -> float:
    """The fastest a newcomer can fetch from n donors: its downlink, or the donors' uplinks
    together when they are the smaller (each donor sends on its own link, all of them into the
    newcomer's); MB/s of the links' raw rate."""
    return min(newcomer.bytes_per_s, n * donor.bytes_per_s) / MB


class Places:
    """Where the processes of a run listen: 127.0.0.1, or with --link each in a namespace of its
    own (added to `lab` as it starts), behind a link of its rate."""

    def __init__(self, lab: Lab | None, opts: Options) -> None:
        self.lab, self.opts = lab, opts

    def place(self, name: str, rate: Rate | None) -> tuple[list[str], str]:
        """(argv prefix, listen multiaddr) of the endpoint `name`, made on its first use."""
        if self.lab is None or rate is None:
            return [], LOOPBACK
        try:
            endpoint = self.lab.endpoint(name)
        except KeyError:
            endpoint = self.lab.add(name, rate)
        return exec_prefix(endpoint), f"/ip4/{endpoint.address}/tcp/0"

    def bootstrap(self) -> tuple[list[str], str]:
        rates = [r for r in (self.opts.link, self.opts.newcomer_rate) if r is not None]
        return self.place("bootstrap", max(rates) if rates else None)  # DHT traffic: any link will do

    def donor(self, index: int) -> tuple[list[str], str]:
        return self.place(f"donor{index}", self.opts.link)

    def newcomer(self) -> tuple[list[str], str]:
        return self.place("newcomer", self.opts.newcomer_rate)  # one newcomer at a time: one namespace


def run_newcomer(
    children: Children, opts: Options, bootstrap: str, donors: list[dict[str, Any]], name: str, places: Places
) -> Any:
    fetch_dest = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=opts.dest))
    prefix, listen = places.newcomer()
    try:
        proc = children.start(name, [
            *module_command("scripts.bench.state"), "--_newcomer", "--model", opts.model, "--bootstrap", bootstrap,
            "--holders", ",".join(d["peer_id"] for d in donors),
            "--streams-per-peer", str(opts.streams_per_peer), "--timeout", str(opts.timeout), "--listen", listen,
            *(["--fetch-dest", str(fetch_dest)] if opts.to_disk else []),
        ], prefix=prefix)  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=opts.timeout * 10)
        except subprocess.TimeoutExpired:
            process_control.stop(proc, STOP_GRACE_S)
            raise RuntimeError(f"{name} did not finish in {opts.timeout * 10:.0f}s: {children.tail(name)}") from None
        lines = [line for line in out.decode().splitlines() if line.startswith(MARK)]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{name} failed (exit code {proc.returncode}): {children.tail(name)}")
        result = json.loads(lines[-1].removeprefix(MARK))
    finally:
        shutil.rmtree(fetch_dest, ignore_errors=True)
    if result["state_sha256"] != donors[0]["state_sha256"]:
        raise RuntimeError(f"{name} loaded the state {result['state_sha256'][:12]}, the donors hold "
                           f"{donors[0]['state_sha256'][:12]}")  # fmt: skip
    return result


def measure_swarm(
    children: Children, opts: Options, state_bytes: int, probe: LoopbackProbe, places: Places
) -> dict[int, list[dict[str, Any]]]:
    """{n: [one newcomer's result per repeat]} (see the module docstring); a loopback transfer
    (probe) just before each newcomer."""
    prefix, listen = places.bootstrap()
    boot = children.start("bootstrap", [console_script("swarm-dht"), "serve", "--host-maddrs", listen, "--json"],
                          prefix=prefix)  # fmt: skip
    bootstrap = children.first_line(boot, "bootstrap", 60)["maddrs"][0]
    donors: list[dict[str, Any]] = []
    runs: dict[int, list[dict[str, Any]]] = {}
    for n in opts.peers:
        while len(donors) < n:  # one after the other: each builds its state (CPU and ~3x the state in memory)
            name = f"donor{len(donors)}"
            require_memory(DONOR_PEAK_PER_STATE_BYTE * state_bytes + PROCESS_FIXED_BYTES, f"{name} ({opts.model})")
            prefix, listen = places.donor(len(donors))
            proc = children.start(name, [
                *module_command("scripts.tools.state_seeder"), "--initial-peers", bootstrap, "--run-id", RUN_ID,
                "--model", opts.model, "--seed", str(SEED), "--step", str(STEP), "--inner-steps", str(INNER_STEPS),
                "--shard-bytes", str(opts.shard_bytes), "--host-maddrs", listen,
            ], prefix=prefix)  # fmt: skip
            donors.append(children.first_line(proc, name, 1800))
            rss = status_kib("VmRSS", proc.pid) * 1024
            log(f"{name} serves {donors[-1]['state_bytes'] / MB:,.0f} MB, its RSS {rss / MB:,.0f} MB "
                f"({mem_available() / 2**30:.1f} GiB available)")  # fmt: skip
        require_memory(NEWCOMER_PEAK_PER_STATE_BYTE * state_bytes + PROCESS_FIXED_BYTES, "a newcomer")
        runs[n] = []
        for r in range(opts.repeat):
            loopback = probe.measure()
            result = run_newcomer(children, opts, bootstrap, donors[:n], f"newcomer-n{n}-r{r}", places)
            result["loopback_MBps"] = loopback  # measured just before
            bound = ("" if opts.link is None or opts.newcomer_rate is None else
                     f", link bound {link_bound_MBps(n, opts.link, opts.newcomer_rate):,.1f} MB/s")  # fmt: skip
            log(f"n={n} run {r}: {result['bytes'] / MB / result['seconds']:,.1f} MB/s (loopback just before "
                f"{loopback:,.0f} MB/s{bound}), peak RSS {result['peak_rss_MB']:,.0f} MB")  # fmt: skip
            runs[n].append(result)
    return runs


def log(text: str) -> None:
    print(f"[bench_state] {text}", file=sys.stderr, flush=True)


# --- report ----------------------------------------------------------------------------------------


def summarize(
    opts: Options, state_bytes: int, loopback: list[float], rates: dict[str, float],
    runs: dict[int, list[dict[str, Any]]], hivemind: dict[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    med = statistics.median
    out: dict[str, Any] = {
        "model": opts.model,
        "link": None if opts.link is None else str(opts.link),  # the donors'
        "newcomer_link": None if opts.newcomer_rate is None else str(opts.newcomer_rate),
        "state_MB": state_bytes / MB,
        "loopback_MBps": med(loopback),
        "repeat": opts.repeat,
        "sha256_MBps": rates["sha256_MBps"],
        "write_MBps": rates["write_MBps"],
    }
    for n, results in runs.items():
        out[f"fetch_MBps_{n}"] = med(r["bytes"] / MB / r["seconds"] for r in results)
        out[f"peak_rss_MB_{n}"] = med(r["peak_rss_MB"] for r in results)
        out[f"added_rss_MB_{n}"] = med(r["peak_rss_MB"] - r["baseline_rss_MB"] for r in results)
    if hivemind is not None:
        out["hivemind_fetch_MBps"] = hivemind["fetch_MBps"]
        out["hivemind_peak_rss_MB"] = hivemind["peak_rss_MB"]
    if opts.link is not None and opts.newcomer_rate is not None:
        for n in runs:
            out[f"link_bound_MBps_{n}"] = link_bound_MBps(n, opts.link, opts.newcomer_rate)
    targets = {f"fetch_{n}_of_loopback": out[f"fetch_MBps_{n}"] / out["loopback_MBps"] for n in runs}
    targets |= {f"fetch_{n}_of_link_bound": out[f"fetch_MBps_{n}"] / out[f"link_bound_MBps_{n}"]
                for n in runs if f"link_bound_MBps_{n}" in out}  # fmt: skip
    if 1 in runs:  # 4 donors at 100mbit give >= 3.5x the fetch rate of one
        targets |= {f"fetch_{n}_over_1": out[f"fetch_MBps_{n}"] / out["fetch_MBps_1"] for n in runs if n > 1}
    targets |= {f"peak_rss_{n}_of_state": out[f"peak_rss_MB_{n}"] / out["state_MB"] for n in runs}
    out["targets"] = targets
    out["detail"] = {
        "loopback_MBps_all": loopback,
        "shard_bytes": opts.shard_bytes,
        "streams_per_peer": opts.streams_per_peer,
        "runs": {str(n): results for n, results in runs.items()},
        "hivemind": hivemind,
    }
    return out


def print_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    med = statistics.median
    runs = {int(n): results for n, results in summary["detail"]["runs"].items()}
    state_MB, loopback = summary["state_MB"], summary["loopback_MBps"]
    linked = summary.get("link") is not None
    where = (f"donors on {summary['link']} links, the newcomer on {summary['newcomer_link']}" if linked
             else "127.0.0.1")  # fmt: skip
    table = Table(title=f"State fetch, {summary['model']} ({state_MB:,.0f} MB), {where}, median of "
                        f"{summary['repeat']} (raw loopback {loopback:,.0f} MB/s)")  # fmt: skip
    versus = ("link bound MB/s", "of bound") if linked else ("of loopback",)
    columns = ("impl", "peers", "fetch s", "MB/s", *versus, "download s", "hash s", "write s", "load s",
               "CPU s", "RSS before MB", "peak RSS MB", "x state", "added x state")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for n, results in runs.items():
        seconds, rate = med(r["seconds"] for r in results), summary[f"fetch_MBps_{n}"]
        peak, added = summary[f"peak_rss_MB_{n}"], summary[f"added_rss_MB_{n}"]
        cells = [med(r[key] for r in results) for key in ("download_s", "hash_s", "write_s", "load_s", "cpu_s")]
        bound = summary.get(f"link_bound_MBps_{n}")
        against = [f"{bound:,.1f}", f"{rate / bound:.0%}"] if bound else [f"{rate / loopback:.0%}"]
        table.add_row(
            "swarm", str(n), f"{seconds:.2f}", f"{rate:,.1f}" if linked else f"{rate:,.0f}", *against,
            *(f"{c:.2f}" for c in cells),
            f"{med(r['baseline_rss_MB'] for r in results):,.0f}", f"{peak:,.0f}", f"{peak / state_MB:.2f}",
            f"{added / state_MB:.2f}",
        )  # fmt: skip
    hm = summary["detail"]["hivemind"]
    if hm is not None:
        rate, peak, before = hm["fetch_MBps"], hm["peak_rss_MB"], hm["baseline_rss_MB"]
        table.add_row(
            "hivemind", "1", f"{hm['seconds']:.2f}", f"{rate:,.0f}", f"{rate / loopback:.0%}", "", "", "", "", "",
            f"{before:,.0f}", f"{peak:,.0f}", f"{peak / state_MB:.2f}", "",
        )  # fmt: skip
    Console(width=None if sys.stdout.isatty() else 180).print(table)
    print(f"this machine: SHA-256 {summary['sha256_MBps']:,.0f} MB/s, file writes in the fetch directory "
          f"{summary['write_MBps']:,.0f} MB/s (4 MiB blocks, page cache). hash s / write s: summed over the "
          "fetcher's threads. added: peak RSS - RSS before the fetch")  # fmt: skip
    if linked:
        print("link bound: min(newcomer rate, n x donor rate) / 8, the links' raw rate (a TCP transfer's payload "
              "is ~95% of it); no added delay (tbf, no netem)")  # fmt: skip
        one = summary.get("fetch_MBps_1")
        for n in runs:
            if one and n > 1:
                print(f"n={n}: {summary[f'fetch_MBps_{n}'] / one:.2f}x the fetch rate from 1 donor")
    for n, results in runs.items():
        rate, peak = summary[f"fetch_MBps_{n}"], summary[f"peak_rss_MB_{n}"]
        ok_rate = rate >= TARGET_OF_LOOPBACK * loopback
        ok_rss = peak <= TARGET_RSS_OF_STATE * state_MB
        phases = (f"RSS peak while downloading {med(r['peak_rss_download_MB'] for r in results):,.0f} MB, "
                  f"while loading {med(r['peak_rss_load_MB'] for r in results):,.0f} MB")  # fmt: skip
        if linked:
            throughput = f"throughput {rate / summary[f'link_bound_MBps_{n}']:.0%} of the link bound"
        else:
            throughput = f"throughput {rate / loopback:.0%} of loopback ({'ok' if ok_rate else 'MISSED'}: >= 50%)"
        print(
            f"n={n}: {throughput}, "
            f"peak RSS {peak / state_MB:.2f}x the state ({'ok' if ok_rss else 'MISSED'}: <= 1.5x); {phases}"
        )
    if hm is not None:
        best = max(summary[f"fetch_MBps_{n}"] for n in runs)
        one = summary.get("fetch_MBps_1")
        vs_one = f", from 1 peer {one / hm['fetch_MBps']:.1f}x" if one else ""
        print(f"swarm / hivemind fetch throughput: best {best / hm['fetch_MBps']:.1f}x{vs_one}; hivemind's newcomer "
              f"peak RSS: caller {hm['caller_peak_rss_MB']:,.0f} MB + averager process "
              f"{hm['averager_peak_rss_MB']:,.0f} MB + p2pd {hm['p2pd_peak_rss_MB']:,.0f} MB")  # fmt: skip


# --- main ------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="150m", help="preset: tiny, small, 150m")
    parser.add_argument("--peers", default="1,2,4", help="numbers of serving peers")
    parser.add_argument("--repeat", type=int, default=3, help="newcomers per number of peers (median)")
    parser.add_argument("--shard-bytes", type=int, default=64 * MiB)
    parser.add_argument("--streams-per-peer", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120.0, help="fetch_state's per-read timeout, seconds")
    parser.add_argument("--dest", type=Path, default=Path(tempfile.gettempdir()), help="where newcomers write")
    parser.add_argument(
        "--to-disk",
        action="store_true",
        help="newcomers also keep each verified shard in --dest (what makes a fetch resumable)",
    )
    parser.add_argument("--compare", choices=["hivemind"])
    parser.add_argument("--link", metavar="RATE", help="each process on its own link of RATE (e.g. 100mbit; root)")
    parser.add_argument("--newcomer-link", metavar="RATE", help="the newcomer's link (default: --link's RATE)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--table-from", type=Path, help="print the table of a saved --json output and exit")
    # child roles
    parser.add_argument("--_newcomer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--_sink", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--holders", help=argparse.SUPPRESS)
    parser.add_argument("--fetch-dest", help=argparse.SUPPRESS)
    parser.add_argument("--listen", default=LOOPBACK, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._sink is not None:
        sink_main(args._sink)
        return
    if args._newcomer:
        from swarm.utils.eventloop import run

        reply(run(newcomer_main(args)))
        return
    if args.table_from is not None:
        print_table(json.loads(args.table_from.read_text()))
        return
    link, newcomer_link = link_options(parser, args)
    process_control.exit_on_sigterm()  # unwind through `finally`: children stop
    peers = sorted({int(x) for x in args.peers.split(",")})
    if not peers or peers[0] < 1 or args.repeat < 1:
        parser.error("--peers are >= 1 and --repeat >= 1")
    dest = args.dest.resolve()  # absolute: the newcomers run in the repository (cwd=ROOT)
    opts = Options(
        args.model, peers, args.repeat, args.shard_bytes, args.streams_per_peer, args.timeout, dest, args.to_disk,
        link, newcomer_link,
    )  # fmt: skip
    summary = bench(opts, args.compare)
    if args.json:
        print(json.dumps(summary))
    else:
        print_table(summary)


def link_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Rate | None, Rate | None]:
    """--link and --newcomer-link, checked before anything starts: a bad rate, a missing --link,
    --compare hivemind with links, or a machine without root or iproute2 is one line (exit 2)."""
    if args.link is None:
        if args.newcomer_link is not None:
            parser.error("--newcomer-link needs --link (the donors' links)")
        return None, None
    if args.compare is not None:
        parser.error(f"--compare {args.compare} runs on 127.0.0.1 only: drop --link or --compare")
    try:
        link = parse_rate(args.link)
        newcomer = None if args.newcomer_link is None else parse_rate(args.newcomer_link)
    except ValueError as e:
        parser.error(str(e))
    if (lacking := missing()) is not None:
        parser.error(f"--link {lacking}")
    return link, newcomer


def bench(opts: Options, compare: str | None) -> dict[str, Any]:
    """The whole benchmark; returns the summary --json prints (every newcomer's result in "detail")."""
    state_bytes = estimated_state_bytes(opts.model)
    with workdir(opts.dest) as work:
        children = Children(work)
        lab = None
        try:
            if opts.link is not None:  # the bridge; each process's link is added as it starts
                lab = Lab.create("state")
            probe = LoopbackProbe(children, state_bytes, transfers=1 + len(opts.peers) * opts.repeat)
            log(f"raw loopback: {probe.measure():,.0f} MB/s")
            rates = machine_rates(opts.dest)
            runs = measure_swarm(children, opts, state_bytes, probe, Places(lab, opts))
            loopback = probe.rates
        finally:
            children.close()  # first: a process still inside would keep its namespace alive
            if lab is not None:
                lab.close()
        state_bytes = runs[opts.peers[0]][0]["bytes"]  # exact: the manifest's total
        hivemind = None
        if compare == "hivemind":
            from scripts.compare.state import run_hivemind_state

            require_memory((DONOR_PEAK_PER_STATE_BYTE + 2.5) * state_bytes + 3 * PROCESS_FIXED_BYTES, "hivemind")
            hivemind = run_hivemind_state(opts.model, repeat=opts.repeat, timeout=opts.timeout, workdir=work)
    return summarize(opts, state_bytes, loopback, rates, runs, hivemind)


@contextlib.contextmanager
def workdir(dest: Path) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="bench_state_", dir=dest))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
