"""Measure hivemind's P2P layer (``hivemind.p2p.P2P``, the p2pd wrapper) on 127.0.0.1.

Two OS processes, each with its own P2P and p2pd (4 processes in all), started as
``python -m scripts.compare.p2p --_role server|client`` so that nothing depends on how the caller
imported this module. The calling process only orchestrates and never imports hivemind.

hivemind APIs used (the ones hivemind's own components use):
- unary RPC: ``P2P.add_protobuf_handler`` / ``P2P.call_protobuf_handler`` with a non-streaming
  handler, i.e. the persistent-connection unary path that ``ServicerBase`` (DHT ``rpc_ping``,
  ``rpc_store``, ...) registers. Request and reply are ``dht_pb2.NodeInfo`` whose ``node_id``
  bytes field carries the payload; the handler echoes it.
- stream: ``P2P.add_binary_stream_handler`` / ``P2P.call_binary_stream_handler`` (raw bytes
  over a libp2p stream). The client sends an 8-byte length header and then ``stream_bytes`` in
  ``chunk_bytes`` writes (``write`` + ``drain`` each); the server reads everything and replies
  once with the byte count. The timed span runs from opening the stream to reading that reply.
Both processes run uvloop (``hivemind.utils.switch_to_uvloop``) as hivemind's DHT and averager
do, and create P2P with ``host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False,
auto_nat=False`` (other arguments at hivemind's defaults, e.g. TLS on).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import IO, Any

from scripts.compare.procs import remove_files
from scripts.tools.worker_process import ROOT, module_command
from swarm.utils import process_control

_ECHO = "swarm_bench.hivemind_echo"
_SINK = "swarm_bench.hivemind_sink"
_HEADER_LEN = 8
_WARMUP_CALLS = 100
_P2P_KWARGS: dict[str, Any] = {
    "host_maddrs": ["/ip4/127.0.0.1/tcp/0"],
    "nat_port_map": False,
    "auto_nat": False,
}
_MARK = "HIVEMIND_P2P_BENCH "


# ----------------------------------------------------------------------------- helpers


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method) of an already sorted list."""
    pos = q / 100.0 * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _emit(out: IO[str], kind: str, **fields: Any) -> None:
    out.write(_MARK + json.dumps({"kind": kind, **fields}) + "\n")
    out.flush()


def _marker_stream() -> IO[str]:
    """Keep the real stdout for marker lines; send everything else printed to stderr."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return out


def _watch_parent(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """Set ``stop`` when the parent closes our stdin (or dies), or on SIGTERM."""

    fd = sys.stdin.fileno()

    def on_stdin() -> None:
        try:
            eof = not os.read(fd, 1 << 12)
        except OSError:
            eof = True
        if eof:
            loop.remove_reader(fd)
            stop.set()

    loop.add_reader(fd, on_stdin)
    loop.add_signal_handler(signal.SIGTERM, stop.set)


def _p2p_info(p2p: Any) -> dict[str, Any]:
    child = getattr(p2p, "_child", None)
    maddrs = (p2p._daemon_listen_maddr, p2p._client_listen_maddr)
    socks = [str(m).removeprefix("/unix") for m in maddrs]
    return {"p2pd_pid": child.pid if child is not None else None, "sockets": socks}


# ----------------------------------------------------------------------------- server


async def _server_main(out: IO[str]) -> None:
    from hivemind.p2p import P2P, P2PContext
    from hivemind.proto import dht_pb2

    p2p = await P2P.create(**_P2P_KWARGS)
    try:
        _emit(out, "p2pd", **_p2p_info(p2p))

        async def echo(request: dht_pb2.NodeInfo, _: P2PContext) -> dht_pb2.NodeInfo:
            return dht_pb2.NodeInfo(node_id=request.node_id)

        async def sink(_: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                expected = int.from_bytes(await reader.readexactly(_HEADER_LEN), "big")
                received = 0
                while received < expected:
                    data = await reader.read(min(expected - received, 1 << 22))
                    if not data:
                        break
                    received += len(data)
                writer.write(received.to_bytes(_HEADER_LEN, "big"))
                await writer.drain()
            finally:
                writer.close()

        await p2p.add_protobuf_handler(_ECHO, echo, dht_pb2.NodeInfo)
        await p2p.add_binary_stream_handler(_SINK, sink)
        maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
        stop = asyncio.Event()
        _watch_parent(asyncio.get_running_loop(), stop)
        _emit(out, "ready", maddrs=maddrs, peer_id=p2p.peer_id.to_base58())
        await stop.wait()
    finally:
        await p2p.shutdown()


# ----------------------------------------------------------------------------- client


async def _client_main(out: IO[str], args: argparse.Namespace) -> None:
    from hivemind.p2p import P2P, PeerID

    p2p = await P2P.create(initial_peers=args.maddrs, **_P2P_KWARGS)
    try:
        _emit(out, "p2pd", **_p2p_info(p2p))
        stop = asyncio.Event()
        _watch_parent(asyncio.get_running_loop(), stop)
        bench = asyncio.ensure_future(_client_bench(p2p, PeerID.from_base58(args.peer_id), args))
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait([bench, stopper], return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not bench.done():
            bench.cancel()
            raise RuntimeError("client stopped by parent before finishing")
        _emit(out, "result", **bench.result())
    finally:
        await p2p.shutdown()


async def _client_bench(p2p: Any, peer: Any, args: argparse.Namespace) -> dict[str, float]:
    from hivemind.proto import dht_pb2

    await p2p.wait_for_at_least_n_peers(1)
    payload = os.urandom(args.rpc_payload_bytes)
    request = dht_pb2.NodeInfo(node_id=payload)

    async def call() -> bytes:
        reply = await p2p.call_protobuf_handler(peer, _ECHO, request, dht_pb2.NodeInfo)
        return reply.node_id

    for _ in range(_WARMUP_CALLS):
        if await call() != payload:
            raise RuntimeError("echo handler returned a different payload")
    latencies = []
    bad = 0
    for _ in range(args.rpc_calls):
        t0 = time.perf_counter()
        echoed = await call()
        latencies.append(time.perf_counter() - t0)
        bad += echoed != payload
    if bad:
        raise RuntimeError(f"{bad} of {args.rpc_calls} echo replies differ from the request")
    latencies.sort()

    chunk = memoryview(os.urandom(min(args.chunk_bytes, args.stream_bytes)))
    await _send_stream(p2p, peer, min(len(chunk), args.stream_bytes), chunk)  # warm-up stream
    elapsed = await _send_stream(p2p, peer, args.stream_bytes, chunk)
    return {
        "rpc_p50_us": _percentile(latencies, 50) * 1e6,
        "rpc_p99_us": _percentile(latencies, 99) * 1e6,
        "stream_MBps": args.stream_bytes / elapsed / 1e6,
    }


async def _send_stream(p2p: Any, peer: Any, total: int, chunk: memoryview) -> float:
    """Send ``total`` bytes in ``len(chunk)`` writes; return seconds until the server's ack."""
    t0 = time.perf_counter()
    _, reader, writer = await p2p.call_binary_stream_handler(peer, _SINK)
    try:
        writer.write(total.to_bytes(_HEADER_LEN, "big"))
        sent = 0
        while sent < total:
            n = min(len(chunk), total - sent)
            writer.write(chunk[:n])
            await writer.drain()
            sent += n
        received = int.from_bytes(await reader.readexactly(_HEADER_LEN), "big")
        elapsed = time.perf_counter() - t0
    finally:
        writer.close()
    if received != total:
        raise RuntimeError(f"server received {received} bytes, expected {total}")
    return elapsed


def _child_entry(args: argparse.Namespace) -> None:
    out = _marker_stream()
    from hivemind.utils import switch_to_uvloop

    loop = switch_to_uvloop()
    try:
        if args.role == "server":
            loop.run_until_complete(_server_main(out))
        else:
            coro = _client_main(out, args)
            loop.run_until_complete(asyncio.wait_for(coro, args.timeout_s))
    finally:
        loop.close()


# ----------------------------------------------------------------------------- parent


class _Child:
    """A role subprocess in its own session (so its p2pd can be found by process group)."""

    def __init__(self, argv: list[str], name: str) -> None:
        self.name = name
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop())
        env = os.environ.copy()
        env["OMP_NUM_THREADS"] = "1"
        env.setdefault("MKL_NUM_THREADS", "1")
        env.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
        self.proc = process_control.start(
            module_command("scripts.compare.p2p", *argv),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, env=env, cwd=ROOT,
        )  # fmt: skip
        self.info: dict[str, dict[str, Any]] = {}

    def stderr_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError, ValueError):
            self.stderr.seek(0, os.SEEK_END)
            self.stderr.seek(max(0, self.stderr.tell() - n))
            return self.stderr.read().decode(errors="replace")
        return ""

    def wait_for(self, kind: str, deadline: float) -> dict[str, Any]:
        """Read marker lines from the child's stdout until one of ``kind`` arrives."""
        name = f"hivemind {self.name}"
        while kind not in self.info:
            try:
                timeout = max(0.0, deadline - time.monotonic())
                msg = process_control.read_json_line(self.proc, timeout, prefix=_MARK, what=name)
            except TimeoutError:
                raise TimeoutError(f"{name} gave no {kind!r} in time:\n{self.stderr_tail()}") from None
            except process_control.ChildExited as e:
                raise RuntimeError(f"{e} (waiting for {kind!r}):\n{self.stderr_tail()}") from None
            self.info[msg.pop("kind")] = msg
        return self.info[kind]

    def stop(self, grace_s: float = 10.0) -> None:
        """Graceful stop (stdin EOF + SIGTERM), then SIGKILL whatever is left of its session."""
        proc = self.proc
        process_control.close_stdin(proc)
        process_control.send_signal(proc, signal.SIGTERM)  # the role process only: its P2P stops p2pd
        # proc.pid is the process group of the child and of the p2pd it started (which may outlive it)
        process_control.stop(proc, grace_s, term=None, group=True, reap_s=None)
        p2pd_pid = self.info.get("p2pd", {}).get("p2pd_pid")
        if p2pd_pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(p2pd_pid) == proc.pid:  # still ours (not a reused pid)
                    os.kill(p2pd_pid, signal.SIGKILL)
        remove_files(self.info.get("p2pd", {}).get("sockets", []))
        for f in (proc.stdin, proc.stdout, self.stderr):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()


def measure_hivemind_p2p(
    *,
    rpc_calls: int = 2000,
    rpc_payload_bytes: int = 24,
    stream_bytes: int = 256 * 2**20,
    chunk_bytes: int = 4 * 2**20,
    timeout_s: float = 300.0,
) -> dict[str, float]:
    """Unary echo latency and one-way stream throughput of hivemind's P2P over loopback.

    returns {"rpc_p50_us", "rpc_p99_us", "stream_MBps"} (MB = 1e6 bytes); raises on any failure
    or if the whole measurement (including process and p2pd start-up) exceeds ``timeout_s``.
    """
    if rpc_calls < 1 or rpc_payload_bytes < 0 or stream_bytes < 1 or chunk_bytes < 1:
        raise ValueError("rpc_calls, stream_bytes and chunk_bytes must be positive")
    deadline = time.monotonic() + timeout_s
    children: list[_Child] = []
    try:
        server = _Child(["--_role", "server"], "server")
        children.append(server)
        ready = server.wait_for("ready", deadline)
        client = _Child(
            [
                "--_role",
                "client",
                "--_peer-id",
                ready["peer_id"],
                "--_maddrs",
                *ready["maddrs"],
                "--rpc-calls",
                str(rpc_calls),
                "--_rpc-payload-bytes",
                str(rpc_payload_bytes),
                "--_stream-bytes",
                str(stream_bytes),
                "--_chunk-bytes",
                str(chunk_bytes),
                "--_timeout-s",
                str(max(1.0, deadline - time.monotonic())),
            ],
            "client",
        )
        children.append(client)
        result = client.wait_for("result", deadline)
        return {key: float(result[key]) for key in ("rpc_p50_us", "rpc_p99_us", "stream_MBps")}
    finally:
        for child in reversed(children):
            child.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rpc-calls", type=int, default=2000)
    parser.add_argument("--stream-mib", type=int, default=256)
    parser.add_argument("--chunk-mib", type=int, default=4)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    # internal: used when this file is re-executed as the server / client process
    hidden = argparse.SUPPRESS
    parser.add_argument("--_role", dest="role", choices=["server", "client"], help=hidden)
    parser.add_argument("--_peer-id", dest="peer_id", help=hidden)
    parser.add_argument("--_maddrs", dest="maddrs", nargs="+", help=hidden)
    parser.add_argument(
        "--_rpc-payload-bytes",
        dest="rpc_payload_bytes",
        type=int,
        default=24,
        help=hidden,
    )
    parser.add_argument("--_stream-bytes", dest="stream_bytes", type=int, help=hidden)
    parser.add_argument("--_chunk-bytes", dest="chunk_bytes", type=int, help=hidden)
    parser.add_argument("--_timeout-s", dest="timeout_internal", type=float, help=hidden)
    args = parser.parse_args()
    if args.role is not None:
        args.timeout_s = args.timeout_internal or args.timeout_s
        _child_entry(args)
        return
    result = measure_hivemind_p2p(
        rpc_calls=args.rpc_calls,
        stream_bytes=args.stream_mib * 2**20,
        chunk_bytes=args.chunk_mib * 2**20,
        timeout_s=args.timeout_s,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
