"""All-reduce benchmark: groups of n members, one process each, on 127.0.0.1.

For each group size n (default 2, 4, 8), vector size (16M, 64M fp32 elements) and codec (none,
fp16, int8): n worker processes each hold a seeded random vector; a group of all of them (equal
bandwidths, equal weights) runs `--repeats` rounds of swarm's butterfly all-reduce. Reported:
the round time (median; a round ends when its last member has its result), the bytes each
member wrote to its sockets (frame headers included; median over members) against the ideal
2(n-1)/n x the encoded vector, and the relative RMS error of the result against the exact fp32
mean. Matchmaking is not timed (it is the DHT's cost, measured by bench_dht.py). In the same run:
the raw loopback throughput (plain Python sockets, as in bench_p2p.py). With --compare hivemind
the same configurations run on hivemind's DecentralizedAverager (scripts/compare/allreduce.py).
`--aggregators mean,robust` measures the part owners' rules one after the other (the
robust reduction's cost is robust's round time against mean's); "robust+audit" adds the owner
audit (audit/flat.py), which the other names leave off; "+whole" (e.g. "mean+whole") has each
owner answer only once its whole part is reduced, instead of chunk by chunk as the senders'
bytes arrive (AveragingConfig.stream_parts); "+paced" has each member cap its sending to each
peer at its share of its measured upload (bandwidth.LinkEstimate.pace, p2p/pacing.py, as
`swarm-node --bandwidth auto` does), after one unmeasured round that measures it.

`--link RATE` (as root) puts each member in a network namespace of its own behind a link shaped
to RATE both ways (swarm.netlab, as `swarm-sim --link`), instead of 127.0.0.1; the table then
gives the link bound 2(n-1)/n x payload / rate beside each round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from scripts.tools import worker_process
from scripts.tools.worker_process import WorkerProcess, sha256_hex
from swarm.averaging.config import AGGREGATORS
from swarm.utils.process_control import exit_on_sigterm

MARK = "BENCH_ALLREDUCE "
BYTES_PER_ELEMENT = {"none": 4, "fp16": 2, "int8": 1}
EXTRAS = {"audit", "whole", "paced"}  # "+audit", "+whole", "+paced" after a rule (module docstring)


def make_input(seed: int, index: int, elements: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(seed * 1000 + index)
    return torch.randn(elements, generator=gen)


def parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


# --- worker process: one group member -----------------------------------------------------------


async def worker_main(host_ip: str) -> None:
    import msgpack
    import torch

    from swarm.averaging.config import AveragingConfig
    from swarm.averaging.messages import GroupInfo
    from swarm.averaging.rounds.flat import AllReduceRound
    from swarm.averaging.rounds.registry import RoundRegistry
    from swarm.p2p import P2PConfig, P2PHost

    torch.set_num_threads(1)  # n members share 2 cores
    loop = asyncio.get_running_loop()
    config = P2PConfig(host_maddrs=(f"/ip4/{host_ip}/tcp/0",))
    async with P2PHost(config=config) as host:
        registry: RoundRegistry | None = None
        reply({"peer_id": host.peer_id.to_bytes().hex(), "maddr": host.visible_maddrs[0]})
        vector, vector_key = None, None
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            cmd = json.loads(line)
            aggregator, *extras = cmd["aggregator"].split("+")
            avg_config = AveragingConfig(codec=cmd["codec"], aggregator=aggregator, audit="audit" in extras,
                                         measure_bandwidth=True,
                                         stream_parts="whole" not in extras,
                                         part_timeout=60.0, request_timeout=30.0)  # fmt: skip
            if registry is None:
                registry = RoundRegistry(host, avg_config)
            registry.config = avg_config
            registry.forget_finished()  # the orchestrator's barrier: every member is done with them
            group = GroupInfo.decode(msgpack.unpackb(bytes.fromhex(cmd["group"]), raw=False))
            key = (cmd["seed"], cmd["elements"])
            if vector_key != key:
                vector, vector_key = make_input(cmd["seed"], group.index_of(host.peer_id), cmd["elements"]), key
            sent_before, received_before = host.traffic.sent, host.traffic.received
            started, cpu_started = time.perf_counter(), time.process_time()
            upload = cmd.get("upload")  # bytes/s to pace our sending by (bandwidth.LinkEstimate.pace), or None
            result, report = await AllReduceRound(host, registry, group, vector, avg_config, upload=upload).run()
            seconds = time.perf_counter() - started
            cpu_s = time.process_time() - cpu_started
            answer = {
                "seconds": seconds,
                "cpu_s": cpu_s,
                "wire_sent": host.traffic.sent - sent_before,
                "wire_received": host.traffic.received - received_before,
                "sha256": await asyncio.to_thread(sha256_hex, result),
                "up": report.up,  # the streams' (bytes, seconds): bench_bandwidth's estimates
                "down": report.down,
                "busy": report.busy,
            }
            if cmd.get("save"):
                await asyncio.to_thread(torch.save, result, cmd["save"])
            reply(answer)


def observe(estimate: Any, answer: dict[str, Any], upload: float | None) -> None:
    """A member's LinkEstimate takes what its round (`answer`, paced by `upload`) measured."""
    up, down = [tuple(x) for x in answer["up"]], [tuple(x) for x in answer["down"]]
    estimate.observe(up, down, answer["busy"], paced=upload is not None)


def reply(obj: dict[str, Any]) -> None:
    worker_process.reply(MARK, obj)


def measure_swarm(
    n: int,
    elements_list: list[int],
    codecs: list[str],
    repeats: int,
    seed: int,
    aggregator: str = "robust",
    link: str | None = None,
) -> list[dict[str, Any]]:
    import msgpack
    import torch

    from swarm.averaging.config import AveragingConfig
    from swarm.averaging.messages import GroupInfo, MemberInfo
    from swarm.averaging.rounds.bandwidth import LinkEstimate
    from swarm.p2p import PeerID
    from swarm_kernels import get_codec

    paced = "paced" in aggregator.split("+")[1:]
    estimates = [LinkEstimate() for _ in range(n)]  # each member's, as its Averager keeps it
    lab, rate = None, None
    if link is not None:
        from swarm.netlab import Lab, exec_prefix, parse_rate

        rate = parse_rate(link)
        lab = Lab.create(f"allreduce{n}", [(f"m{i}", rate) for i in range(n)])
    workers: list[WorkerProcess] = []
    rows = []
    try:
        for i in range(n):
            if lab is None:
                workers.append(WorkerProcess("scripts.bench.allreduce", ["--_worker"], MARK, f"member {i}"))
            else:
                endpoint = lab.endpoint(f"m{i}")
                workers.append(WorkerProcess("scripts.bench.allreduce", ["--_worker", "--_host", endpoint.address],
                                             MARK, f"member {i}", prefix=exec_prefix(endpoint)))  # fmt: skip
        hello = [w.receive(60) for w in workers]
        members = tuple(
            MemberInfo(PeerID(bytes.fromhex(h["peer_id"])), (h["maddr"],), 1.0, 100.0, False) for h in hello
        )
        step = 0
        for elements in elements_list:
            exact = torch.zeros(elements, dtype=torch.float64)  # summed one input at a time: memory
            for i in range(n):
                exact += make_input(seed, i, elements)
            exact /= n
            for codec in codecs:
                times, sent, received, cpu, hashes = [], [], [], [], set()
                paced_rounds = 0
                with tempfile.TemporaryDirectory() as tmp:
                    saved = os.path.join(tmp, "result.pt")
                    for r in range(-1 if paced else 0, repeats):  # r = -1: the round that measures the links
                        step += 1
                        group = GroupInfo.create("bench", step, members)
                        packed = msgpack.packb(group.encode(), use_bin_type=True).hex()
                        uploads = [e.pace() if paced else None for e in estimates]
                        for i, w in enumerate(workers):
                            last = r == repeats - 1 and i == 0
                            w.send({"group": packed, "codec": codec, "seed": seed, "elements": elements,
                                    "aggregator": aggregator, "save": saved if last else None,
                                    "upload": uploads[i]})  # fmt: skip
                        answers = [w.receive(900) for w in workers]
                        for e, a, upload in zip(estimates, answers, uploads, strict=True):
                            observe(e, a, upload)
                        if r < 0:
                            continue
                        times.append(max(a["seconds"] for a in answers))
                        paced_rounds += all(u is not None for u in uploads)
                        sent += [a["wire_sent"] for a in answers]
                        received += [a["wire_received"] for a in answers]
                        cpu += [a["cpu_s"] for a in answers]
                        hashes |= {a["sha256"] for a in answers}  # identical on every member and every run
                    result = torch.load(saved)
                if len(hashes) != 1:
                    raise RuntimeError(f"members disagree: {len(hashes)} different results (n={n}, {codec})")
                payload = get_codec(codec, block_size=AveragingConfig().block_size).encoded_nbytes(elements)
                ideal = 2 * (n - 1) / n * payload
                rows.append({
                    "link": link, "link_bound_s": ideal / rate.bytes_per_s if rate is not None else None,
                    "impl": "swarm", "n": n, "elements": elements, "codec": codec, "aggregator": aggregator,
                    "round_s": statistics.median(times), "round_s_all": times, "paced_rounds": paced_rounds,
                    "wire_bytes_per_member": statistics.median(sent),
                    "wire_received_per_member": statistics.median(received),
                    "cpu_s_per_member": statistics.median(cpu),
                    "ideal_bytes_per_member": ideal,
                    "rel_rms_err": ((result.double() - exact).norm() / exact.norm()).item(),
                })  # fmt: skip
    finally:
        for w in workers:
            w.close()
        if lab is not None:
            lab.close()
    return rows


def loopback_mbps() -> float:
    from scripts.bench.p2p import measure_raw

    return measure_raw(rpc_calls=10, stream_bytes=256 << 20)["stream_MBps"]


def print_table(loopback: float, rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    where = f"on {rows[0]['link']} links" if rows and rows[0].get("link") else "on 127.0.0.1"
    table = Table(title=f"All-reduce, one process per member {where} (raw loopback {loopback:,.0f} MB/s)")
    columns = ["impl", "n", "elements", "codec", "rule", "round s", "link bound s", "wire MB / member", "vs ideal",
               "rel RMS err"]  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    theirs = {(r["n"], r["elements"], r["codec"]): r for r in rows if r["impl"] == "hivemind"}
    for row in rows:
        wire, ideal = row["wire_bytes_per_member"], row["ideal_bytes_per_member"]
        table.add_row(
            row["impl"], str(row["n"]), f"{row['elements'] / 2**20:.0f}M", row["codec"], row.get("aggregator", "mean"),
            f"{row['round_s']:.2f}", f"{row['link_bound_s']:.2f}" if row.get("link_bound_s") else "-",
            f"{wire / 1e6:,.1f}", f"{wire / ideal:.3f}", f"{row['rel_rms_err']:.2%}",
        )  # fmt: skip
    Console().print(table)
    for row in rows:
        if row.get("bad_rounds"):
            config = f"n={row['n']} {row['elements'] / 2**20:.0f}M {row['codec']}"
            print(f"hivemind {config}: {len(row['bad_rounds'])} rounds returned a wrong average (not counted, re-run)")
    for row in rows:
        other = theirs.get((row["n"], row["elements"], row["codec"]))
        if row["impl"] == "swarm" and other:
            speedup = other["round_s"] / row["round_s"]
            error_ratio = row["rel_rms_err"] / other["rel_rms_err"] if other["rel_rms_err"] else float("nan")
            print(f"n={row['n']} {row['elements'] / 2**20:.0f}M {row['codec']}: hivemind / swarm round time "
                  f"{speedup:.1f}x, swarm / hivemind error {error_ratio:.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2,4,8", help="group sizes")
    parser.add_argument("--elements", default="16M,64M")
    parser.add_argument("--codecs", default="none,fp16,int8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--aggregators", default="robust",
                        help="part owners' rule(s): robust, mean, robust+audit; +whole: not streamed")  # fmt: skip
    parser.add_argument("--compare", choices=["hivemind"])
    parser.add_argument("--link", metavar="RATE", help="each member on its own link of RATE (e.g. 100mbit; root)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--_host", default="127.0.0.1", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._worker:
        from swarm.utils.eventloop import run

        run(worker_main(args._host))
        return
    for name in args.aggregators.split(","):
        rule, *extras = name.split("+")
        if rule not in AGGREGATORS or not set(extras) <= EXTRAS:
            parser.error(f"--aggregators: {name!r} is not a rule of {AGGREGATORS} with extras from {sorted(EXTRAS)}")
    if args.link is not None:
        from swarm.netlab import missing, parse_rate

        try:
            parse_rate(args.link)
        except ValueError as e:
            parser.error(str(e))
        if (lacking := missing()) is not None:
            parser.error(f"--link {lacking}")
    exit_on_sigterm()
    sizes = [int(x) for x in args.sizes.split(",")]
    elements = [parse_count(x) for x in args.elements.split(",")]
    codecs = args.codecs.split(",")
    if any(c not in BYTES_PER_ELEMENT for c in codecs) or any(n < 2 for n in sizes):
        parser.error(f"codecs are {list(BYTES_PER_ELEMENT)}; group sizes are >= 2")
    rows: list[dict[str, Any]] = []
    for n in sizes:
        for aggregator in args.aggregators.split(","):
            rows += measure_swarm(n, elements, codecs, args.repeats, args.seed, aggregator, args.link)
    if args.compare:
        from scripts.compare.allreduce import run_hivemind_allreduce

        for n in sizes:
            for count in elements:
                for codec in codecs:
                    rows.append(
                        run_hivemind_allreduce(n, count, codec, repeats=args.repeats, seed=args.seed, max_bad_rounds=2)
                    )
    loopback = loopback_mbps()
    if args.json:
        print(json.dumps({"loopback_MBps": loopback, "rows": rows}))
    else:
        print_table(loopback, rows)


if __name__ == "__main__":
    main()
