"""The all-reduce's traffic without the all-reduce: plain TCP on shaped links, two ways to schedule it.

n processes, each in a network namespace of its own behind a link of `--link` both ways
(swarm.netlab, as `swarm-sim --link`; needs root), exchange `--mb` MB with every other one, twice,
as a butterfly round does (each sends a slice to every owner; once it holds every slice of its
own part, it sends the result to every member). No codec, no framing, no encryption, no event
loop: the floor any all-reduce over TCP on these links can reach. Three schedules:

  at-once    a process sends to all the others at the same time (as swarm's round does)
  rotation   process i sends to i+1, then i+2, ... (mod n), one after another, with
             TCP_NOTSENT_LOWAT so that a send returns once its bytes are nearly on the wire:
             each link carries one stream at a time
  paced      as at-once, each stream capped (SO_MAX_PACING_RATE, the kernel's own TCP pacing)
             at `--pace` x the link's payload rate / (n - 1): every stream gets its fair share
             of a token bucket that, as a FIFO queue, would not share it evenly

Reported: the exchange's time (median of `--repeats`; it ends when the last process holds every
result) against the links' raw bound 2(n-1) x MB / rate and TCP's: the same at the rate of
Ethernet frames' payload (1448 of 1514 bytes).

    sudo .venv/bin/python -m scripts.bench.tcp_exchange --link 100mbit --mb 17.8 [--json]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from swarm.p2p.pacing import set_max_pacing_rate
from swarm.utils.process_control import exit_on_sigterm

MODULE = "scripts.bench.tcp_exchange"
PORT = 9100
MODES = ("at-once", "rotation", "paced")
NOTSENT_LOWAT = 256 * 1024
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)
PAYLOAD_PER_FRAME = 1448 / 1514  # TCP payload of a full Ethernet frame (timestamps on)


def worker(
    me: int, addresses: list[str], nbytes: int, mode: str, start_at: float, pace_bytes_per_s: int
) -> dict[str, float]:
    """One process: listen, then both phases; the seconds from the start to each phase's end."""
    n = len(addresses)
    server = socket.create_server((addresses[me], PORT), backlog=2 * n)
    got = {1: 0, 2: 0}
    arrived = threading.Condition()

    def receive(conn: socket.socket) -> None:
        with conn:
            phase = conn.recv(1)[0]
            while conn.recv(1 << 20):
                pass
        with arrived:
            got[phase] += 1
            arrived.notify_all()

    def accept() -> None:
        for _ in range(2 * (n - 1)):
            conn, _ = server.accept()
            threading.Thread(target=receive, args=(conn,), daemon=True).start()

    def send(to: int, phase: int, lowat: bool) -> None:
        with socket.create_connection((addresses[to], PORT), timeout=120) as sock:
            if lowat:
                sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, NOTSENT_LOWAT)
            if mode == "paced" and not set_max_pacing_rate(sock, pace_bytes_per_s):
                raise RuntimeError("this kernel does not pace TCP sockets (SO_MAX_PACING_RATE)")
            sock.sendall(bytes([phase]))
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            sock.recv(1)  # the receiver closes once it has read everything

    def phase(number: int) -> None:
        order = [(me + step) % n for step in range(1, n)]
        if mode == "rotation":
            for to in order:
                send(to, number, lowat=True)
        else:
            threads = [threading.Thread(target=send, args=(to, number, False)) for to in order]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        with arrived:
            if not arrived.wait_for(lambda: got[number] == n - 1, timeout=300):
                raise RuntimeError(f"phase {number}: {got[number]} of {n - 1} transfers arrived in 300 s")

    payload = b"\x5a" * nbytes
    threading.Thread(target=accept, daemon=True).start()
    time.sleep(max(0.0, start_at - time.time()))
    started = time.time()
    phase(1)
    first = time.time() - started
    phase(2)
    return {"phase1_s": first, "total_s": time.time() - started}


def measure(link: str, n: int, mb: float, modes: list[str], repeats: int, pace: float = 1.0) -> list[dict[str, Any]]:
    from swarm.netlab import Lab, exec_prefix, parse_rate

    rate = parse_rate(link)
    nbytes = round(mb * 1e6)
    raw_bound = 2 * (n - 1) * nbytes / rate.bytes_per_s
    pace_bytes_per_s = round(pace * rate.bytes_per_s * PAYLOAD_PER_FRAME / (n - 1))
    rows = []
    with Lab.create("tcpexchange", [(f"m{i}", rate) for i in range(n)]) as lab:
        addresses = [lab.endpoint(f"m{i}").address for i in range(n)]
        for mode in modes:
            times = []
            for _ in range(repeats):
                start_at = time.time() + 1.5  # every process starts its first phase at once
                argv = ["--_worker", json.dumps([addresses, nbytes, mode, start_at, pace_bytes_per_s])]
                commands = [
                    [*exec_prefix(lab.endpoint(f"m{i}")), sys.executable, "-m", MODULE, *argv, "--_me", str(i)]
                    for i in range(n)
                ]
                procs: list[subprocess.Popen[str]] = []
                try:
                    for command in commands:
                        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, text=True))
                    outs = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
                finally:
                    for p in procs:
                        if p.poll() is None:
                            p.kill()
                            p.wait()
                times.append(max(o["total_s"] for o in outs))
            rows.append({
                "mode": mode, "pace": pace if mode == "paced" else None,
                "link": link, "n": n, "mb_per_pair": mb, "seconds": statistics.median(times),
                "seconds_all": times, "raw_bound_s": raw_bound, "tcp_bound_s": raw_bound / PAYLOAD_PER_FRAME,
            })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link", default="100mbit")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--mb", type=float, default=17.8, help="MB each process sends each other one, per phase")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pace", type=float, default=1.0, help="paced: x the fair share of the payload rate")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    parser.add_argument("--_me", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._worker is not None:
        addresses, nbytes, mode, start_at, pace_bytes_per_s = json.loads(args._worker)
        print(json.dumps(worker(args._me, addresses, nbytes, mode, start_at, pace_bytes_per_s)), flush=True)
        return
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes) or not 2 <= args.n <= 16 or args.mb <= 0 or not 0.1 <= args.pace <= 10:
        parser.error(f"--modes from {MODES}, --n 2-16, --mb > 0, --pace 0.1-10")
    exit_on_sigterm()
    rows = measure(args.link, args.n, args.mb, modes, args.repeats, args.pace)
    if args.json:
        print(json.dumps({"rows": rows}))
        return
    print(f"{args.n} processes, {args.mb} MB per pair and phase, {args.link} links both ways")
    print(f"{'mode':<10} {'s (median)':>10} {'runs':<22} {'raw bound s':>11} {'x raw':>6} {'x TCP':>6}")
    for r in rows:
        runs = " ".join(f"{t:.2f}" for t in r["seconds_all"])
        print(f"{r['mode']:<10} {r['seconds']:>10.2f} {runs:<22} {r['raw_bound_s']:>11.2f} "
              f"{r['seconds'] / r['raw_bound_s']:>6.3f} {r['seconds'] / r['tcp_bound_s']:>6.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
