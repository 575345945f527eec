"""The NAT benchmark's link figures (scripts/bench/nat.py's ``links`` run): streams on shaped links
in the lab, between peers of scripts/bench/natpeer.py, each in its own namespace.

- ``direct_mbit``: a stream between two public endpoints, each on a 100 Mbit/s link.
- ``punched_mbit``: a stream on the connection two hosts behind two cone NATs punched, their homes
  on 100 Mbit/s links (the relay on 1 Gbit/s): ``punched_vs_direct`` is its share of the direct
  stream on the same shaped link (target >= 0.9).
- ``relayed_mbit``: a stream through a relay on a 100 Mbit/s link between two cone homes on
  1 Gbit/s links, without punching: ``relayed_vs_link`` is its share of the relay's link
  (target >= 0.8; each byte crosses the relay's link in and out, shaped apart).
- ``punches``: fresh dialers behind one cone home punching to a host behind another, one after
  the other: how many punched (``punched``) and how many at the first or second attempt
  (``within_2_tries``; target >= 95% of the punches).
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from swarm.netlab import Lab, exec_prefix, parse_rate
from swarm.utils import process_control

REPO = Path(__file__).resolve().parents[2]
LINK = parse_rate("100mbit")
FAST = parse_rate("1gbit")
STREAM_BYTES = 32 * 1024 * 1024  # 2.7 s at 100 Mbit/s: slow start is a small part of it
PEER_TIMEOUT_S = 120.0
ATTEMPT = re.compile(r"punched a direct connection to \w+ \(attempt (\d+)\)")


class Peers:
    """natpeer processes inside one lab; all are stopped when the lab closes."""

    def __init__(self, lab: Lab) -> None:
        self.lab, self.procs = lab, []

    def start(self, where: str, *args: str) -> subprocess.Popen[str]:
        argv = [*exec_prefix(self.lab.endpoint(where)), sys.executable, "-m", "scripts.bench.natpeer", *args]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=REPO)  # fmt: skip
        self.procs.append(proc)
        return proc

    def line(self, where: str, *args: str) -> dict[str, Any]:
        """Start a peer and read its one JSON line (a serving peer keeps running)."""
        proc = self.start(where, *args)
        assert proc.stdout is not None
        text = proc.stdout.readline()
        if not text:
            raise SystemExit(f"natpeer {' '.join(args)} exited without a word: {proc.communicate()[1][-2000:]}")
        return json.loads(text)

    def run(self, where: str, *args: str) -> tuple[dict[str, Any], str]:
        """Run a peer to its end: its JSON line and its log (stderr)."""
        proc = self.start(where, *args)
        out, err = proc.communicate(timeout=PEER_TIMEOUT_S)
        if proc.returncode != 0 or not out.strip():
            raise SystemExit(f"natpeer {' '.join(args)} exited {proc.returncode}: {err[-2000:]}")
        return json.loads(out.splitlines()[0]), err

    def close(self) -> None:
        """Each peer ends when its stdin closes; one still running after 10 s is killed."""
        for proc in self.procs:
            process_control.close_stdin(proc)
        process_control.stop_all(self.procs, 10.0, term=None)


@contextmanager
def lab(name: str, endpoints: list[tuple[str, Any]]) -> Iterator[tuple[Lab, Peers]]:
    with Lab.create(f"{name}{secrets.token_hex(2)}", endpoints) as built:
        peers = Peers(built)
        try:
            yield built, peers
        finally:
            peers.close()


def mbit(bytes_per_s: float) -> float:
    return round(bytes_per_s * 8 / 1e6, 1)


def measure_links(punches: int = 10) -> dict[str, Any]:
    with lab("ld", [("s1", LINK), ("s2", LINK)]) as (built, peers):
        sink = peers.line("s1", "serve", built.endpoint("s1").address)["maddr"]
        direct = peers.run("s2", "send", sink, str(STREAM_BYTES))[0]["bytes_per_s"]
    with lab("lp", [("relay", FAST)]) as (built, peers):
        homes = [built.add_home(f"h{i}", "cone", LINK) for i in range(2)]
        for i in range(punches):
            built.add_behind(homes[0], f"a{i}")
        built.add_behind(homes[1], "b")
        relay = peers.line("relay", "relay", built.endpoint("relay").address)["maddr"]
        target = peers.line("b", "target", relay, "punch")["relayed"]
        tries: list[int] = []
        punched_rate = None
        for i in range(punches):  # each a fresh dialer (a new identity, a new punch)
            stream = str(STREAM_BYTES) if i == 0 else "0"
            result, log = peers.run(f"a{i}", "punch", target, stream)
            if result["outcome"] == "punched":
                tries += [int(n) for n in ATTEMPT.findall(log)][:1] or [0]
            if i == 0:
                punched_rate = result["bytes_per_s"]
    with lab("lr", [("relay", LINK)]) as (built, peers):
        homes = [built.add_home(f"h{i}", "cone", FAST) for i in range(2)]
        built.add_behind(homes[0], "a")
        built.add_behind(homes[1], "b")
        relay = peers.line("relay", "relay", built.endpoint("relay").address)["maddr"]
        target = peers.line("b", "target", relay)
        direct_b = f"/ip4/{homes[1].router.address}/tcp/{target['port']}/p2p/{target['peer_id']}"
        relayed = peers.run("a", "dial", relay, target["relayed"], direct_b, str(STREAM_BYTES))[0]["bytes_per_s"]
    return {
        "run": "links",
        "direct_mbit": mbit(direct),
        "punched_mbit": mbit(punched_rate) if punched_rate else None,
        "punched_vs_direct": round(punched_rate / direct, 3) if punched_rate else None,
        "relayed_mbit": mbit(relayed),
        "relayed_vs_link": round(relayed * 8 / LINK.bits_per_s, 3),
        "punches": punches,
        "punched": len(tries),
        "within_2_tries": sum(1 <= t <= 2 for t in tries),
    }
