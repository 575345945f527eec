"""Time one hivemind 1.1.12 ``DecentralizedAverager`` all-reduce of n peers on 127.0.0.1.

``run_hivemind_allreduce(n, elements, codec)`` is called by the benchmark orchestrator
(``scripts/bench/allreduce.py``) in its own process. That process computes the exact mean of the
inputs, then forks n peer processes (``multiprocessing.get_context("fork")``); each peer calls
``os.setsid()`` (its process group then holds it, its DHT and averager processes and its p2pd) and
builds, with ``OMP_NUM_THREADS=1`` / ``torch.set_num_threads(1)``:

- ``hivemind.DHT(initial_peers=..., start=False, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
  nat_port_map=False, auto_nat=False)`` + ``run_in_background(await_ready=False)`` +
  ``wait_until_ready(timeout)``: a forked DHT process and its p2pd. Peer 0 starts the DHT; the others
  bootstrap from peer 0's 127.0.0.1 maddr (``DHT.get_visible_maddrs()``).
- ``hivemind.averaging.DecentralizedAverager([tensor], dht, start=False, prefix=...,
  target_group_size=n, min_group_size=n, compression=codec, allow_state_sharing=False,
  allreduce_timeout=timeout)`` + ``run_in_background(await_ready=True, timeout=...)``: a forked
  averager process that talks through the same p2pd (``dht.replicate_p2p()``). Other arguments at
  hivemind's defaults (``part_size_bytes`` 512 KiB, ``min_matchmaking_time`` 5 s,
  ``request_timeout`` 3 s, weight 1 per peer). codec: ``"none"`` -> ``NoCompression``, ``"fp16"``
  -> ``Float16Compression``, ``"int8"`` -> ``Uniform8BitQuantization``.

Each input is one fp32 tensor of ``elements`` standard-normal values from
``numpy.random.default_rng([seed, peer index])``; the parent draws the same values to compute the
exact mean (float64 sum, rounded to fp32), which the peers inherit through fork. Every round
restores each peer's tensor to its input (``averager.get_tensors()``), so each repeat averages the
same inputs.

One round, driven by the parent over a pipe to each peer:
1. each peer calls ``averager.step(wait=False, require_trigger=True, allow_retries=False,
   timeout=...)`` and polls the returned ``StepControl`` until ``stage ==
   AveragingStage.AWAITING_TRIGGER``: matchmaking is done and the group (checked afterwards to be
   of all n peers: ``step``'s result maps each member to its gathered data) is formed. A failed
   matchmaking is retried here; hivemind's own retries are off, as they would also rerun a failed
   all-reduce inside the timed span;
2. once every peer is there, the parent snapshots TCP and CPU counters, then tells all peers "go";
   each peer takes ``t0 = time.monotonic()``, calls ``control.allow_allreduce()`` and blocks in
   ``control.result(timeout)``, then takes ``t1``. The round time is ``max(t1) - min(t0)`` over the
   peers (CLOCK_MONOTONIC is shared by all processes of the machine): the all-reduce alone, from
   the first trigger to the last peer holding its average, without matchmaking;
3. the parent snapshots the counters again; then (outside the timed span) every peer computes
   ``||result - exact_mean|| / ||exact_mean||`` (float64 sums) of its averaged tensor and the
   fraction of its elements still equal to its input. The latter catches parts hivemind silently
   never averaged: 1.1.12 takes a reset p2p stream for its end and keeps the peer's own values for
   the parts a reducer did not send (it logs "Averaging: received N% results"; seen here in about 1
   of 15 rounds on a busy machine, e.g. 0.8% of one peer's 64M elements, whose RMS error of 0.24
   was still within reach of int8's), and with numpy 2.4 its 8-bit codec fails on every part.
   Such a round is bad: it raises, or with ``max_bad_rounds`` is listed and run again.

Wire bytes: the kernel's per-socket TCP counters, read with ``ss -tinp`` (iproute2), of every TCP
socket owned by the peer's p2pd (all its connections to the other peers' p2pds). A peer's bytes
in one round are the increase of ``bytes_acked`` (TCP payload the other end acknowledged: TLS
records, yamux and protobuf framing included; IP/TCP headers not) summed over its sockets (a
connection opened during the round counts from 0). ``lo_bytes_per_member`` is an independent
cross-check: the loopback interface's transmitted bytes (``/proc/net/dev``, with IP/TCP headers
and any other loopback traffic on the machine) during the round, divided by n.

Cleanup, also on failure, timeout or KeyboardInterrupt: "stop" to every peer (hivemind's
``averager.shutdown()`` / ``dht.shutdown()``), then SIGKILL of each peer's process group (the
group is signalled only while the peer is an unreaped child: its pid cannot have been reused), of
every process found under each peer (psutil, checked against reuse), and removal of the p2pd and
p2p client unix socket files. A peer whose parent dies gets SIGTERM (``PR_SET_PDEATHSIG``), shuts
its averager and DHT down and SIGKILLs its own process group.

Needs Linux (``/proc``, ``prctl``), iproute2's ``ss``, hivemind 1.1.12 with numpy < 2.3, psutil.
Cost on a 2-core, 24 GB machine, 3 repeats (setup + rounds + checks; seconds of a round in brackets;
peak memory added): n=2 64M: 40-45 s [3.5-5.3 s], 3.3 GB; n=4 16M int8: 23 s [2.1 s], 2.1 GB;
n=4 64M: 65-75 s [7.5-11.4 s], 5 GB; n=8 16M int8: 52 s [5.3 s], 5.7 GB; n=8 64M int8: 170 s
[18.8 s], 11.3 GB. A peer (its process, DHT and averager processes and p2pd) takes ~0.6 GB
whatever the size, plus ~3x its input in hivemind's buffers and the input itself, which lives in
shared memory (``/dev/shm``); the run refuses to start when the machine has less memory available
than that estimate.

Run: ``python -m scripts.compare.allreduce --n 4 --elements 16M --codec int8 --repeats 3``
(prints the result dict as one JSON line).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import math
import multiprocessing as mp
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from multiprocessing import connection as mp_connection
from typing import Any

import numpy as np
import psutil

from scripts.compare.procs import P2PD_LISTEN_ARG, remove_files, running, socket_files
from swarm.utils import process_control

# hivemind reads these when it is first imported: keep its INFO logs out of benchmark output.
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")

DHT_KWARGS: dict[str, Any] = {
    "host_maddrs": ["/ip4/127.0.0.1/tcp/0"],
    "nat_port_map": False,
    "auto_nat": False,
}
CODEC_BYTES = {"none": 4, "fp16": 2, "int8": 1}

_LOOPBACK_PREFIX = "/ip4/127.0.0.1/tcp/"
_STOP_GRACE_S = 15.0
_REAP_TIMEOUT_S = 5.0
_STAGE_POLL_S = 0.005
_MATCHMAKING_ATTEMPTS = 3
# A peer whose result still equals its input in more than this fraction of elements was not averaged
# there (the smallest part hivemind sends, 512 KiB of fp32, is 0.2% of 64M elements).
MAX_UNCHANGED_FRACTION = 1e-4
_CHUNK = 1 << 22  # elements per chunk of the float64 error sums
# peak memory estimate (measured at n = 4 and 8, 16M and 64M): fixed per peer + per input byte
_PEER_FIXED_BYTES = 650 * 2**20
_PEER_BYTES_PER_INPUT_BYTE = 3.5
_PARENT_BYTES = 2**30


def max_rel_rms_err(codec: str, n: int) -> float:
    """Largest relative RMS error of a peer's average that the codec explains. Measured (seed 0):
    none 3e-8 / 6e-8 (n=2 / 4); fp16 2.1e-4 / 4.4e-4; int8 1.6% / 3.3% / 5.2% (n=2 / 4 / 8): the
    reducers send back 8-bit deltas (average - input), whose error grows against the mean with n.
    Parts that hivemind never averaged are caught by MAX_UNCHANGED_FRACTION, not by this bound."""
    return {"none": 1e-4, "fp16": 1e-2, "int8": 0.04 * math.sqrt(n)}[codec]


def parse_elements(text: str) -> int:
    """'16M' -> 16 * 2**20 (K, M, G are binary: 2**10, 2**20, 2**30); plain integers as they are."""
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    value = int(text[:-1] if scale > 1 else text)
    if value <= 0:
        raise ValueError(f"elements must be positive, got {text!r}")
    return value * scale


def _fill_input(seed: int, index: int, out: np.ndarray) -> None:
    """Peer ``index``'s input, written into ``out`` (fp32) in place."""
    np.random.default_rng([seed, index]).standard_normal(out=out, dtype=np.float32)


def _exact_mean(n: int, elements: int, seed: int) -> np.ndarray:
    """fp32 mean of the n inputs, summed in float64, drawn chunk by chunk: numpy's Generator yields
    the same values in chunks as in one call (checked for numpy 2.2), so no input is held whole."""
    rngs = [np.random.default_rng([seed, i]) for i in range(n)]
    mean = np.empty(elements, dtype=np.float32)
    for lo in range(0, elements, _CHUNK):
        size = min(_CHUNK, elements - lo)
        total = np.zeros(size, dtype=np.float64)
        for rng in rngs:
            total += rng.standard_normal(size, dtype=np.float32)
        mean[lo : lo + size] = total / n
    return mean


def _check(result: np.ndarray, exact: np.ndarray, seed: int, index: int) -> tuple[float, float]:
    """(||result - exact|| / ||exact|| with float64 sums, fraction of elements still equal to peer
    ``index``'s input: parts that hivemind never averaged; ~0 otherwise, as no input equals the mean)."""
    rng = np.random.default_rng([seed, index])
    num = den = 0.0
    same = 0
    for lo in range(0, exact.size, _CHUNK):
        size = min(_CHUNK, exact.size - lo)
        got = result[lo : lo + size]
        e = exact[lo : lo + size].astype(np.float64)
        d = got.astype(np.float64) - e
        num += float(np.dot(d, d))
        den += float(np.dot(e, e))
        same += int(np.count_nonzero(got == rng.standard_normal(size, dtype=np.float32)))
    return (math.sqrt(num / den) if den > 0 else math.inf), same / exact.size


# ----------------------------------------------------------------------------- peer process


@dataclass
class _Config:
    n: int
    elements: int
    codec: str
    seed: int
    deadline: float  # time.monotonic() value, shared by all processes of the machine
    timeout: float
    prefix: str
    parent_pid: int


class _Stop(Exception):
    """The parent said stop (or went away)."""


def _peer_main(
    index: int, conn: mp_connection.Connection, inherited: list[Any], cfg: _Config, exact: np.ndarray
) -> None:
    """Body of peer process ``index`` (forked from the parent)."""
    for c in inherited:  # parent-side pipe ends: only the parent may hold them (EOF on its death)
        c.close()
    os.setsid()
    process_control.exit_on_sigterm()
    process_control.die_with_parent()
    if os.getppid() != cfg.parent_pid:
        os._exit(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    # hivemind's Uniform8BitQuantization calls torch.quantize_per_tensor, deprecated in torch 2.13
    warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor", category=UserWarning)
    state: dict[str, Any] = {}
    orphaned = False
    try:
        _peer_body(index, conn, cfg, exact, state)
    except _Stop:
        orphaned = os.getppid() != cfg.parent_pid
    except BaseException as e:
        orphaned = os.getppid() != cfg.parent_pid
        with contextlib.suppress(Exception):
            conn.send(("error", index, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sockets: set[str] = set()
        with contextlib.suppress(psutil.Error):
            sockets = socket_files(psutil.Process().children(recursive=True))
        for key in ("averager", "dht"):  # hivemind's graceful stop (each bounded: join + terminate)
            obj = state.get(key)
            if obj is not None:
                with contextlib.suppress(BaseException):
                    obj.shutdown()
        remove_files(sockets)
        with contextlib.suppress(OSError):
            conn.close()
        if orphaned:  # nobody will clean up after us: take the whole process group down
            os.killpg(0, signal.SIGKILL)


def _expect(conn: mp_connection.Connection, kind: str, cfg: _Config) -> tuple[Any, ...]:
    remaining = cfg.deadline - time.monotonic()
    if remaining <= 0 or not conn.poll(remaining):
        raise TimeoutError(f"no {kind!r} from the parent in time")
    try:
        msg = conn.recv()
    except EOFError:
        raise _Stop from None
    if msg[0] == "stop":
        raise _Stop
    if msg[0] != kind:
        raise RuntimeError(f"expected {kind!r} from the parent, got {msg[0]!r}")
    return msg


def _remaining(cfg: _Config) -> float:
    remaining = cfg.deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("hivemind all-reduce benchmark ran out of time")
    return remaining


def _peer_body(
    index: int, conn: mp_connection.Connection, cfg: _Config, exact: np.ndarray, state: dict[str, Any]
) -> None:
    import torch
    from hivemind import DHT
    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization

    codecs = {"none": NoCompression, "fp16": Float16Compression, "int8": Uniform8BitQuantization}
    # the averaged tensor lives in shared memory (hivemind would move it there): inputs are drawn
    # straight into it, again before every round, rather than kept in a second copy
    tensor = torch.empty(cfg.elements, dtype=torch.float32).share_memory_()
    _fill_input(cfg.seed, index, tensor.numpy())

    (_, initial_peers) = _expect(conn, "start", cfg)
    dht = DHT(initial_peers=initial_peers or None, start=False, **DHT_KWARGS)
    state["dht"] = dht
    dht.run_in_background(await_ready=False)
    dht.wait_until_ready(_remaining(cfg))
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    loopback = [m for m in maddrs if m.startswith(_LOOPBACK_PREFIX)]
    if not loopback:
        raise RuntimeError(f"hivemind DHT has no 127.0.0.1 maddr: {maddrs}")
    conn.send(("dht", index, {"maddrs": loopback, "dht_pid": dht.pid}))

    averager = DecentralizedAverager(
        [tensor],
        dht,
        start=False,
        prefix=cfg.prefix,
        target_group_size=cfg.n,
        min_group_size=cfg.n,
        compression=codecs[cfg.codec](),
        allow_state_sharing=False,
        allreduce_timeout=cfg.timeout,
    )
    state["averager"] = averager
    averager.run_in_background(await_ready=True, timeout=_remaining(cfg))
    conn.send(("ready", index, {"averager_pid": averager.pid}))

    while True:  # until the parent says "stop" (_expect raises _Stop)
        _expect(conn, "round", cfg)
        with averager.get_tensors() as tensors:
            _fill_input(cfg.seed, index, tensors[0].numpy())
        t_look = time.monotonic()
        control = _find_group(averager, cfg)
        conn.send(("grouped", index, time.monotonic() - t_look))

        _expect(conn, "go", cfg)
        t0 = time.monotonic()
        control.allow_allreduce()
        failure = None
        try:
            gathered = control.result(_remaining(cfg))
        except (TimeoutError, concurrent.futures.TimeoutError):
            raise
        except Exception as e:  # the all-reduce failed (allow_retries=False: hivemind did not retry it)
            failure, gathered = f"{type(e).__name__}: {e}", None
        t1 = time.monotonic()
        group = len(gathered) if isinstance(gathered, dict) else None
        conn.send(("done", index, {"t0": t0, "t1": t1, "group": group, "failure": failure}))

        _expect(conn, "check", cfg)
        with averager.get_tensors() as tensors:
            err, unchanged = _check(tensors[0].numpy(), exact, cfg.seed, index)
        conn.send(("checked", index, {"err": err, "unchanged": unchanged}))


def _find_group(averager: Any, cfg: _Config) -> Any:
    """``averager.step(wait=False, require_trigger=True)``, then wait until the group is formed
    (``AWAITING_TRIGGER``); return its StepControl. ``allow_retries=False``, or hivemind would
    silently rerun a failed all-reduce inside the timed span; a failed matchmaking is retried here."""
    from hivemind.averaging.control import AveragingStage

    error: BaseException | None = None
    for _ in range(_MATCHMAKING_ATTEMPTS):
        if _remaining(cfg) <= averager.matchmaking_kwargs["min_matchmaking_time"]:
            raise TimeoutError("hivemind all-reduce benchmark ran out of time before matchmaking")
        control = averager.step(wait=False, require_trigger=True, allow_retries=False, timeout=_remaining(cfg))
        while control.stage != AveragingStage.AWAITING_TRIGGER and not control.done():
            _remaining(cfg)
            time.sleep(_STAGE_POLL_S)
        if not control.done():
            return control
        try:
            control.result(0)
            error = RuntimeError("averager.step finished before the all-reduce was triggered")
        except Exception as e:
            error = e
    raise RuntimeError(f"hivemind matchmaking failed {_MATCHMAKING_ATTEMPTS} times, last: {error!r}")


# ----------------------------------------------------------------------------- parent side


@dataclass
class _Peer:
    index: int
    proc: Any  # multiprocessing ForkProcess
    conn: mp_connection.Connection
    procs: list[psutil.Process] = field(default_factory=list)  # its descendants (DHT, averager, p2pd)
    p2pd_pid: int | None = None
    sockets: set[str] = field(default_factory=set)
    watch: dict[str, psutil.Process] = field(default_factory=dict)  # must stay alive: name -> process


def _exit_status(pid: int) -> str:
    """The exit status of a child that may have exited, without reaping it."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return "already reaped"
    if info is None:
        return "still running"
    if info.si_code == os.CLD_EXITED:
        return f"exit code {info.si_status}"
    return f"killed by signal {info.si_status}"


def _collect(peers: list[_Peer], kind: str, deadline: float) -> dict[int, Any]:
    """Wait until every peer has sent a ``kind`` message; raise on an error report, death or timeout."""
    by_index = {p.index: p for p in peers}
    pending = set(by_index)
    out: dict[int, Any] = {}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RuntimeError(f"hivemind all-reduce timed out: peers {sorted(pending)} sent no {kind!r} in time")
        for peer in peers:  # a dead p2pd / DHT / averager process stalls hivemind until its timeouts
            for name, proc in peer.watch.items():
                if not running(proc):
                    raise RuntimeError(f"hivemind peer {peer.index}'s {name} (pid {proc.pid}) died before {kind!r}")
        waiting = [by_index[i] for i in sorted(pending)]
        ready = mp_connection.wait(
            [p.conn for p in waiting] + [p.proc.sentinel for p in waiting], timeout=min(remaining, 1.0)
        )
        for peer in waiting:
            if peer.conn.poll():
                try:
                    msg = peer.conn.recv()
                except EOFError:
                    status = _exit_status(peer.proc.pid)
                    raise RuntimeError(f"hivemind peer {peer.index} exited ({status}) before {kind!r}") from None
                if msg[0] == "error":
                    raise RuntimeError(f"hivemind peer {peer.index} failed before {kind!r}: {msg[2]}")
                if msg[0] != kind:
                    raise RuntimeError(f"hivemind peer {peer.index} sent {msg[0]!r}, expected {kind!r}")
                out[peer.index] = msg[2]
                pending.discard(peer.index)
            elif peer.proc.sentinel in ready:
                status = _exit_status(peer.proc.pid)
                raise RuntimeError(f"hivemind peer {peer.index} exited ({status}) before {kind!r}")
    return out


def _send_all(peers: list[_Peer], *msg: Any) -> None:
    for peer in peers:
        peer.conn.send(msg)


def _record(peer: _Peer) -> None:
    """Record the peer's descendant processes, its p2pd and the unix socket files they use."""
    try:
        children = psutil.Process(peer.proc.pid).children(recursive=True)
    except psutil.Error:
        return
    known = {p.pid for p in peer.procs}
    peer.procs.extend(p for p in children if p.pid not in known)
    for proc in peer.procs:
        with contextlib.suppress(psutil.Error):
            if any(arg.startswith(P2PD_LISTEN_ARG) for arg in proc.cmdline()):
                peer.p2pd_pid = proc.pid
    peer.sockets |= socket_files(peer.procs)


_SS_PID = re.compile(r"pid=(\d+)")
_SS_ACKED = re.compile(r"\bbytes_acked:(\d+)")


def _tcp_sent(pids: set[int]) -> dict[tuple[int, str, str], int]:
    """bytes_acked of every TCP socket of the given processes: {(pid, local, remote): bytes}."""
    text = subprocess.run(
        ["ss", "-H", "-t", "-i", "-n", "-p"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    out: dict[tuple[int, str, str], int] = {}
    owner: tuple[int, str, str] | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():  # "ESTAB 0 0 127.0.0.1:1 127.0.0.1:2 users:(("p2pd",pid=9,fd=8))"
            fields = line.split()
            owner = None
            found = [int(p) for p in _SS_PID.findall(line)]
            mine = [p for p in found if p in pids]
            if mine and len(fields) >= 5:
                owner = (mine[0], fields[3], fields[4])
            continue
        if owner is not None:
            match = _SS_ACKED.search(line)
            if match:
                out[owner] = out.get(owner, 0) + int(match.group(1))
            owner = None
    return out


def _cpu_seconds(procs: list[psutil.Process]) -> tuple[float, float]:
    """(CPU seconds the whole machine has been busy, CPU seconds used by ``procs``) so far."""
    total = psutil.cpu_times()
    busy = sum(total) - total.idle - getattr(total, "iowait", 0.0)
    ours = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            ours += times.user + times.system
    return busy, ours


def _lo_tx_bytes() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    return 0


def _shutdown(peers: list[_Peer]) -> list[str]:
    """Stop every peer and everything it started; return what could not be removed (for the log)."""
    for peer in peers:
        _record(peer)  # while they run: hivemind's shutdown leaves the averager's client socket file
        with contextlib.suppress(Exception):
            peer.conn.send(("stop",))
    end = time.monotonic() + _STOP_GRACE_S
    waiting = {peer.proc.sentinel for peer in peers}
    while waiting and time.monotonic() < end:
        ready = mp_connection.wait(list(waiting), timeout=max(0.0, end - time.monotonic()))
        waiting -= set(ready)
    for peer in peers:
        _record(peer)  # processes started since the last look (e.g. a failed start-up)
    for peer in peers:
        # only while the peer is not reaped (we never join/is_alive before this point, but starting
        # a multiprocessing child reaps finished ones) is its pid, its process group id, not reused
        if _exit_status(peer.proc.pid) != "already reaped":
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(peer.proc.pid, signal.SIGKILL)
        for proc in peer.procs:  # in case one left the process group; psutil refuses reused pids
            with contextlib.suppress(psutil.Error):
                proc.kill()
    for peer in peers:
        peer.proc.join(_REAP_TIMEOUT_S)
        with contextlib.suppress(OSError):
            peer.conn.close()
    left = []
    end = time.monotonic() + _REAP_TIMEOUT_S
    for peer in peers:
        for proc in peer.procs:
            while running(proc) and time.monotonic() < end:
                time.sleep(0.01)
            if running(proc):
                left.append(f"pid {proc.pid}")
        remove_files(peer.sockets)
        if peer.proc.exitcode is None:
            left.append(f"peer {peer.index} (pid {peer.proc.pid})")
    return left


def run_hivemind_allreduce(
    n: int,
    elements: int,
    codec: str,
    *,
    repeats: int = 3,
    seed: int = 0,
    timeout: float = 600,
    max_bad_rounds: int = 0,
) -> dict:
    """n hivemind DecentralizedAverager peers (each its own forked process, DHT and p2pd, all on
    127.0.0.1), each with one fp32 tensor of ``elements`` normal values (seeded by seed and peer
    index, the same every repeat), all-reduced ``repeats`` times in one group of all n peers.

    Returns {"impl": "hivemind", "n", "elements", "codec", "round_s" (median seconds of the
    all-reduce alone, matchmaking excluded), "round_s_all", "wire_bytes_per_member" (median over
    peers of the TCP payload bytes one peer's p2pd sent in one round), "ideal_bytes_per_member"
    (2(n-1)/n * elements * bytes per element of the codec), "rel_rms_err" (max over peers and
    rounds of ||average - exact mean|| / ||exact mean||), plus diagnostics: "rel_rms_err_peer0",
    "rel_rms_err_per_peer", "wire_bytes_all" (per round, per peer), "wire_ratio" (median / ideal),
    "wire_bytes_mean_per_member",
    "lo_bytes_per_member", "cpu_s_all" (per round: CPU seconds used by our processes and by all
    others on the machine while the all-reduce ran; "others" well above 0 means a busy machine and
    a slower round), "matchmaking_s_all", "bad_rounds", "setup_s", "total_s", versions}.

    A round is bad when any peer's average is further from the exact mean than the codec explains
    (``max_rel_rms_err``), still equals its own input in places (``MAX_UNCHANGED_FRACTION``: parts
    hivemind silently never averaged), or ``step`` raised. With ``max_bad_rounds=0`` (default) the
    first bad round raises RuntimeError; otherwise up to that many bad rounds are listed in
    "bad_rounds" (reason, time, error), left out of every other figure, and run again.

    Raises RuntimeError on any failure or timeout (``timeout`` bounds the whole run; cleanup adds
    at most ~25 s). Every process it started is gone when it returns or raises.
    """
    if not 2 <= n <= 64:
        raise ValueError(f"n must be in 2..64, got {n}")
    if codec not in CODEC_BYTES:
        raise ValueError(f"codec must be one of {sorted(CODEC_BYTES)}, got {codec!r}")
    if elements < n or repeats < 1 or max_bad_rounds < 0:
        raise ValueError("need elements >= n, repeats >= 1 and max_bad_rounds >= 0")
    need = _PARENT_BYTES + n * (_PEER_FIXED_BYTES + _PEER_BYTES_PER_INPUT_BYTE * 4 * elements)
    available = psutil.virtual_memory().available
    if need > available:
        raise RuntimeError(
            f"hivemind all-reduce of n={n} x {elements} fp32 needs ~{need / 2**30:.1f} GiB of memory, "
            f"{available / 2**30:.1f} GiB available"
        )
    t_start = time.monotonic()
    deadline = t_start + timeout
    import hivemind  # once here, so that every forked peer has it imported already

    cfg = _Config(
        n=n,
        elements=elements,
        codec=codec,
        seed=seed,
        deadline=deadline,
        timeout=timeout,
        prefix=f"hmbench{os.getpid()}x{time.time_ns() % 10**9}",
        parent_pid=os.getpid(),
    )
    exact = _exact_mean(n, elements, seed)
    ctx = mp.get_context("fork")
    peers: list[_Peer] = []
    rounds: list[dict[str, Any]] = []
    bad: list[dict[str, Any]] = []
    try:
        for i in range(n):
            parent_end, child_end = ctx.Pipe(duplex=True)
            inherited = [p.conn for p in peers] + [parent_end]
            proc = ctx.Process(target=_peer_main, args=(i, child_end, inherited, cfg, exact), name=f"hivemind-peer-{i}")
            proc.start()
            peers.append(_Peer(index=i, proc=proc, conn=parent_end))
            child_end.close()
        peers[0].conn.send(("start", []))
        first = _collect(peers[:1], "dht", deadline)[0]
        _record(peers[0])
        _send_all(peers[1:], "start", first["maddrs"])
        dht_pids = {0: first["dht_pid"]} | {i: d["dht_pid"] for i, d in _collect(peers[1:], "dht", deadline).items()}
        averager_pids = _collect(peers, "ready", deadline)
        for peer in peers:
            _record(peer)
            if peer.p2pd_pid is None:
                raise RuntimeError(f"no p2pd found among the processes of hivemind peer {peer.index}")
            pids = {
                "p2pd": peer.p2pd_pid,
                "DHT process": dht_pids[peer.index],
                "averager process": averager_pids[peer.index]["averager_pid"],
            }
            by_pid = {proc.pid: proc for proc in peer.procs}
            peer.watch = {name: by_pid[pid] for name, pid in pids.items() if pid in by_pid}
            if len(peer.watch) != len(pids):
                raise RuntimeError(f"hivemind peer {peer.index}: some of {pids} are not its processes")
        setup_s = time.monotonic() - t_start
        p2pd_pids = {peer.p2pd_pid for peer in peers if peer.p2pd_pid is not None}

        ours = [psutil.Process()] + [psutil.Process(peer.proc.pid) for peer in peers]
        ours += [proc for peer in peers for proc in peer.procs]
        while len(rounds) < repeats:
            record = _round(peers, p2pd_pids, ours, deadline)
            reason = _what_is_wrong(record, n, codec)
            if reason is None:
                rounds.append(record)
                continue
            bad.append({"reason": reason, "round_s": record["round_s"], "rel_rms_err": max(record["errs"])})
            if len(bad) > max_bad_rounds:
                raise RuntimeError(
                    f"hivemind's all-reduce result is wrong (round {len(rounds) + len(bad)}, "
                    f"{len(bad)} bad of {len(rounds) + len(bad)}): {reason}. Known causes: hivemind 1.1.12 "
                    "treats a reset p2p stream as its end and keeps a peer's own input for the parts it "
                    "missed (it logs 'Averaging: received N% results'; seen in ~1 of 15 rounds on a busy "
                    "2-core machine); its 8-bit codec fails so on every part with numpy 2.4 (int() of a "
                    f"1-element array; BASELINES says numpy >= 2.3; here {np.__version__})"
                )
    finally:
        left = _shutdown(peers)
        if left:
            print(f"hivemind_allreduce: could not remove {left}", file=sys.stderr)

    wire = [r["wire"] for r in rounds]
    errs = [r["errs"] for r in rounds]
    wire_bytes = statistics.median(statistics.median(w[i] for w in wire) for i in range(n))
    ideal = 2 * (n - 1) / n * elements * CODEC_BYTES[codec]
    return {
        "impl": "hivemind",
        "n": n,
        "elements": elements,
        "codec": codec,
        "round_s": statistics.median(r["round_s"] for r in rounds),
        "round_s_all": [r["round_s"] for r in rounds],
        "wire_bytes_per_member": wire_bytes,
        "ideal_bytes_per_member": ideal,
        "rel_rms_err": max(max(e) for e in errs),
        "rel_rms_err_peer0": max(e[0] for e in errs),
        "rel_rms_err_per_peer": [max(e[i] for e in errs) for i in range(n)],
        "wire_ratio": wire_bytes / ideal,
        # n not a power of 2: hivemind's parts split unevenly, so members send different amounts
        "wire_bytes_mean_per_member": statistics.fmean(statistics.fmean(w) for w in wire),
        "wire_bytes_all": wire,
        "lo_bytes_per_member": statistics.median(r["lo_bytes"] for r in rounds),
        "cpu_s_all": [r["cpu"] for r in rounds],
        "matchmaking_s_all": [r["matchmaking_s"] for r in rounds],
        "bad_rounds": bad,
        "setup_s": setup_s,
        "total_s": time.monotonic() - t_start,
        "hivemind": hivemind.__version__,
        "numpy": np.__version__,
    }


def _round(peers: list[_Peer], p2pd_pids: set[int], ours: list[psutil.Process], deadline: float) -> dict[str, Any]:
    """Run one round on all peers (see the module docstring); return what it measured."""
    n = len(peers)
    _send_all(peers, "round")
    grouped = _collect(peers, "grouped", deadline)
    tcp_before, lo_before, cpu_before = _tcp_sent(p2pd_pids), _lo_tx_bytes(), _cpu_seconds(ours)
    _send_all(peers, "go")
    done = _collect(peers, "done", deadline)
    cpu_after, lo_after, tcp_after = _cpu_seconds(ours), _lo_tx_bytes(), _tcp_sent(p2pd_pids)
    _send_all(peers, "check")
    checked = _collect(peers, "checked", deadline)
    busy, mine = (a - b for a, b in zip(cpu_after, cpu_before, strict=True))
    return {
        "round_s": max(d["t1"] for d in done.values()) - min(d["t0"] for d in done.values()),
        "matchmaking_s": max(grouped.values()),
        # a connection opened during the round counts from 0
        "wire": [
            sum(v - tcp_before.get(key, 0) for key, v in tcp_after.items() if key[0] == peer.p2pd_pid) for peer in peers
        ],
        "lo_bytes": (lo_after - lo_before) / n,
        "cpu": {"ours": mine, "others": max(0.0, busy - mine)},
        "errs": [checked[i]["err"] for i in range(n)],
        "unchanged": [checked[i]["unchanged"] for i in range(n)],
        "failures": {i: d["failure"] for i, d in done.items() if d["failure"]},
        "groups": {i: d["group"] for i, d in done.items()},
    }


def _what_is_wrong(record: dict[str, Any], n: int, codec: str) -> str | None:
    """Why this round's averages cannot be trusted, or None."""
    problems = []
    if record["failures"]:
        problems.append(f"averager.step raised on peers {record['failures']}")
    if any(size is not None and size != n for size in record["groups"].values()):
        problems.append(f"groups were not of all {n} peers: {record['groups']}")
    bound = max_rel_rms_err(codec, n)
    if max(record["errs"]) > bound:
        errs = [round(e, 4) for e in record["errs"]]
        problems.append(f"relative RMS error vs the exact mean {errs} > {bound:.3g} ({codec}, n={n})")
    if max(record["unchanged"]) > MAX_UNCHANGED_FRACTION:
        fractions = [round(u, 4) for u in record["unchanged"]]
        problems.append(f"fraction of elements left at the peer's own input (never averaged): {fractions}")
    return "; ".join(problems) or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--elements", type=parse_elements, default=parse_elements("16M"), help="e.g. 16M, 64M")
    parser.add_argument("--codec", choices=sorted(CODEC_BYTES), default="int8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--max-bad-rounds", type=int, default=0)
    args = parser.parse_args()
    result = run_hivemind_allreduce(
        args.n,
        args.elements,
        args.codec,
        repeats=args.repeats,
        seed=args.seed,
        timeout=args.timeout,
        max_bad_rounds=args.max_bad_rounds,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
