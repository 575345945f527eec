"""Time hivemind 1.1.12's ``DecentralizedAverager.load_state_from_peers`` on a swarm state's tensors.

``run_hivemind_state(model, repeat=3)`` is called by ``scripts/bench_state.py --compare hivemind``.
It starts, each as ``python scripts/hivemind_state.py --role ...`` in its own session (so that its
DHT process, averager process and p2pd can be stopped together):

- one donor (``--role donor``): the same state as scripts/state_seeder.py (``make_state``: θ_outer
  + outer momentum, fp32, seed 0, step 5), its tensors (parameters, then momentum, in the model's
  order) averaged by a ``DecentralizedAverager(tensors, dht, prefix=..., allow_state_sharing=True)``
  whose ``get_current_state`` (hivemind's default) hands them to a downloader uncompressed. Its
  ``hivemind.DHT`` is created with ``host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False,
  auto_nat=False`` (BASELINES.md). It answers once its ``<prefix>.all_averagers`` record is in the
  DHT. hivemind downloads from one peer only (the one of the highest priority), so one donor.
- per repeat, a fresh newcomer (``--role newcomer``): a DHT bootstrapped from the donor, and an
  averager of the same class and prefix whose own tensor is a 1-element placeholder:
  ``load_state_from_peers`` returns the donor's tensors whatever the caller's own are, so the
  newcomer holds only what it downloads (``allow_state_sharing=False``,
  ``next_chunk_timeout=timeout``: the default 3 s request timeout would cut a large state off).
  Once the donor's record is visible, ``t0``; ``averager.load_state_from_peers(timeout=...)``;
  ``t1`` (the call includes hivemind's DHT get of the donors' records and the tensors' trip from
  the averager process to the caller). Checked outside that span: as many tensors as the state
  holds, and θ_outer's SHA-256 (``swarm.model.diloco.tensors_sha256``) equals the donor's.

Memory of the newcomer: VmHWM (peak resident set) of the calling process, of its averager process
(where hivemind receives and deserializes the tensors) and of its p2pd, each read from
/proc/<pid>/status after the download; ``peak_rss_MB`` is their sum (an upper bound of what the
three held at once). Every process gets ``OMP_NUM_THREADS=1``.

Cleanup, also on failure: the child's stdin is closed (it shuts its averager and DHT down and
exits); after a grace period its process group is SIGKILLed while its leader is still unreaped
(so the group id cannot have been reused), and hivemind's unix socket files that it reported are
removed. A child whose parent dies gets SIGTERM (PR_SET_PDEATHSIG) and shuts down the same way.

Needs Linux (/proc, prctl), hivemind 1.1.12 with numpy < 2.3, psutil (the ``bench`` extra).
Run alone: ``python scripts/hivemind_state.py --model small --repeat 1`` (prints one JSON line).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from worker_process import status_kib  # beside this file

MARK = "HIVEMIND_STATE "
SEED = 0
STEP = 5
MB = 1e6
DHT_KWARGS: dict[str, Any] = {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "nat_port_map": False, "auto_nat": False}
_LOOPBACK_PREFIX = "/ip4/127.0.0.1/tcp/"
_SOCKET_PREFIX = "/tmp/hivemind-"
_P2PD_LISTEN_ARG = "-listen=/unix"
_PR_SET_PDEATHSIG = 1
_STOP_GRACE_S = 20.0
_POLL_S = 0.05


# ----------------------------------------------------------------------------- child processes


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _child_setup() -> None:
    """SIGTERM (also sent when the parent dies) unwinds through `finally`: hivemind shuts down."""
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    import multiprocessing as mp

    mp.set_start_method("fork", force=True)  # DecentralizedAverager and DHT must be forked (BASELINES.md)
    import torch

    torch.set_num_threads(1)


def _descendants() -> list[Any]:
    import psutil

    with contextlib.suppress(psutil.Error):
        return psutil.Process().children(recursive=True)
    return []


def _socket_files() -> list[str]:
    """hivemind's unix socket files of this process and its descendants (its shutdown leaves some)."""
    import psutil

    paths: set[str] = set()
    for proc in [psutil.Process(), *_descendants()]:
        with contextlib.suppress(psutil.Error):
            for arg in proc.cmdline():
                if arg.startswith(_P2PD_LISTEN_ARG):
                    daemon = arg[len(_P2PD_LISTEN_ARG) :]
                    paths |= {daemon, daemon.replace("/hivemind-p2pd-", "/hivemind-p2pclient-")}
        with contextlib.suppress(psutil.Error):
            for unix in proc.net_connections(kind="unix"):
                if isinstance(unix.laddr, str) and unix.laddr.startswith(_SOCKET_PREFIX):
                    paths.add(unix.laddr)
    return sorted(paths)


def _remove(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.remove(path)


def _wait_for_record(dht: Any, prefix: str, peer_id: str | None, timeout: float) -> None:
    """Until `<prefix>.all_averagers` lists peer_id (any peer when None)."""
    deadline = time.monotonic() + timeout
    while True:
        found = dht.get(f"{prefix}.all_averagers", latest=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        if any(peer_id is None or _subkey_peer(s) == peer_id for s in entries):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {prefix}.all_averagers record after {timeout:.0f}s")
        time.sleep(0.2)


def _subkey_peer(subkey: Any) -> str:
    from hivemind.p2p import PeerID

    return str(PeerID(subkey)) if isinstance(subkey, bytes) else str(subkey)


def _shutdown(objs: list[Any]) -> None:
    for obj in reversed(objs):  # the averager, then the DHT
        with contextlib.suppress(BaseException):
            obj.shutdown()


def donor_main(model: str, prefix: str, timeout: float) -> None:
    _child_setup()
    from hivemind import DHT
    from hivemind.averaging import DecentralizedAverager
    from state_seeder import make_state  # a sibling script module

    from swarm.model.diloco import tensors_sha256

    state = make_state(model, SEED, STEP)
    params, momentum = list(state["params"].values()), list(state["momentum"].values())
    del state
    objs: list[Any] = []
    sockets: list[str] = []
    try:
        dht = DHT(start=True, **DHT_KWARGS)
        objs.append(dht)
        averager = DecentralizedAverager(
            params + momentum, dht, start=True, prefix=prefix, target_group_size=2, allow_state_sharing=True
        )
        objs.append(averager)
        _wait_for_record(dht, prefix, str(dht.peer_id), timeout)
        sockets = _socket_files()
        _reply({
            "maddrs": [str(m) for m in dht.get_visible_maddrs() if str(m).startswith(_LOOPBACK_PREFIX)],
            "state_sha256": tensors_sha256(params),
            "state_bytes": sum(t.numel() * t.element_size() for t in params + momentum),
            "tensors": len(params) + len(momentum),
            "sockets": sockets,
        })  # fmt: skip
        sys.stdin.read()  # serve until the parent closes our stdin
    finally:
        sockets = sorted({*sockets, *_socket_files()})  # also when we failed before reporting them
        _shutdown(objs)
        _remove(sockets)


def newcomer_main(prefix: str, initial_peers: list[str], timeout: float) -> None:
    _child_setup()
    import torch
    from hivemind import DHT
    from hivemind.averaging import DecentralizedAverager

    from swarm.model.diloco import tensors_sha256

    objs: list[Any] = []
    sockets: list[str] = []
    try:
        dht = DHT(initial_peers=initial_peers, start=True, **DHT_KWARGS)
        objs.append(dht)
        averager = DecentralizedAverager(
            [torch.zeros(1)], dht, start=True, prefix=prefix, target_group_size=2, allow_state_sharing=False,
            next_chunk_timeout=timeout,
        )  # fmt: skip
        objs.append(averager)
        _wait_for_record(dht, prefix, None, timeout)
        sockets = _socket_files()
        p2pd = [p.pid for p in _descendants() if p.name() == "p2pd"]
        baseline_kib = status_kib("VmRSS")
        started = time.perf_counter()
        loaded = averager.load_state_from_peers(timeout=timeout)
        seconds = time.perf_counter() - started
        result = {
            "seconds": seconds,
            "baseline_rss_MB": baseline_kib * 1024 / MB,
            "caller_peak_rss_MB": status_kib("VmHWM") * 1024 / MB,
            "averager_peak_rss_MB": status_kib("VmHWM", averager.pid) * 1024 / MB,
            "p2pd_peak_rss_MB": sum(status_kib("VmHWM", pid) for pid in p2pd) * 1024 / MB,
            "sockets": sockets,
        }
        if loaded is None:
            raise RuntimeError("load_state_from_peers returned None (no donor answered)")
        _, tensors = loaded
        result["tensors"] = len(tensors)
        result["bytes"] = sum(t.numel() * t.element_size() for t in tensors)
        result["params_sha256"] = tensors_sha256(tensors[: len(tensors) // 2])  # outside the timed span
        _reply(result)
    finally:
        sockets = sorted({*sockets, *_socket_files()})  # also when we failed before reporting them
        _shutdown(objs)
        _remove(sockets)


# ----------------------------------------------------------------------------- parent side


class _Child:
    """`python hivemind_state.py ARGS` in its own session, its stderr in `<workdir>/<name>.err`."""

    def __init__(self, name: str, args: list[str], workdir: Path) -> None:
        self.name, self.workdir = name, workdir
        self.sockets: list[str] = []
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HIVEMIND_LOGLEVEL": "WARNING"}
        with open(workdir / f"{name}.err", "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), *args],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, start_new_session=True,
            )  # fmt: skip

    def answer(self, timeout: float) -> dict[str, Any]:
        """The child's MARK line; raises when it exits or stays silent for `timeout` seconds."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RuntimeError(f"hivemind {self.name} did not answer in {timeout:.0f}s: {self.tail()}")
            line = self.proc.stdout.readline().decode()
            if not line:
                raise RuntimeError(f"hivemind {self.name} exited ({self._status()}): {self.tail()}")
            if line.startswith(MARK):
                answer = json.loads(line[len(MARK) :])
                self.sockets = answer.get("sockets", [])
                return answer

    def tail(self, chars: int = 3000) -> str:
        return (self.workdir / f"{self.name}.err").read_text(errors="replace")[-chars:]

    def _status(self) -> str:
        """Whether it exited, without reaping it (its pid stays its own until proc.wait())."""
        try:
            info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return "reaped"
        return "running" if info is None else f"exited, status {info.si_status}"

    def close(self) -> None:
        """Ask it to stop (stdin closed), wait, then SIGKILL its process group, reap it."""
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        deadline = time.monotonic() + _STOP_GRACE_S
        while self._status() == "running" and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        if self._status() != "reaped":  # the leader is unreaped: its group id is still ours
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        _remove(self.sockets)


def run_hivemind_state(model: str, *, repeat: int = 3, timeout: float = 120.0, workdir: Path) -> dict[str, Any]:
    """One donor, `repeat` newcomers (see the module docstring). Returns {"fetch_MBps", "seconds",
    "peak_rss_MB", "caller_peak_rss_MB", "averager_peak_rss_MB", "p2pd_peak_rss_MB",
    "baseline_rss_MB"} (medians), "state_bytes", "runs", versions. Raises RuntimeError on a
    failure or a wrong state. Every process it started is gone when it returns or raises."""
    import hivemind
    import numpy as np

    prefix = f"hmstate{os.getpid()}x{time.time_ns() % 10**9}"
    donor = _Child("hivemind-donor", ["--role", "donor", "--model", model, "--prefix", prefix,
                                      "--timeout", str(timeout)], workdir)  # fmt: skip
    runs: list[dict[str, Any]] = []
    try:
        hello = donor.answer(1800)  # building a 150m state takes a while
        for r in range(repeat):
            args = ["--role", "newcomer", "--prefix", prefix, "--timeout", str(timeout), "--initial-peers"]
            newcomer = _Child(f"hivemind-newcomer-r{r}", [*args, *hello["maddrs"]], workdir)
            try:
                result = newcomer.answer(timeout * 10)
            finally:
                newcomer.close()
            if result["tensors"] != hello["tensors"] or result["params_sha256"] != hello["state_sha256"]:
                raise RuntimeError(f"hivemind's newcomer got {result['tensors']} tensors, θ_outer "
                                   f"{result['params_sha256'][:12]}; the donor holds {hello['tensors']}, "
                                   f"{hello['state_sha256'][:12]}")  # fmt: skip
            result["peak_rss_MB"] = result["caller_peak_rss_MB"] + result["averager_peak_rss_MB"] + \
                result["p2pd_peak_rss_MB"]  # fmt: skip
            print(f"[hivemind_state] run {r}: {result['bytes'] / MB / result['seconds']:,.0f} MB/s, newcomer "
                  f"peak RSS {result['peak_rss_MB']:,.0f} MB", file=sys.stderr, flush=True)  # fmt: skip
            runs.append(result)
    finally:
        donor.close()
    med = statistics.median
    keys = ("seconds", "peak_rss_MB", "caller_peak_rss_MB", "averager_peak_rss_MB", "p2pd_peak_rss_MB",
            "baseline_rss_MB")  # fmt: skip
    return {
        "fetch_MBps": med(r["bytes"] / MB / r["seconds"] for r in runs),
        **{key: med(r[key] for r in runs) for key in keys},
        "state_bytes": hello["state_bytes"],
        "donors": 1,
        "runs": runs,
        "hivemind": hivemind.__version__,
        "numpy": np.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--role", choices=["donor", "newcomer"], help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "donor":
        donor_main(args.model, args.prefix, args.timeout)
    elif args.role == "newcomer":
        newcomer_main(args.prefix, args.initial_peers, args.timeout)
    else:
        import tempfile

        signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
        with tempfile.TemporaryDirectory(prefix="hivemind_state_") as work:
            print(json.dumps(run_hivemind_state(args.model, repeat=args.repeat, timeout=args.timeout,
                                                workdir=Path(work))))  # fmt: skip


if __name__ == "__main__":
    main()
