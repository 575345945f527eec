"""Benchmark of swarm.p2p: unary RPC latency and stream throughput between two processes on
127.0.0.1, encrypted (the default) and in the clear (P2PConfig(encryption=False)), next to the
machine's limit (plain Python sockets between two processes) measured in the same run, and with
``--compare hivemind`` the same workloads on hivemind's P2P (TLS on, its default).

    python -m scripts.bench.p2p                      # table, median of --repeat runs
    python -m scripts.bench.p2p --compare hivemind   # + hivemind 1.1.12 (pip extra "bench")
    python -m scripts.bench.p2p --json               # one JSON object

Workloads (the same for every system): ``--rpc-calls`` sequential echo calls of a 24-byte
payload after 100 warm-up calls (p50/p99 round trip), and one stream of ``--stream-mib`` MiB
written in 4 MiB chunks to a handler that reads it all and answers with the byte count (timed
from opening the stream to that answer; MB = 1e6 bytes). swarm (both ways) and the raw-socket
limit each run three transfers on a warm process and count the best; hivemind_p2p.py runs one
warm-up stream and one timed stream (its start-up costs ~10 s a run). The systems take turns
within each repeat, so a busy phase of the machine hits all of them alike. JSON keys: ``stream_MBps``
and ``rpc_p50_us`` are swarm encrypted; ``plaintext_*`` with encryption off.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from scripts.tools.worker_process import ROOT, module_command
from swarm.utils import process_control

MiB = 2**20
CHUNK = 4 * MiB
WARMUP_CALLS = 100
PAYLOAD = b"x" * 24
RAW_STREAMS = 3  # stream transfers per run for swarm and the raw limit; the best counts
PLAINTEXT = "swarm, encryption off"


# --- child processes ------------------------------------------------------------------------


@contextlib.contextmanager
def child(role: str, timeout: float = 60.0) -> Iterator[dict[str, Any]]:
    """Run this script as `--_role ROLE`; yield the JSON object of its first stdout line. The
    child exits when its stdin closes; it is killed if it does not, and always reaped."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = process_control.start(
        module_command("scripts.bench.p2p", "--_role", role),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=ROOT, new_session=False,
    )  # fmt: skip
    try:
        yield process_control.read_json_line(proc, timeout, what=f"{role} child")
    finally:
        process_control.close_stdin(proc)
        process_control.stop(proc, 10.0, term=None, reap_s=None)


def _wait_for_stdin_eof() -> None:
    sys.stdin.buffer.read()


def _announce(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def swarm_config(encrypt: bool) -> Any:
    from swarm.p2p import P2PConfig

    return P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), encryption=encrypt)


def serve_swarm(encrypt: bool) -> None:
    from swarm.p2p import P2PHost
    from swarm.utils.eventloop import run

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with P2PHost(config=swarm_config(encrypt)) as host:

            async def echo(ctx: Any, args: Any) -> Any:
                return args

            async def sink(ctx: Any, args: Any, stream: Any) -> None:
                total = 0
                async for chunk in stream:
                    total += len(chunk)
                await stream.write(total.to_bytes(8, "big"))

            host.add_handler("bench.echo", echo)
            host.add_stream_handler("bench.sink", sink)
            _announce({"maddr": host.visible_maddrs[0]})
            await loop.run_in_executor(None, _wait_for_stdin_eof)

    run(main())


def sink_one_transfer(conn: socket.socket, view: memoryview) -> None:
    """The raw loopback sink: an 8-byte length, then that many bytes recv_into() one reused
    buffer; answers with the count received."""
    total = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "big")
    got = 0
    while got < total:
        n = conn.recv_into(view[: min(len(view), total - got)])
        if not n:
            break
        got += n
    conn.sendall(got.to_bytes(8, "big"))


def serve_raw() -> None:
    """Plain sockets: a ping-pong responder and a sink that recv_into()s a whole buffer."""
    listener = socket.create_server(("127.0.0.1", 0))
    _announce({"port": listener.getsockname()[1]})
    view = memoryview(bytearray(CHUNK))  # cache-sized and warm: the best plain Python can do
    for _ in range(1 + RAW_STREAMS):
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        kind = conn.recv(1)
        if kind == b"p":  # ping-pong: echo fixed-size messages until the client hangs up
            while msg := conn.recv(len(PAYLOAD), socket.MSG_WAITALL):
                conn.sendall(msg)
        else:
            sink_one_transfer(conn, view)
        conn.close()
    _wait_for_stdin_eof()


# --- measurements ---------------------------------------------------------------------------


def percentiles_us(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    q = statistics.quantiles(ordered, n=100, method="inclusive")
    return q[49] * 1e6, q[98] * 1e6


def measure_raw(rpc_calls: int, stream_bytes: int) -> dict[str, float]:
    with child("raw") as info:
        port = info["port"]
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(b"p")
            times = []
            for i in range(WARMUP_CALLS + rpc_calls):
                start = time.perf_counter()
                sock.sendall(PAYLOAD)
                sock.recv(len(PAYLOAD), socket.MSG_WAITALL)
                if i >= WARMUP_CALLS:
                    times.append(time.perf_counter() - start)
        data = memoryview(bytes(stream_bytes))
        best = 0.0
        for _ in range(RAW_STREAMS):  # the limit: best of a few transfers, the first one warms up
            with socket.create_connection(("127.0.0.1", port)) as sock:
                start = time.perf_counter()
                sock.sendall(b"s" + stream_bytes.to_bytes(8, "big"))
                sock.sendall(data)
                got = int.from_bytes(sock.recv(8, socket.MSG_WAITALL), "big")
                best = max(best, stream_bytes / (time.perf_counter() - start) / 1e6)
            assert got == stream_bytes, (got, stream_bytes)
    p50, p99 = percentiles_us(times)
    return {"rpc_p50_us": p50, "rpc_p99_us": p99, "stream_MBps": best}


def measure_swarm(rpc_calls: int, stream_bytes: int, *, encrypt: bool = True) -> dict[str, float]:
    from swarm.p2p import P2PHost
    from swarm.utils.eventloop import run

    async def main(maddr: str) -> dict[str, float]:
        async with P2PHost(config=swarm_config(encrypt)) as host:
            times = []
            for i in range(WARMUP_CALLS + rpc_calls):
                start = time.perf_counter()
                reply = await host.call(maddr, "bench.echo", PAYLOAD)
                if i >= WARMUP_CALLS:
                    times.append(time.perf_counter() - start)
            assert reply == PAYLOAD
            data = bytes(stream_bytes)
            best = 0.0
            for _ in range(RAW_STREAMS):  # measured exactly as the raw limit: best of a few
                start = time.perf_counter()
                async with await host.open_stream(maddr, "bench.sink") as stream:
                    await stream.write(data)
                    await stream.end()
                    got = int.from_bytes(await stream.read_all(max_bytes=8), "big")
                best = max(best, stream_bytes / (time.perf_counter() - start) / 1e6)
                assert got == stream_bytes, (got, stream_bytes)
        p50, p99 = percentiles_us(times)
        return {"rpc_p50_us": p50, "rpc_p99_us": p99, "stream_MBps": best}

    with child("swarm" if encrypt else "swarm-plain") as info:
        return run(main(info["maddr"]))


def measure_swarm_plaintext(rpc_calls: int, stream_bytes: int) -> dict[str, float]:
    return measure_swarm(rpc_calls, stream_bytes, encrypt=False)


def measure_hivemind(rpc_calls: int, stream_bytes: int) -> dict[str, float]:
    try:
        from scripts.compare.p2p import measure_hivemind_p2p
    except ImportError as e:  # pragma: no cover - shown to the user
        raise SystemExit(f"--compare hivemind needs the bench extra: pip install -e '.[bench]' ({e})") from e
    return measure_hivemind_p2p(rpc_calls=rpc_calls, stream_bytes=stream_bytes, chunk_bytes=CHUNK)


# --- report ---------------------------------------------------------------------------------


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def collect(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    systems = {"raw socket": measure_raw, "swarm": measure_swarm, PLAINTEXT: measure_swarm_plaintext}
    if args.compare == "hivemind":
        systems["hivemind"] = measure_hivemind
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
    stream_bytes = args.stream_mib * MiB
    for _ in range(args.repeat):  # interleaved, so slow phases of a noisy machine hit all alike
        for name, measure in systems.items():
            runs[name].append(measure(args.rpc_calls, stream_bytes))
    return {name: median_of(results) for name, results in runs.items()}


def summary(results: dict[str, dict[str, float]]) -> dict[str, float]:
    swarm, plain, raw = results["swarm"], results[PLAINTEXT], results["raw socket"]
    out = {
        "rpc_p50_us": swarm["rpc_p50_us"],
        "rpc_p99_us": swarm["rpc_p99_us"],
        "stream_MBps": swarm["stream_MBps"],
        "plaintext_rpc_p50_us": plain["rpc_p50_us"],
        "plaintext_rpc_p99_us": plain["rpc_p99_us"],
        "plaintext_stream_MBps": plain["stream_MBps"],
        "encrypted_vs_plaintext_stream": swarm["stream_MBps"] / plain["stream_MBps"],
        "raw_socket_MBps": raw["stream_MBps"],
        "raw_socket_rtt_p50_us": raw["rpc_p50_us"],
        "stream_vs_raw": swarm["stream_MBps"] / raw["stream_MBps"],
    }
    if "hivemind" in results:
        hm = results["hivemind"]
        out.update(
            hivemind_rpc_p50_us=hm["rpc_p50_us"],
            hivemind_rpc_p99_us=hm["rpc_p99_us"],
            hivemind_stream_MBps=hm["stream_MBps"],
            rpc_p50_ratio=swarm["rpc_p50_us"] / hm["rpc_p50_us"],
            stream_ratio=swarm["stream_MBps"] / hm["stream_MBps"],
        )
    return out


def print_table(results: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"p2p on 127.0.0.1, two processes, median of {args.repeat} runs "
        f"({args.rpc_calls} calls, {args.stream_mib} MiB stream in 4 MiB chunks)"
    )
    table.add_column("system")
    for col in ("unary p50 µs", "unary p99 µs", "stream MB/s"):
        table.add_column(col, justify="right")
    for name, r in results.items():
        table.add_row(name, f"{r['rpc_p50_us']:.0f}", f"{r['rpc_p99_us']:.0f}", f"{r['stream_MBps']:.0f}")
    console = Console()
    console.print(table)
    s = summary(results)
    console.print(
        f"swarm (encrypted) stream / encryption off: {s['encrypted_vs_plaintext_stream']:.2f} (target >= 0.50); "
        f"/ raw socket: {s['stream_vs_raw']:.2f}"
    )
    if "hivemind" in results:
        console.print(
            f"swarm (encrypted) / hivemind (TLS): unary p50 {s['rpc_p50_ratio']:.3f} (target <= 0.20), "
            f"stream {s['stream_ratio']:.2f}x (target >= 3x)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", choices=["hivemind"], help="also run the workloads on hivemind")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--repeat", type=int, default=3, help="runs per system; medians are reported")
    parser.add_argument("--rpc-calls", type=int, default=2000)
    parser.add_argument("--stream-mib", type=int, default=256)
    parser.add_argument("--_role", choices=["swarm", "swarm-plain", "raw"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._role in ("swarm", "swarm-plain"):
        return serve_swarm(encrypt=args._role == "swarm")
    if args._role == "raw":
        return serve_raw()
    if args.repeat < 1 or args.rpc_calls < 10 or args.stream_mib < 1:
        parser.error("--repeat >= 1, --rpc-calls >= 10 and --stream-mib >= 1 are required")
    results = collect(args)
    if args.json:
        print(json.dumps({**summary(results), "repeat": args.repeat}))
    else:
        print_table(results, args)


if __name__ == "__main__":
    main()
