"""Run N hivemind 1.1.12 DHT nodes inside one benchmark worker process (``HivemindDHTBackend``).

The benchmark orchestrator (``scripts/bench/dht.py``) imports this module in a worker process that
runs an asyncio (uvloop) event loop and drives the nodes with the same operations as our own DHT.

hivemind APIs used, and how:
- ``hivemind.DHT``, one per node: a ``multiprocessing`` *fork* process of the worker (``DHT``
  subclasses ``mp.context.ForkProcess``, whatever the global start method) that runs a ``DHTNode``,
  whose ``P2P`` starts its own ``p2pd`` child. Created with ``start=False``, then
  ``run_in_background(await_ready=False)`` + ``wait_until_ready(timeout)``: what ``start=True`` does,
  except that the object is registered before it forks and p2pd is looked up while we wait, so a
  node that fails to start still has all its processes killed. Kwargs:
  ``host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False`` (``DHT`` forwards
  ``**kwargs`` to ``DHTNode.create``, which passes those it does not know on to ``P2P.create``);
  everything else at hivemind's defaults (``num_replicas=5``, ``cache_locally=True``,
  ``cache_nearest=1``, ``wait_timeout=3``, TLS on, ...).
- ``DHT.get_visible_maddrs()``: the node's multiaddrs, already ending in ``/p2p/<peer id>``; we
  return the ``/ip4/127.0.0.1/tcp/...`` one.
- ``DHT.store(key, value, expiration_time, return_future=True)`` and ``DHT.get(key, latest=False,
  return_future=True)``: they pipe the request to the DHT process and return an ``MPFuture``, which
  is awaitable when created in the event loop's thread (it captures the running loop). ``get``
  resolves to a ``ValueWithExpiration`` (we return ``.value``) or None; ``store`` to a bool.
  ``expiration_time`` is absolute, on hivemind's clock ``hivemind.utils.get_dht_time()``
  (= ``time.time()``).
- ``DHT.shutdown()`` in ``close()`` (hivemind's graceful stop: it terminates p2pd and removes its
  unix sockets), then SIGKILL of every process we recorded.

Blocking hivemind calls (import, fork + readiness wait, ``get_visible_maddrs``, ``shutdown``) run in
threads so that the worker's event loop keeps running. p2pd is found with psutil among the DHT
process's children; its unix socket paths come from its ``-listen=`` argument.

Smoke test: ``python -m scripts.compare.dht --nodes 8`` (prints one JSON line).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from scripts.compare.procs import exists, remove_files, running, socket_files
from swarm.utils.process_memory import pss_bytes

# hivemind reads this once, when it is first imported: keep its INFO logs out of benchmark output.
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")

DHT_KWARGS: dict[str, Any] = {
    "host_maddrs": ["/ip4/127.0.0.1/tcp/0"],
    "nat_port_map": False,
    "auto_nat": False,
}
_LOOPBACK_PREFIX = "/ip4/127.0.0.1/tcp/"
_READY_POLL_S = 0.1
_REAP_TIMEOUT_S = 5.0


@dataclass
class _Node:
    dht: Any  # hivemind.DHT (imported lazily)
    procs: list[psutil.Process] = field(default_factory=list)  # DHT process first, then p2pd
    sockets: list[str] = field(default_factory=list)  # unix socket files of p2pd and of its client
    maddr: str = ""
    alive: bool = True  # False once killed or closed


class HivemindDHTBackend:
    """`count` hivemind.DHT nodes owned by this worker process.

    Methods are called one at a time from the worker's event loop. ``start_seconds`` holds, per
    started node, the seconds from fork to "ready, maddr known" (fork + p2pd start + bootstrap).
    """

    def __init__(
        self,
        *,
        dht_kwargs: dict[str, Any] | None = None,
        start_timeout_s: float = 60.0,
        op_timeout_s: float = 120.0,
    ) -> None:
        """dht_kwargs: extra ``hivemind.DHT`` kwargs (override ``DHT_KWARGS``). op_timeout_s bounds a
        store/get: hivemind times out each RPC (3 s) itself, but a dead DHT process never answers."""
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

        Node j bootstraps from ONE maddr, ``rng.choice`` of ``initial_peers`` + the maddrs of this
        backend's live nodes (none: it starts a new DHT). A second call continues the indices."""
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
        future = self._live(index).dht.store(key, value, expiration_time, return_future=True)
        return bool(await asyncio.wait_for(_await_mpfuture(future), self._op_timeout_s))

    async def get(self, index: int, key: str) -> bytes | None:
        """node[index].get(key) (latest=False); the value, or None when not found."""
        future = self._live(index).dht.get(key, latest=False, return_future=True)
        found = await asyncio.wait_for(_await_mpfuture(future), self._op_timeout_s)
        if found is None:
            return None
        if not isinstance(found.value, bytes):
            raise TypeError(f"hivemind returned {type(found.value).__name__}, not bytes, for {key!r}")
        return found.value

    def kill(self, indices: list[int]) -> None:
        """SIGKILL those nodes' p2pd and DHT processes: no shutdown(), no goodbye."""
        nodes = [self._nodes[i] for i in dict.fromkeys(indices) if self._nodes[i].alive]
        for node in nodes:
            node.alive = False
        self._destroy(nodes)

    def memory_pids(self) -> list[int]:
        """PIDs of the live nodes' processes: each DHT process and its p2pd (not this worker)."""
        return [p.pid for node in self._nodes if node.alive for p in node.procs if running(p)]

    async def close(self) -> None:
        """Stop every node (hivemind's shutdown, then SIGKILL whatever is left); safe to call twice."""
        if self._starting is not None:
            # a start() was cancelled mid-node: its thread may still be forking; let it finish first
            with contextlib.suppress(BaseException):
                await self._starting
            self._starting = None
        graceful = [n for n in self._owned if n.alive and n.procs]
        if graceful:
            # one thread per node: DHT.shutdown() blocks for up to its shutdown_timeout (3 s) each
            loop = asyncio.get_running_loop()
            with concurrent.futures.ThreadPoolExecutor(min(len(graceful), 64)) as pool:
                jobs = [loop.run_in_executor(pool, n.dht.shutdown) for n in graceful]
                await asyncio.gather(*jobs, return_exceptions=True)
        for node in self._owned:
            node.alive = False
        self._destroy(self._owned)

    # ------------------------------------------------------------------ internals

    def _live(self, index: int) -> _Node:
        node = self._nodes[index]
        if not node.alive:
            raise RuntimeError(f"hivemind DHT node {index} was killed or closed")
        return node

    def _start_node(self, bootstrap: list[str]) -> _Node:
        """Fork one DHT process, wait until it is ready, record its processes (runs in a thread)."""
        if self._dht_cls is None:  # imported here, off the event loop (hivemind imports torch)
            from hivemind import DHT

            self._dht_cls = DHT
        t0 = time.perf_counter()
        dht = self._dht_cls(initial_peers=bootstrap or None, start=False, **self._dht_kwargs)
        node = _Node(dht=dht)
        self._owned.append(node)
        try:
            dht.run_in_background(await_ready=False)
            node.procs.append(psutil.Process(dht.pid))
            deadline = time.monotonic() + self._start_timeout_s
            while True:
                # Record p2pd while we wait: after a failed start it may outlive the DHT process
                # (then it is init's child, out of our sight) or exit leaving its socket file.
                self._record_children(node)
                try:
                    dht.wait_until_ready(min(_READY_POLL_S, max(0.0, deadline - time.monotonic())))
                    break
                except concurrent.futures.TimeoutError:  # not yet the builtin TimeoutError on 3.10
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"hivemind DHT not ready in {self._start_timeout_s} s") from None
            self._record_children(node)
            if not node.sockets:  # a p2pd we cannot see is a p2pd that kill() and close() would miss
                raise RuntimeError(f"no p2pd found among the children of hivemind DHT process {dht.pid}")
            visible = [str(m) for m in dht.get_visible_maddrs()]
            loopback = [m for m in visible if m.startswith(_LOOPBACK_PREFIX)]
            if not loopback:
                raise RuntimeError(f"hivemind DHT has no 127.0.0.1 maddr: {visible}")
            node.maddr = loopback[0]
        except BaseException:
            node.alive = False
            self._destroy([node])
            raise
        self.start_seconds.append(time.perf_counter() - t0)
        return node

    @staticmethod
    def _record_children(node: _Node) -> None:
        """Add the DHT process's not yet recorded descendants (p2pd) and their socket paths."""
        with contextlib.suppress(psutil.Error):
            known = {p.pid for p in node.procs}
            node.procs.extend(p for p in node.procs[0].children(recursive=True) if p.pid not in known)
        # cmdlines are read again each time: a child caught between fork and exec still shows ours
        node.sockets = sorted(set(node.sockets) | socket_files(node.procs[1:], connections=False))

    @staticmethod
    def _destroy(nodes: list[_Node]) -> None:
        """SIGKILL the nodes' p2pd, then their DHT processes; reap; remove socket files. Idempotent.

        All nodes at once, so that a kill() of several nodes takes them down together."""
        p2pds = [p for node in nodes for p in node.procs[1:]]
        # p2pd first, while its parent still runs and reaps it at once: were the DHT process to die
        # first, p2pd would be re-parented to init, which may reap it late (here: ~2 s later) or
        # never. psutil refuses to signal a pid that has been reused.
        for proc in p2pds:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        deadline = time.monotonic() + 1.0
        while any(exists(p) for p in p2pds) and time.monotonic() < deadline:
            time.sleep(0.002)
        for node in nodes:
            for proc in node.procs[:1]:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        for node in nodes:
            if node.dht.pid is not None:  # it was forked: reap it
                node.dht.join(_REAP_TIMEOUT_S)
        # a p2pd its parent did not reap in time: wait until it is gone or a zombie (no memory)
        deadline = time.monotonic() + _REAP_TIMEOUT_S
        while any(running(p) for p in p2pds) and time.monotonic() < deadline:
            time.sleep(0.01)
        for node in nodes:
            remove_files(node.sockets)


async def _await_mpfuture(future: Any) -> Any:
    """Await a hivemind MPFuture (its __await__ works only in the loop thread that created it)."""
    return await future


# ----------------------------------------------------------------------------- smoke test


def _p50_ms(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return round(median * 1e3, 2)


async def _smoke(args: argparse.Namespace, backend: HivemindDHTBackend) -> dict[str, Any]:
    from hivemind.utils import get_dht_time

    rng = random.Random(args.seed)
    n = args.nodes
    try:
        t0 = time.perf_counter()
        await backend.start(n, [], rng)
        start_total = time.perf_counter() - t0
        processes = len(backend.memory_pids())
        mem_per_node = pss_bytes(backend.memory_pids()) / n

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
        mem_after = pss_bytes(backend.memory_pids()) / len(alive)
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
    """What close() may have left: recorded processes (zombies too), our children, socket files.

    torch_shm_manager is not counted: torch starts one per process that allocates shared memory
    (hivemind's MPFuture does, in this worker), and it exits with the worker."""
    recorded = [p for node in backend._owned for p in node.procs]
    sockets = [s for node in backend._owned for s in node.sockets]
    children = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if not any("torch_shm_manager" in arg for arg in child.cmdline()[:1]):
                children.append(f"{child.pid}:{child.name()}:{child.status()}")
    return {
        "pids": [f"{p.pid}:{p.status()}" for p in recorded if exists(p)],
        "children": children,
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
