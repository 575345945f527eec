"""Time hivemind 1.1.12's ``DecentralizedAverager.load_state_from_peers`` on a swarm state's tensors.

``run_hivemind_state(model, repeat=3)`` is called by ``scripts/bench/state.py --compare hivemind``.
It starts, each as ``python -m scripts.compare.state --role ...`` in its own session (so that its
DHT process, averager process and p2pd can be stopped together):

- one donor (``--role donor``): the same state as scripts/tools/state_seeder.py (``make_state``: θ_outer
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
  holds, and θ_outer's SHA-256 (``swarm.model.state_hash.tensors_sha256``) equals the donor's.

Memory of the newcomer: VmHWM (peak resident set) of the calling process, of its averager process
(where hivemind receives and deserializes the tensors) and of its p2pd, each read from
/proc/<pid>/status after the download; ``peak_rss_MB`` is their sum (an upper bound of what the
three held at once). Every process gets ``OMP_NUM_THREADS=1``.

Cleanup, also on failure: the child's stdin is closed (it shuts its averager and DHT down and
exits); after a grace period its process group is SIGKILLed while its leader is still unreaped
(so the group id cannot have been reused), and hivemind's unix socket files that it reported are
removed. A child whose parent dies gets SIGTERM (PR_SET_PDEATHSIG) and shuts down the same way.

Needs Linux (/proc, prctl), hivemind 1.1.12 with numpy < 2.3, psutil (the ``bench`` extra).
Run alone: ``python -m scripts.compare.state --model small --repeat 1`` (prints one JSON line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scripts.compare.procs import remove_files, socket_files
from scripts.tools.worker_process import ROOT, module_command
from swarm.utils import process_control
from swarm.utils.process_memory import status_kib

MARK = "HIVEMIND_STATE "
SEED = 0
STEP = 5
MB = 1e6
DHT_KWARGS: dict[str, Any] = {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "nat_port_map": False, "auto_nat": False}
_LOOPBACK_PREFIX = "/ip4/127.0.0.1/tcp/"
_STOP_GRACE_S = 20.0


# ----------------------------------------------------------------------------- child processes


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _child_setup() -> None:
    """SIGTERM (also sent when the parent dies) unwinds through `finally`: hivemind shuts down."""
    process_control.exit_on_sigterm()
    process_control.die_with_parent()
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

    return sorted(socket_files([psutil.Process(), *_descendants()]))


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

    from scripts.tools.state_seeder import make_state
    from swarm.model.state_hash import tensors_sha256

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
        remove_files(sockets)


def newcomer_main(prefix: str, initial_peers: list[str], timeout: float) -> None:
    _child_setup()
    import torch
    from hivemind import DHT
    from hivemind.averaging import DecentralizedAverager

    from swarm.model.state_hash import tensors_sha256

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
        remove_files(sockets)


# ----------------------------------------------------------------------------- parent side


class _Child:
    """`python -m scripts.compare.state ARGS` in its own session, its stderr in `<workdir>/<name>.err`."""

    def __init__(self, name: str, args: list[str], workdir: Path) -> None:
        self.name, self.workdir = name, workdir
        self.sockets: list[str] = []
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HIVEMIND_LOGLEVEL": "WARNING"}
        with open(workdir / f"{name}.err", "wb") as err:
            self.proc = process_control.start(
                module_command("scripts.compare.state", *args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=err, env=env, cwd=ROOT,
            )  # fmt: skip

    def answer(self, timeout: float) -> dict[str, Any]:
        """The child's MARK line; raises when it exits or stays silent for `timeout` seconds."""
        try:  # the child stays unreaped: close() stops its process group by the leader's pid
            answer = process_control.read_json_line(self.proc, timeout, prefix=MARK, what=f"hivemind {self.name}")
        except (TimeoutError, process_control.ChildExited) as e:
            raise RuntimeError(f"{e}: {self.tail()}") from None
        self.sockets = answer.get("sockets", [])
        return answer

    def tail(self, chars: int = 3000) -> str:
        return (self.workdir / f"{self.name}.err").read_text(errors="replace")[-chars:]

    def close(self) -> None:
        """Ask it to stop (stdin closed), wait, then SIGKILL its process group, reap it."""
        process_control.close_stdin(self.proc)
        # group: the leader stays unreaped through the grace, so its group id is still ours
        process_control.stop(self.proc, _STOP_GRACE_S, term=None, group=True)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        remove_files(self.sockets)


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

        process_control.exit_on_sigterm()
        with tempfile.TemporaryDirectory(prefix="hivemind_state_") as work:
            print(json.dumps(run_hivemind_state(args.model, repeat=args.repeat, timeout=args.timeout,
                                                workdir=Path(work))))  # fmt: skip


if __name__ == "__main__":
    main()
