"""Split by measured bandwidth or equally, on shaped links: what each costs a group with a slow member.

n members (`bench_allreduce`'s workers, one process each), each in a network namespace of its own
behind a link of its own rate (`--links 100mbit,100mbit,100mbit,10mbit`, both ways; swarm.netlab,
needs root), run flat int8 all-reduce rounds of `--elements` fp32:

  equal      every member announces the same bandwidth (swarm-node's default)
  measured   each member announces what its earlier rounds measured (averaging/bandwidth.py,
             `swarm-node --bandwidth auto`); the first round, with nothing measured, is equal
  paced      the same, and each member caps its sending to each peer at its share of its
             measured upload (bandwidth.LinkEstimate.pace, p2p/pacing.py), as swarm-node does
  links      each member announces its link's true rate (`swarm-node --bandwidth 1.25` on a
             10 Mbit/s link): what a perfect estimate would give

Reported per split: the round time (median over the rounds after the first), the shares of the
vector each member owned, and two figures from the links' rates alone, for a payload of E bytes:

  phased bound   the round if each member's upload of its slices and download of the results run
                 one after the other (an owner answers once every slice is in, as today):
                 max over members of 2 x max(1 - p, (n - 1) p) x E / rate
  overlapped     the same if both phases overlapped (an owner answering chunk by chunk):
                 max over members of (1 + (n - 2) p) x E / rate
  optimal        the overlapped bound of the best shares for these links (the issue's
                 "bandwidth-optimal split"): at least max E / rate, whatever the split

    python -m scripts.bench.bandwidth --links 100mbit,100mbit,100mbit,10mbit --elements 4M [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from typing import Any

from scripts.bench.allreduce import MARK, observe, parse_count
from scripts.tools.worker_process import WorkerProcess
from swarm.utils.process_control import exit_on_sigterm

SPLITS = ("equal", "measured", "paced", "links")
ANNOUNCED = 100.0  # MB/s everyone announces in the equal split (AveragingConfig's default)


def phased_round_s(payload: float, rates: Sequence[float], shares: Sequence[float]) -> float:
    """Seconds of a round whose two phases run one after the other (module docstring)."""
    n = len(rates)
    return max(2 * max(1 - p, (n - 1) * p) * payload / r for p, r in zip(shares, rates, strict=True))


def overlapped_round_s(payload: float, rates: Sequence[float], shares: Sequence[float]) -> float:
    """Seconds of the same round with both phases overlapped."""
    n = len(rates)
    return max((1 + (n - 2) * p) * payload / r for p, r in zip(shares, rates, strict=True))


def optimal_overlapped_s(payload: float, rates: Sequence[float]) -> float:
    """The smallest overlapped_round_s over all shares (bisection on the round time T: member i
    can own at most (T rate_i / E - 1) / (n - 2) of the vector)."""
    n, slowest = len(rates), payload / min(rates)
    if n <= 2:
        return slowest
    lo, hi = slowest, (1 + (n - 2)) * payload / min(rates)
    for _ in range(100):
        mid = (lo + hi) / 2
        if sum(max(0.0, (mid * r / payload - 1) / (n - 2)) for r in rates) >= 1:
            hi = mid
        else:
            lo = mid
    return hi


def shares_of(numel: int, bandwidths: Sequence[float], block_size: int) -> list[float]:
    """Each member's share of the vector, as the round splits it (capped, block-aligned)."""
    from swarm.averaging.rounds.partition import capped_bandwidths, part_bounds

    return [(hi - lo) / numel for lo, hi in part_bounds(numel, capped_bandwidths(bandwidths), block_size)]


def measure(links: Sequence[str], elements: int, rounds: int, seed: int) -> list[dict[str, Any]]:
    import msgpack

    from swarm.averaging.config import AveragingConfig
    from swarm.averaging.messages import GroupInfo, MemberInfo
    from swarm.averaging.rounds.bandwidth import LinkEstimate
    from swarm.netlab import Lab, exec_prefix, parse_rate
    from swarm.p2p import PeerID
    from swarm_kernels import get_codec

    rates = [parse_rate(text) for text in links]
    n = len(rates)
    block = AveragingConfig().block_size
    payload = get_codec("int8", block_size=block).encoded_nbytes(elements)
    rows, step = [], 0
    lab = Lab.create(f"bandwidth{n}", [(f"m{i}", rate) for i, rate in enumerate(rates)])
    workers: list[WorkerProcess] = []
    try:
        for i in range(n):
            endpoint = lab.endpoint(f"m{i}")
            workers.append(WorkerProcess("scripts.bench.allreduce", ["--_worker", "--_host", endpoint.address], MARK,
                                         f"member {i}", prefix=exec_prefix(endpoint)))  # fmt: skip
        hello = [w.receive(120) for w in workers]
        for split in SPLITS:
            estimates = [LinkEstimate() for _ in range(n)]
            times, announced = [], []
            for _ in range(rounds + 1):
                step += 1
                bandwidths = [
                    e.announced_mb_s(ANNOUNCED) if split in ("measured", "paced")
                    else r.bytes_per_s / 1e6 if split == "links"
                    else ANNOUNCED for e, r in zip(estimates, rates, strict=True)
                ]  # fmt: skip
                uploads = [e.pace() if split == "paced" else None for e in estimates]
                members = tuple(MemberInfo(PeerID(bytes.fromhex(h["peer_id"])), (h["maddr"],), 1.0, b, False)
                                for h, b in zip(hello, bandwidths, strict=True))  # fmt: skip
                packed = msgpack.packb(GroupInfo.create("bench", step, members).encode(), use_bin_type=True).hex()
                for w, upload in zip(workers, uploads, strict=True):
                    w.send({"group": packed, "codec": "int8", "seed": seed, "elements": elements,
                            "aggregator": "robust", "save": None, "upload": upload})  # fmt: skip
                answers = [w.receive(900) for w in workers]
                if len({a["sha256"] for a in answers}) != 1:
                    raise RuntimeError(f"{split}: members disagree")
                for e, a, upload in zip(estimates, answers, uploads, strict=True):
                    observe(e, a, upload)
                times.append(max(a["seconds"] for a in answers))
                announced.append(bandwidths)
            last = announced[-1]
            shares = shares_of(elements, last, block)
            link_rates = [r.bytes_per_s for r in rates]
            rows.append({
                "split": split, "links": list(links), "elements": elements, "payload_bytes": payload,
                "round_s": statistics.median(times[1:]), "round_s_all": times, "announced_mb_s": last,
                "shares": shares, "phased_bound_s": phased_round_s(payload, link_rates, shares),
                "overlapped_bound_s": overlapped_round_s(payload, link_rates, shares),
                "optimal_bound_s": optimal_overlapped_s(payload, link_rates),
            })  # fmt: skip
    finally:
        for w in workers:
            w.close()
        lab.close()
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    first = rows[0]
    table = Table(title=f"int8 all-reduce of {first['elements'] / 2**20:g}M fp32 over links {','.join(first['links'])}")
    for column in ("split", "round s", "phased bound s", "overlapped bound s", "x optimal", "announced MB/s", "shares"):
        table.add_column(column, justify="right")
    for r in rows:
        announced = " ".join(f"{b:.1f}" for b in r["announced_mb_s"])
        shares = " ".join(f"{p:.2f}" for p in r["shares"])
        times = (r["round_s"], r["phased_bound_s"], r["overlapped_bound_s"])
        optimal = f"{r['round_s'] / r['optimal_bound_s']:.2f} of {r['optimal_bound_s']:.2f} s"
        table.add_row(r["split"], *(f"{t:.2f}" for t in times), optimal, announced, shares)
    Console(width=160).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--links", required=True, help="one rate per member, e.g. 100mbit,100mbit,100mbit,10mbit")
    parser.add_argument("--elements", default="4M", help="fp32 elements per member (K/M suffixes)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per split after the first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from swarm.netlab import missing, parse_rates

    try:
        links = [str(rate) for rate in parse_rates(args.links)]
    except ValueError as e:
        parser.error(str(e))
    if len(links) < 2 or args.rounds < 1:
        parser.error("--links needs two members or more, --rounds at least 1")
    if (lacking := missing()) is not None:
        parser.error(f"--links {lacking}")
    exit_on_sigterm()
    rows = measure(links, parse_count(args.elements), args.rounds, args.seed)
    if args.json:
        print(json.dumps({"rows": rows}))
    else:
        print_table(rows)


if __name__ == "__main__":
    main()
