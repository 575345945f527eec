"""Benchmark of volunteers behind NAT: `swarm-sim --nat` runs in the lab (root, iproute2, nftables),
one public bootstrap that relays and trains nothing, six trainers in three home networks.

    sudo .venv/bin/python -m scripts.bench.nat              # a table, the three runs below
    sudo .venv/bin/python -m scripts.bench.nat --json --outer-steps 5

The runs:
- ``punched``: cone:2,cone:2,cone:2. Pairs in two homes punch; pairs in one home (no
  hairpinning) stay relayed.
- ``mixed``: cone:2,cone:2,symmetric:2, the issue's all-NAT run. The symmetric NAT's nodes are
  relayed clients: they send their slices and take the averages through the relay.
- ``relayed``: symmetric:2,symmetric:2,symmetric:2. Nobody can punch: every byte between homes
  goes through the relay (the forced-relay case), and the relayed nodes own the parts because
  nobody else can.
- ``public``: public:2,cone:2,cone:2. Two trainers anyone can dial, four at home: a public node
  that reaches a NATed one through the relay is dialed back directly.
- ``links``: no training; streams on shaped links and repeated punches between two cone homes
  (scripts/bench/nat_links.py): a punched stream against a direct one on the same 100 Mbit/s
  link, a relayed one against the relay's 100 Mbit/s link, and how many of 10 punches succeed
  within 2 tries.
- ``newcomers``: cone:2,symmetric:1 for 24 outer steps, a newcomer every 12 s, behind the homes in
  turn: ``newcomer_lag`` lists, per newcomer, the outer steps from the state it started training
  from (fetched from the swarm) to its first round with others (0 or 1: within one outer step).

Per run: ``agree`` (one state per outer step), ``full_rounds`` (steps where all six nodes were
in one group), ``loss_first``/``loss_last`` (eval loss), ``averaging_MB`` (the rounds' bytes sent,
all nodes), ``relayed_MB`` (what the relay carried, both ways; everything, the DHT and
matchmaking included, each byte counted once as it passes), ``relay_share`` (relayed over
averaging bytes), the punches between nodes of two cone homes (``cone_pairs``: the initiators'
outcomes; ``punched``, ``first_try``, ``most_tries``), the pairs with a symmetric node that stayed
relayed (``symmetric_relayed``) and the run's wall time.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from scripts.bench.nat_links import measure_links
from swarm.netlab.lab import missing_nat
from swarm.utils.process_control import console_script

RUNS = {"punched": "cone:2,cone:2,cone:2", "mixed": "cone:2,cone:2,symmetric:2",
        "relayed": "symmetric:2,symmetric:2,symmetric:2", "public": "public:2,cone:2,cone:2",
        "newcomers": "cone:2,symmetric:1"}  # fmt: skip
CHURN = {"newcomers": ("--join-every", "12")}  # the runs with newcomers, and their outer steps
STEPS = {"newcomers": 24}
PUNCHED = re.compile(r"(\w+): punched a direct connection to (\w+) \(attempt (\d+)\)")
STAYS = re.compile(r"(\w+): no direct connection to (\w+): it stays relayed")


def simulate(homes: str, outer_steps: int, run_dir: Path, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    argv = [console_script("swarm-sim"), "--nat", homes, "--outer-steps", str(outer_steps), "--inner-steps", "10",
            "--threads", "1", "--timeout", "600", "--run-dir", str(run_dir), "-v", *extra]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        raise SystemExit(f"swarm-sim --nat {homes} exited {done.returncode}: {tail}")
    return json.loads((run_dir / "metrics.json").read_text())


def punches(run_dir: Path, nodes: list[dict[str, Any]], homes: str) -> dict[str, Any]:
    """Punch outcomes from the nodes' logs (the initiators'): between two cone homes, and with a
    symmetric node. A node's home is the third byte of its LAN address (10.78.k.x: home k)."""
    kinds = [kind for kind in (item.split(":")[0] for item in homes.split(",")) if kind != "public"]
    home = {n["peer_id"]: int(n["link"]["address"].split(".")[2]) for n in nodes
            if n["link"]["address"].startswith("10.78.")}  # fmt: skip

    def pair(a: str, b: str) -> str | None:
        if a not in home or b not in home or home[a] == home[b]:
            return None  # one home: no hairpinning, relayed by design
        return "cone" if kinds[home[a]] == kinds[home[b]] == "cone" else "symmetric"

    tries, relayed_cone, relayed_symmetric = [], 0, 0
    for node in nodes:
        text = (run_dir / f"{node['name']}.log").read_text(errors="replace")
        tries += [int(attempt) for a, b, attempt in PUNCHED.findall(text) if pair(a, b) == "cone"]
        outcomes = [pair(a, b) for a, b in STAYS.findall(text)]
        relayed_cone += outcomes.count("cone")
        relayed_symmetric += outcomes.count("symmetric")
    return {"cone_pairs": len(tries) + relayed_cone, "punched": len(tries), "first_try": tries.count(1),
            "most_tries": max(tries, default=0), "symmetric_relayed": relayed_symmetric}  # fmt: skip


def measure(name: str, outer_steps: int, root: Path) -> dict[str, Any]:
    run_dir = root / name
    run_dir.mkdir()
    outer_steps = STEPS.get(name, outer_steps)
    metrics = simulate(RUNS[name], outer_steps, run_dir, CHURN.get(name, ()))
    first = sum(int(item.split(":")[1]) for item in RUNS[name].split(","))
    newcomers = metrics["nodes"][first:]
    nodes = metrics["nodes"][:first]  # the nodes that started together: every round must hold them all
    steps = [[next((s for s in n["steps"] if s["outer_step"] == k), {}) for n in nodes] for k in range(outer_steps)]
    agree = all(len({r.get("state_sha256") for r in rows}) == 1 for rows in steps)
    full = sum(all((r.get("group_size") or 0) >= len(nodes) for r in rows) for rows in steps)
    averaging = sum(s.get("bytes_sent") or 0 for n in metrics["nodes"] for s in n["steps"])
    last = (run_dir / "bootstrap.out").read_text().strip().splitlines()[-1]
    relayed = json.loads(last).get("relayed_bytes", 0)
    losses = [r.get("eval_loss") for r in (steps[0][0], steps[-1][0])]
    return {"run": name, "homes": RUNS[name], "nodes": len(nodes), "agree": agree, "full_rounds": full,
            "outer_steps": outer_steps, "reach": [n.get("reach") for n in nodes], "loss_first": losses[0],
            "loss_last": losses[1], "averaging_MB": round(averaging / 1e6, 2), "relayed_MB": round(relayed / 1e6, 2),
            "relay_share": round(relayed / averaging, 4) if averaging else None,
            "wall_s": metrics.get("wall_s"), "newcomer_lag": [lag(n) for n in newcomers],
            **punches(run_dir, metrics["nodes"], RUNS[name])}  # fmt: skip


def lag(node: dict[str, Any]) -> int | None:
    """Outer steps from the state a newcomer started training from to its first round with others."""
    grouped = [s["outer_step"] for s in node["steps"] if (s.get("group_size") or 0) > 1]
    joined = node.get("joined_at_step")
    return None if not grouped or joined is None else min(grouped) - joined


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=",".join([*RUNS, "links"]), help=f"which of {', '.join(RUNS)}, links")
    parser.add_argument("--outer-steps", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args()
    if (problem := missing_nat()) is not None:
        raise SystemExit(f"scripts.bench.nat {problem}")
    with tempfile.TemporaryDirectory(prefix="bench-nat-") as root:
        rows = [measure_links() if name == "links" else measure(name, args.outer_steps, Path(root))
                for name in args.runs.split(",")]  # fmt: skip
    if args.json:
        print(json.dumps({"bench": "nat", "rows": rows}))
        return
    columns = ("run", "agree", "full_rounds", "loss_first", "loss_last", "averaging_MB", "relayed_MB", "relay_share",
               "cone_pairs", "punched", "first_try", "symmetric_relayed", "wall_s")  # fmt: skip
    print("  ".join(columns))
    for row in rows:
        if row["run"] != "links":
            print("  ".join(str(row[c]) for c in columns))
    for row in rows:
        if row["run"] == "links":
            print("  ".join(f"{k} {v}" for k, v in row.items()))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
