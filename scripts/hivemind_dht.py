"""Run N hivemind 1.1.12 DHT nodes inside one benchmark worker process (``HivemindDHTBackend``).

The benchmark orchestrator (``scripts/bench_dht.py``) imports this module in a worker process that
runs an asyncio (uvloop) event loop and drives the nodes with the same operations as our own DHT.

hivemind APIs used, and how:
- ``hivemind.DHT`` (one per node): a ``multiprocessing`` *fork* process (``DHT`` subclasses
  ``mp.context.ForkProcess``, whatever the global start method) that runs a ``DHTNode`` whose
  ``P2P`` starts its own ``p2pd`` child. Created with ``start=False`` and started with
  ``run_in_background(await_ready=False)`` + ``wait_until_ready(timeout)``: the same thing
  ``start=True`` does, but the object is registered for cleanup before it forks, so a node that
  fails to bootstrap still gets its processes killed. Kwargs: ``host_maddrs=["/ip4/127.0.0.1/
  tcp/0"], nat_port_map=False, auto_nat=False`` (``DHT`` forwards ``**kwargs`` to
  ``DHTNode.create``, which forwards what it does not know to ``P2P.create``); everything else at
  hivemind's defaults (e.g. ``num_replicas=5``, ``cache_locally=True``, TLS on). The subclass only
  adds ``os.setpgid(0, 0)`` at the top of ``run()``, so each DHT process leads its own process
  group that its p2pd inherits: ``killpg`` then reaches p2pd even after the DHT process is gone.
- ``DHT.get_visible_maddrs()``: the node's multiaddrs (already ending in ``/p2p/<peer id>``); we
  return the ``/ip4/127.0.0.1/tcp/...`` one.
- ``DHT.store(key, value, expiration_time, return_future=True)`` and ``DHT.get(key, latest=False,
  return_future=True)``: they send the request to the DHT process over a pipe and return an
  ``MPFuture``, which is awaitable when it was created in the thread that runs the event loop (it
  captures that loop); ``get`` resolves to a ``ValueWithExpiration`` (we return ``.value``) or None.
  ``expiration_time`` is absolute, on hivemind's clock: ``hivemind.get_dht_time()`` (= ``time.time()``).
- ``DHT.shutdown()`` in ``close()`` (hivemind's graceful stop, which terminates p2pd and removes its
  unix sockets), followed by a SIGKILL sweep of every process we recorded.

Blocking hivemind calls (fork + readiness wait, ``get_visible_maddrs``, ``shutdown``) run in threads
so that the worker's event loop keeps running. p2pd is found with psutil as a child of the DHT
process once the DHT is ready; its unix socket paths are read from its ``-listen=`` argument.

Smoke test: ``python scripts/hivemind_dht.py --nodes 8`` (prints one JSON line).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

# hivemind reads this once, when it is first imported: keep its INFO logs out of benchmark output.
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")

DHT_KWARGS: dict[str, Any] = {
    "host_maddrs": ["/ip4/127.0.0.1/tcp/0"],
    "nat_port_map": False,
    "auto_nat": False,
}
_LOOPBACK_PREFIX = "/ip4/127.0.0.1/tcp/"
_P2PD_LISTEN_ARG = "-listen=/unix"
_REAP_TIMEOUT_S = 5.0


@dataclass
class _Node:
    dht: Any  # hivemind.DHT (imported lazily)
    pgid: int | None = None  # == the DHT process's pid, once forked
    procs: list[psutil.Process] = field(default_factory=list)  # DHT process first, then p2pd
    sockets: list[str] = field(default_factory=list)  # p2pd's and the DHT process's unix sockets
    maddr: str = ""
    alive: bool = True  # False once killed or closed


class HivemindDHTBackend:
    """`count` hivemind.DHT nodes owned by this worker process.

    Methods are called one at a time from the worker's event loop. ``start_seconds`` holds, per
    started node, the seconds from fork to "ready and its maddr known" (fork + p2pd start +
    bootstrap).
    """

    def __init__(
        self,
        *,
        dht_kwargs: dict[str, Any] | None = None,
        start_timeout_s: float = 60.0,
        op_timeout_s: float = 120.0,
    ) -> None:
        """dht_kwargs: extra ``hivemind.DHT`` kwargs (override ``DHT_KWARGS``); op_timeout_s bounds one
        store/get (hivemind's own per-RPC timeout is 3 s, but a future whose DHT process died would
        never resolve)."""
        self._dht_kwargs = {**DHT_KWARGS, **(dht_kwargs or {})}
        self._start_timeout_s = start_timeout_s
        self._op_timeout_s = op_timeout_s
        self._nodes: list[_Node] = []  # indexable nodes, in start order
        self._owned: list[_Node] = []  # every node ever forked, started or not: what close() sweeps
        self._starting: asyncio.Future[_Node] | None = None
        self._dht_cls: Any = None
        self.start_seconds: list[float] = []

    # ------------------------------------------------------------------ public interface

    async def start(self, count: int, initial_peers: list[str], rng: random.Random) -> list[str]:
        """Start `count` nodes one after another; return their 127.0.0.1 maddrs (with /p2p/<id>).

        Node j bootstraps from ONE maddr chosen with ``rng.choice`` from ``initial_peers`` plus the
        maddrs of this backend's live nodes (none: it starts a new DHT). A later call continues the
        indices (its nodes come after those already started)."""
        if self._dht_cls is None:
            self._dht_cls = _group_leader_dht_class()
        maddrs = []
        for _ in range(count):
            pool = list(initial_peers) + [n.maddr for n in self._nodes if n.alive]
            bootstrap = [rng.choice(pool)] if pool else []
            # shield: if the caller cancels us, the thread still finishes and close() waits for it
            self._starting = asyncio.ensure_future(asyncio.to_thread(self._start_node, bootstrap))
            node = await asyncio.shield(self._starting)
            self._starting = None
            self._nodes.append(node)
            maddrs.append(node.maddr)
        return maddrs

    async def store(self, index: int, key: str, value: bytes, expiration_time: float) -> bool:
        """node[index].store(key, value, expiration_time); True when hivemind reports success."""
        dht = self._live(index).dht
        future = dht.store(key, value, expiration_time, return_future=True)
        return bool(await asyncio.wait_for(_await_mpfuture(future), self._op_timeout_s))

    async def get(self, index: int, key: str) -> bytes | None:
        """node[index].get(key) (latest=False); the value, or None when not found."""
        dht = self._live(index).dht
        future = dht.get(key, latest=False, return_future=True)
        found = await asyncio.wait_for(_await_mpfuture(future), self._op_timeout_s)
        if found is None:
            return None
        if not isinstance(found.value, bytes):
            raise TypeError(f"hivemind returned {type(found.value).__name__}, not bytes, for {key!r}")
        return found.value

    def kill(self, indices: list[int]) -> None:
        """SIGKILL those nodes' DHT processes and p2pd daemons: no shutdown(), no goodbye."""
        for index in indices:
            node = self._nodes[index]
            if node.alive:
                node.alive = False
                self._destroy(node)

    def memory_pids(self) -> list[int]:
        """PIDs of the live nodes' processes: each DHT process and its p2pd (not this worker)."""
        pids = []
        for node in self._nodes:
            if node.alive:
                pids.extend(p.pid for p in node.procs if _running(p))
        return pids

    async def close(self) -> None:
        """Stop every node (hivemind's shutdown, then SIGKILL whatever is left); safe to call twice."""
        if self._starting is not None:
            # a start() was cancelled mid-node: its thread may still be forking; let it finish first
            with contextlib.suppress(BaseException):
                await self._starting
            self._starting = None
        graceful = [n for n in self._owned if n.alive and n.pgid is not None]
        if graceful:
            # one thread per node: DHT.shutdown() blocks for up to its shutdown_timeout (3 s) each
            loop = asyncio.get_running_loop()
            with concurrent.futures.ThreadPoolExecutor(min(len(graceful), 64)) as pool:
                jobs = [loop.run_in_executor(pool, n.dht.shutdown) for n in graceful]
                await asyncio.gather(*jobs, return_exceptions=True)
        for node in self._owned:
            node.alive = False
            self._destroy(node)

    # ------------------------------------------------------------------ internals

    def _live(self, index: int) -> _Node:
        node = self._nodes[index]
        if not node.alive:
            raise RuntimeError(f"hivemind DHT node {index} was killed or closed")
        return node

    def _start_node(self, bootstrap: list[str]) -> _Node:
        """Fork one DHT process, wait until it is ready, record its processes (runs in a thread)."""
        t0 = time.perf_counter()
        dht = self._dht_cls(initial_peers=bootstrap or None, start=False, **self._dht_kwargs)
        node = _Node(dht=dht)
        self._owned.append(node)
        try:
            dht.run_in_background(await_ready=False)
            node.pgid = dht.pid
            # The child also does this; whichever runs first wins, so p2pd can never miss the group.
            with contextlib.suppress(OSError):
                os.setpgid(dht.pid, dht.pid)
            node.procs.append(psutil.Process(dht.pid))
            dht.wait_until_ready(self._start_timeout_s)
            children = node.procs[0].children(recursive=True)
            node.procs.extend(children)
            node.sockets = _p2pd_sockets(children)
            visible = [str(m) for m in dht.get_visible_maddrs()]
            loopback = [m for m in visible if m.startswith(_LOOPBACK_PREFIX)]
            if not loopback:
                raise RuntimeError(f"hivemind DHT has no 127.0.0.1 maddr: {visible}")
            node.maddr = loopback[0]
        except BaseException:
            node.alive = False
            self._destroy(node)
            raise
        self.start_seconds.append(time.perf_counter() - t0)
        return node

    def _destroy(self, node: _Node) -> None:
        """SIGKILL the node's process group and recorded processes, reap, remove its sockets."""
        dht = node.dht
        if node.pgid is not None:
            # While the DHT process is unreaped its pid (= the pgid) cannot be reused, so killpg is
            # safe; exitcode polls (and may reap), hence killpg only when it says "not exited".
            if dht.exitcode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(node.pgid, signal.SIGKILL)
            for proc in node.procs:  # psutil refuses to signal a reused pid
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    proc.kill()
            dht.join(_REAP_TIMEOUT_S)
            # p2pd is the DHT process's child: once that dies, init reaps it; wait until it is gone
            # (or a zombie) so that memory figures and "no process left" checks see it dead.
            deadline = time.monotonic() + _REAP_TIMEOUT_S
            while any(_running(p) for p in node.procs[1:]) and time.monotonic() < deadline:
                time.sleep(0.01)
        for path in node.sockets:
            with contextlib.suppress(OSError):
                os.remove(path)


def _group_leader_dht_class() -> Any:
    """hivemind.DHT whose process leads its own process group (so p2pd, its child, is in it)."""
    from hivemind import DHT

    class _GroupLeaderDHT(DHT):
        def run(self) -> None:
            with contextlib.suppress(OSError):
                os.setpgid(0, 0)
            super().run()

    return _GroupLeaderDHT


async def _await_mpfuture(future: Any) -> Any:
    """Await a hivemind MPFuture (its __await__ works only in the loop thread that created it)."""
    return await future


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _p2pd_sockets(procs: list[psutil.Process]) -> list[str]:
    """Unix socket files of p2pd (``-listen=/unix/tmp/hivemind-p2pd-<uid>.sock``) and its client."""
    paths = []
    for proc in procs:
        try:
            cmdline = proc.cmdline()
        except psutil.Error:
            continue
        for arg in cmdline:
            if arg.startswith(_P2PD_LISTEN_ARG):
                daemon_sock = arg[len(_P2PD_LISTEN_ARG) :]
                paths += [daemon_sock, daemon_sock.replace("/hivemind-p2pd-", "/hivemind-p2pclient-")]
    return paths


# ----------------------------------------------------------------------------- smoke test


def _p50_ms(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return round(median * 1e3, 2)


def _pss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += psutil.Process(pid).memory_full_info().pss
    return total


async def _smoke(args: argparse.Namespace, backend: HivemindDHTBackend) -> dict[str, Any]:
    from hivemind.utils import get_dht_time

    rng = random.Random(args.seed)
    n = args.nodes
    try:
        t0 = time.perf_counter()
        await backend.start(n, [], rng)
        start_total = time.perf_counter() - t0
        processes = len(backend.memory_pids())
        mem_per_node = _pss_bytes(backend.memory_pids()) / n

        keys = {f"smoke-{i}": os.urandom(args.value_bytes) for i in range(args.keys)}
        expiration = get_dht_time() + 600
        store_lat, stored = [], 0
        for i, (key, value) in enumerate(keys.items()):
            t = time.perf_counter()
            stored += await backend.store(i % n, key, value, expiration)
            store_lat.append(time.perf_counter() - t)

        async def get_all(alive: list[int]) -> tuple[list[float], int]:
            lat, found = [], 0
            for i, (key, value) in enumerate(keys.items()):
                reader = next(j for j in alive[(i + 1) % len(alive) :] + alive if j != i % n)
                t = time.perf_counter()
                got = await backend.get(reader, key)
                lat.append(time.perf_counter() - t)
                if got is not None and got != value:
                    raise RuntimeError(f"node {reader} returned a different value for {key}")
                found += got == value
            return lat, found

        get_lat, found = await get_all(list(range(n)))
        killed = sorted(rng.sample(range(n), args.kill))
        backend.kill(killed)
        alive = [j for j in range(n) if j not in killed]
        get_lat_after, found_after = await get_all(alive)
        miss_t = time.perf_counter()
        missing = await backend.get(alive[0], "smoke-missing-key")
        miss_s = time.perf_counter() - miss_t
        mem_after = _pss_bytes(backend.memory_pids()) / len(alive)
        result = {
            "nodes": n,
            "processes_per_node": processes / n,
            "start_total_s": round(start_total, 2),
            "start_per_node_p50_ms": _p50_ms(backend.start_seconds),
            "start_per_node_max_ms": round(max(backend.start_seconds) * 1e3, 1),
            "stored": f"{stored}/{len(keys)}",
            "store_p50_ms": _p50_ms(store_lat),
            "get_p50_ms": _p50_ms(get_lat),
            "found": f"{found}/{len(keys)}",
            "killed": killed,
            "get_after_kill_p50_ms": _p50_ms(get_lat_after),
            "found_after_kill": f"{found_after}/{len(keys)}",
            "get_missing_ms": round(miss_s * 1e3, 1),
            "missing_is_none": missing is None,
            "pss_per_node_MiB": round(mem_per_node / 2**20, 1),
            "pss_per_live_node_after_kill_MiB": round(mem_after / 2**20, 1),
        }
    finally:
        t = time.perf_counter()
        await backend.close()
        result_close_s = time.perf_counter() - t
        await backend.close()  # must be a no-op the second time
    result["close_s"] = round(result_close_s, 2)
    return result


def _leftovers(backend: HivemindDHTBackend) -> dict[str, list[Any]]:
    """What close() may have left: recorded processes, children of this process, socket files."""
    recorded = [p for node in backend._owned for p in node.procs]
    sockets = [s for node in backend._owned for s in node.sockets]
    children = psutil.Process().children(recursive=True)
    return {
        "pids": [p.pid for p in recorded if _running(p)],
        "children": [f"{c.pid}:{c.name()}" for c in children if _running(c)],
        "sockets": [s for s in sockets if os.path.exists(s)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="Smoke test: N hivemind DHT nodes in one backend.")
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--keys", type=int, default=None, help="keys to store (default: one per node)")
    parser.add_argument("--kill", type=int, default=2)
    parser.add_argument("--value-bytes", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.keys = args.nodes if args.keys is None else args.keys
    if args.nodes < 2 or not 0 <= args.kill <= args.nodes - 2:
        parser.error("need --nodes >= 2 and 0 <= --kill <= nodes - 2")
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    backend = HivemindDHTBackend()
    try:
        result = loop.run_until_complete(_smoke(args, backend))
    finally:
        loop.close()
        left = _leftovers(backend)
    result["leftovers"] = left
    print(json.dumps(result))
    if any(left.values()):
        raise SystemExit(f"close() left processes or sockets behind: {left}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
