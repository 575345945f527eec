"""DiLoCo benchmark: a swarm of `swarm-node`s on 127.0.0.1 against data parallelism.

One workload for everything (`diloco_sim.Workload`: model tiny, the built-in corpus, 2 sequences
of 256 tokens per node and inner step, 1,000 inner steps per node by default):

    swarm   4 `swarm-node` processes (fixed identities, one torch thread each) and a bootstrap
            `swarm-dht serve`, for each configuration: H 50 / 100 x int8 / fp32 (`--compression
            none`) pseudo-gradients; every node runs --steps / H outer steps, then exits
    ddp     one process, the same AdamW, the 4 nodes' batches concatenated (global batch 8):
            what an ideal data-parallel run sees for the same number of optimizer steps
    alone   one process, node 0's batches alone

Node i samples its windows with node_generator(PeerID_i, global inner step), so the baselines
replay the same windows (`diloco_sim.train_data_parallel`, run in this process).

Reported per configuration: the final eval loss (the same 64 windows of the held-out split;
the nodes' θ must end bit-identical, checked by their state hashes), its ratio to DDP's, the share
of the DDP/alone gap it closes, (L_alone - L_diloco) / (L_alone - L_ddp); the bytes each node sent
in its all-reduce rounds (summed over the run; mean over nodes; DHT and matchmaking traffic are
not in the nodes' metrics) against a data-parallel fp32 ring all-reduce of the gradients at every
optimizer step, 2(n-1)/n x 4 bytes x parameters x steps (the reduction factor; INTELLECT-1
reports 400x at H 100 with int8); the compute utilization, inner-step seconds / training wall
seconds from each node's metrics (mean over nodes; the wall seconds from the first step, which
`--start-with` holds until every node is live, to the last, less the seconds in evals); and the
share of outer steps that every node spent in a full group (a node alone for a step applies its
own pseudo-gradient).
With --repeat R each swarm configuration runs R times and the medians are reported (the swarm is
not deterministic: group timing varies); the baselines are deterministic and run once.

    python -m scripts.bench.diloco                        # all four configurations, 1,000 steps
    python -m scripts.bench.diloco --steps 100 --configs H50_int8 --json
    python -m scripts.bench.diloco --nodes 2 --batch-size 4 --steps 100 --configs H50_int8 --nproc-per-node 2
    sudo python -m scripts.bench.diloco --link 20mbit --configs H50_int8   # on shaped links
    python -m scripts.bench.diloco --steps 300 --configs H50_int8 --busy 8  # quiet, then beside 8 busy processes

`--link RATE` (as root) puts each swarm-node and the bootstrap `swarm-dht serve` in a network
namespace of its own behind a link shaped to RATE both ways (swarm.netlab, as `swarm-sim --link`;
no added delay: tbf, no netem), each listening on its address there instead of 127.0.0.1;
`--links R1,R2,...` gives node i the i-th rate (the bootstrap gets the fastest). The DDP and
alone baselines run in this process as always. Each swarm run builds its links and removes them
when it ends, pass or fail. Every table gives the all-reduce's round time (per node the median
over its outer steps, then the mean over nodes; on 127.0.0.1 too); with links also the link bound
beside it: what the node that moves the most per step (sent or received, frames included) needs
through its own link, max over nodes of bytes / rounds / rate. The JSON gains "link" (node i's
rate, or null on 127.0.0.1), "round_s" and "round_bound_s".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from scripts.bench.busy_machine import busy_lines, busy_results, group_misses
from scripts.experiments.diloco_sim import Workload, gap_closed, node_identity
from scripts.experiments.diloco_sweep import Cache, run_baselines
from scripts.tools.hiccup import Hiccup
from swarm.model.schedule import SCHEDULES
from swarm.netlab import Lab, Rate, missing, parse_rate, parse_rates
from swarm.utils import process_control
from swarm.utils.process_control import console_script

CONFIGS = ("H50_int8", "H50_none", "H100_int8", "H100_none")
COMPRESSIONS = ("int8", "int4", "int2", "fp16", "none")  # swarm-node's --compression codecs
STOP_GRACE_S = 10.0
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


@dataclass(frozen=True, slots=True)
class SwarmConfig:
    """One swarm configuration, named
    H<inner steps>_<--compression>[_ef<--error-feedback>][_f<--fragments>][_<--overlap>[_mm]][_fetchstate][_bwfixed]:
    "H50_int8", "H100_int4:0.25", "H100_int2_ef1", "H50_int8_eager", "H50_int8_f5_eager". With
    fragments P, H is each fragment's (swarm-node --fragments P --inner-steps H/P): the same H as
    the configuration without them. `_mm`: --overlap-matchmaking. `_fetchstate`: --catch-up state
    (a node that missed a group fetches the whole state, not the step's update). `_bwfixed`:
    --bandwidth 100 (every node announces the same, and no round is paced; the default before
    --bandwidth auto, which measures bandwidths and paces rounds by them)."""

    name: str
    inner_steps: int  # swarm-node's --inner-steps (H / fragments)
    compression: str  # swarm-node's --compression: CODEC[:DENSITY]
    error_feedback: float = 0.0  # swarm-node's --error-feedback (0: off)
    overlap: str = "none"  # swarm-node's --overlap: none (blocking), eager, delayed
    fragments: int = 1  # swarm-node's --fragments
    catch_up: str = "update"  # swarm-node's --catch-up
    overlap_matchmaking: bool = False  # swarm-node's --overlap-matchmaking
    bandwidth_fixed: bool = False  # swarm-node's --bandwidth 100 (else its default: auto)

    @classmethod
    def parse(cls, name: str) -> SwarmConfig:
        from swarm.model.compression_spec import CompressionSpec
        from swarm.node.config import OVERLAP_MODES

        h, _, rest = name.partition("_")
        compression, *extras = rest.split("_")
        modes = [m for m in OVERLAP_MODES if m != "none"]
        usage = (f"use H<inner steps>_<{'|'.join(COMPRESSIONS)}>[:DENSITY][_ef<DECAY>][_f<FRAGMENTS>]"
                 f"[_{'|'.join(modes)}[_mm]][_fetchstate][_bwfixed], e.g. H50_int8, H100_int4_ef1, "
                 "H50_int8_f5_eager, H50_int8_f8_eager_mm, H50_int8_fetchstate, H50_int8_bwfixed")  # fmt: skip
        if not (h.startswith("H") and h[1:].isdigit() and int(h[1:]) > 0):
            raise ValueError(f"bad configuration {name!r}: {usage}")
        bandwidth_fixed = bool(extras) and extras[-1] == "bwfixed"
        if bandwidth_fixed:
            extras.pop()
        catch_up = "update"
        if extras and extras[-1] == "fetchstate":
            extras.pop()
            catch_up = "state"
        matchmaking = bool(extras) and extras[-1] == "mm"
        if matchmaking:
            extras.pop()
        overlap = extras.pop() if extras and extras[-1] in modes else "none"
        if matchmaking and overlap == "none":
            raise ValueError(f"bad configuration {name!r}: _mm overlaps matchmaking, after an overlap mode; {usage}")
        fragments = 1
        if extras and extras[-1].startswith("f") and extras[-1][1:].isdigit():
            fragments = int(extras.pop()[1:])
            if not 1 <= fragments <= int(h[1:]) or int(h[1:]) % fragments:
                raise ValueError(f"bad configuration {name!r}: H must be a multiple of the fragments; {usage}")
        if len(extras) > 1 or (extras and not extras[0].startswith("ef")):
            raise ValueError(f"bad configuration {name!r}: {usage}")
        feedback = extras[0] if extras else ""
        try:
            CompressionSpec.parse(compression, COMPRESSIONS)
            decay = float(feedback.removeprefix("ef")) if feedback else 0.0
        except ValueError as e:
            raise ValueError(f"bad configuration {name!r}: {e}; {usage}") from None
        if feedback and not 0.0 < decay <= 1.0:
            raise ValueError(f"bad configuration {name!r}: error feedback is ef<decay in (0, 1]>; {usage}")
        return cls(name, int(h[1:]) // fragments, compression, decay, overlap, fragments, catch_up, matchmaking,
                   bandwidth_fixed)  # fmt: skip

    def labels(self) -> dict[str, Any]:
        """The keys issues 15 and 14 add to each row: the codec, the density, the error feedback,
        the mode of the outer step (blocking, or overlapped eager or delayed)."""
        from swarm.model.compression_spec import CompressionSpec

        spec = CompressionSpec.parse(self.compression, COMPRESSIONS)
        mode = "blocking" if self.overlap == "none" else self.overlap
        return {"codec": spec.codec, "density": spec.density, "error_feedback": self.error_feedback, "mode": mode,
                "fragments": self.fragments, "catch_up": self.catch_up,
                "overlap_matchmaking": self.overlap_matchmaking,
                "bandwidth": "fixed" if self.bandwidth_fixed else "auto"}  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeOptions:
    """What every node of a run gets besides its identity (the inner optimizer matches the baselines)."""

    lr: float
    warmup_steps: int
    outer_lr: float | None  # None: the node's default
    outer_momentum: float | None
    matchmaking_time: float | None  # None: the node's default
    verbose: bool
    nproc: int = 1  # --nproc-per-node: local ranks of each node (scripts/bench/ranks.py)


# --- processes ----------------------------------------------------------------------------------


def spawn(args: list[str], log: IO[bytes] | None, stdout: int | IO[bytes] | None = None,
          netns: str | None = None) -> subprocess.Popen[bytes]:  # fmt: skip
    """A child in the network namespace `netns` (None: ours): a node is forked and enters it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return process_control.start(args, stdout=stdout if stdout is not None else log, stderr=log, env=env, netns=netns)


def schedule_flags(workload: Workload) -> list[str]:
    """swarm-node's flags for the workload's inner schedule (the baselines' too)."""
    schedule = workload.schedule()
    flags = ["--lr-schedule", schedule["lr_schedule"]]
    if schedule["total_steps"] is not None:
        flags += ["--total-steps", str(schedule["total_steps"]), "--min-lr-ratio", repr(schedule["min_lr_ratio"]),
                  "--decay-fraction", repr(schedule["decay_fraction"])]  # fmt: skip
    return flags


def node_args(
    workload: Workload, config: SwarmConfig, options: NodeOptions, workdir: Path, index: int, peers: Sequence[str],
    listen: str = LOOPBACK,
) -> list[str]:  # fmt: skip
    args = [
        console_script("swarm-node"),
        *(arg for maddr in peers for arg in ("--initial-peers", maddr)),
        "--host-maddrs", listen,
        "--identity", str(workdir / f"node{index}.key"),
        "--run-id", f"bench-diloco-{config.name}",
        "--model", workload.model,
        "--inner-steps", str(config.inner_steps),
        "--batch-size", str(workload.batch_size),
        "--seq-len", str(workload.seq_len),
        "--lr", repr(options.lr),
        "--warmup-steps", str(options.warmup_steps),
        *schedule_flags(workload),
        "--compression", config.compression,
        *(["--error-feedback", repr(config.error_feedback)] if config.error_feedback else []),
        *(["--overlap", config.overlap] if config.overlap != "none" else []),
        *(["--overlap-matchmaking"] if config.overlap_matchmaking else []),
        *(["--fragments", str(config.fragments)] if config.fragments > 1 else []),
        *(["--catch-up", config.catch_up] if config.catch_up != "update" else []),
        *(["--bandwidth", "100"] if config.bandwidth_fixed else []),
        "--max-outer-steps", str(workload.steps // config.inner_steps),
        "--start-with", str(workload.workers),  # the run begins once every node is up (costly ids take seconds)
        "--seed", str(workload.seed),
        "--threads", "1",
        "--metrics-file", str(workdir / f"node{index}.jsonl"),
        "--eval-every", str(workload.steps // config.inner_steps),
        "--eval-windows", str(workload.eval_windows),
    ]  # fmt: skip
    if options.outer_lr is not None:
        args += ["--outer-lr", repr(options.outer_lr)]
    if options.outer_momentum is not None:
        args += ["--outer-momentum", repr(options.outer_momentum)]
    if options.matchmaking_time is not None:
        args += ["--matchmaking-time", repr(options.matchmaking_time)]
    if options.nproc > 1:
        args += ["--nproc-per-node", str(options.nproc), "--device", "cpu"]
    return args + (["-v"] if options.verbose else [])


def node_rates(workers: int, link: Rate | None, links: Sequence[Rate] | None) -> list[Rate] | None:
    """Each node's link: --links one per node, --link the same for all; None on 127.0.0.1."""
    if links is not None:
        if len(links) != workers:
            raise ValueError(f"--links has {len(links)} rate(s) for {workers} nodes: give one per node (--nodes)")
        return list(links)
    return None if link is None else [link] * workers


def place(lab: Lab | None, name: str, rate: Rate | None) -> tuple[str | None, str]:
    """(network namespace, listen multiaddr) of a child: ours and 127.0.0.1, or a new endpoint
    of the lab."""
    if lab is None or rate is None:
        return None, LOOPBACK
    endpoint = lab.add(name, rate)
    return endpoint.netns, f"/ip4/{endpoint.address}/tcp/0"


def run_swarm(
    workload: Workload, config: SwarmConfig, options: NodeOptions, timeout: float, keep: Path | None,
    rates: Sequence[Rate] | None = None, hiccup: Hiccup | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One swarm run: a bootstrap DHT node and `workers` training nodes until they exit; the
    summary of their metrics files. With `rates` (one per node) each child runs in a namespace
    of its own behind a link of its rate, the bootstrap behind the fastest. `hiccup`: one node
    stops for a while (scripts/tools/hiccup.py)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"bench_diloco_{config.name}_", dir=keep))
    for index in range(workload.workers):
        node_identity(index, workload.seed).save(workdir / f"node{index}.key")
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[IO[bytes]] = []
    lab: Lab | None = None
    started = time.monotonic()
    try:
        if rates is not None:  # a lab per run: a failed run's links go with it
            lab = Lab.create("diloco")
        logs.append(open(workdir / "bootstrap.log", "wb"))  # noqa: SIM115  (closed in finally)
        netns, listen = place(lab, "bootstrap", max(rates) if rates else None)  # DHT traffic: any link will do
        dht_args = [console_script("swarm-dht"), "serve", "--host-maddrs", listen, "--json"]
        procs.append(spawn(dht_args, logs[0], stdout=subprocess.PIPE, netns=netns))
        bootstrap = process_control.read_json_line(procs[0], timeout=60, what="the bootstrap DHT node")["maddrs"]
        for index in range(workload.workers):
            logs.append(open(workdir / f"node{index}.log", "wb"))  # noqa: SIM115
            netns, listen = place(lab, f"node{index}", rates[index] if rates else None)
            args = node_args(workload, config, options, workdir, index, bootstrap, listen)
            procs.append(spawn(args, logs[-1], netns=netns))
        with hiccup.applied(procs[1 + hiccup.node]) if hiccup is not None else contextlib.nullcontext():
            wait_for_nodes(procs[1:], config, time.monotonic() + timeout, workdir)
        wall = time.monotonic() - started
    finally:
        process_control.stop_all(procs, STOP_GRACE_S)  # SIGTERM, SIGKILL after the grace
        for f in logs:
            f.close()
        if lab is not None:  # after the children: a process still inside would keep its namespace
            lab.close()
    summary = summarize(config, [read_metrics(workdir / f"node{i}.jsonl") for i in range(workload.workers)])
    summary["run_s"] = wall
    summary["link"] = None if rates is None else [str(r) for r in rates]
    summary["round_bound_s"] = None if rates is None else round_bound_s(summary, rates)
    if keep is None:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        summary["workdir"] = str(workdir)
    return summary


def wait_for_nodes(nodes: list[subprocess.Popen[bytes]], config: SwarmConfig, deadline: float, workdir: Path) -> None:
    for index, proc in enumerate(nodes):
        try:
            code = proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{config.name}: node {index} still running at the deadline ({workdir})") from None
        if code != 0:
            tail = (workdir / f"node{index}.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{config.name}: node {index} exited with code {code} ({workdir}); log:\n{tail}")


# --- metrics ------------------------------------------------------------------------------------


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise RuntimeError(f"{path} was not written")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(config: SwarmConfig, per_node: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Final eval loss, bytes and utilization of one run, from each node's metrics events
    (`bytes_sent` of an outer_step event is that round's all-reduce traffic: summed here).

    A node's final state is the latest it held: after its last outer step, or fetched from the
    others when it missed a round (on a slow link a node can miss the last round and then fetch
    the swarm's result, a `fetch` event). Such a node's eval loss is the one the others measured
    on the same state (the same θ, the same eval windows)."""
    finals, ends, group_sizes, sent, received, rounds, fetched = [], [], [], [], [], [], []
    for index, events in enumerate(per_node):
        steps = [e for e in events if e.get("event") == "outer_step"]
        if not steps:
            raise RuntimeError(f"{config.name}: node {index} recorded no outer step")
        finals.append(steps[-1])
        held = [(e["outer_step"] + 1, e["state_sha256"], e.get("eval_loss")) for e in steps]  # the state after it
        held += [(e["outer_step"], e["state_sha256"], None) for e in events if e.get("event") == "fetch"]
        ends.append(max(held, key=lambda h: h[0]))  # the latest; a fetch of a step after the last round wins
        fetches = [e for e in events if e.get("event") == "fetch"]
        fetched.append(
            (len(fetches), sum(bool(e.get("by_update")) for e in fetches), sum(e.get("bytes", 0) for e in fetches))
        )
        group_sizes.append([e["group_size"] for e in steps])
        sent.append(sum(e["bytes_sent"] for e in steps))
        received.append(sum(e["bytes_received"] for e in steps))
        rounds.append(statistics.median(e.get("round_s") or 0.0 for e in steps))  # the all-reduce, per step
    measured = {sha: loss for _, sha, loss in ends if loss is not None}
    losses = [loss if loss is not None else measured.get(sha) for _, sha, loss in ends]
    if any(loss is None for loss in losses):
        raise RuntimeError(f"{config.name}: a node has no eval loss at its last outer step: {losses}")
    n = len(per_node)
    return {
        "config": config.name,
        "outer_steps": [step for step, _, _ in ends],
        "rounds": [len(sizes) for sizes in group_sizes],  # outer steps a node averaged (or stepped alone) itself
        "caught_up_by_fetch": [loss is None for _, _, loss in ends],
        "eval_loss": statistics.fmean(losses),
        "eval_losses": losses,
        "states_agree": len({sha for _, sha, _ in ends}) == 1,
        "full_group_share": statistics.fmean(sum(s == n for s in sizes) / len(sizes) for sizes in group_sizes),
        "misses": group_misses(per_node, n),  # each node-step outside a full group, and why
        "fetches": [count for count, _, _ in fetched],  # states taken from peers (a missed group, a newcomer)
        "fetches_by_update": [by_update for _, by_update, _ in fetched],  # of them: by the step's update
        "fetched_bytes": [nbytes for _, _, nbytes in fetched],
        "bytes_sent": sent,
        "bytes_received": received,
        "round_s": rounds,
        "matchmaking_s": [
            sum(e.get("matchmaking_s", 0.0) for e in s if e.get("event") == "outer_step") for s in per_node
        ],
        # the evals (of the final state here) measure the run, they are not part of training
        "utilization": [f["inner_s"] / (f["wall_s"] - f.get("eval_s", 0.0)) for f in finals],
        "tokens_per_s": [f["tokens_per_s"] for f in finals],
    }


def round_bound_s(summary: dict[str, Any], rates: Sequence[Rate]) -> float:
    """The shortest an all-reduce round could take on these links: each node moves what it sent
    (and received) per round it took part in through its own link; the round waits for the slowest."""
    per_node = zip(summary["bytes_sent"], summary["bytes_received"], summary["rounds"], rates, strict=True)
    return max(max(sent, received) / steps / rate.bytes_per_s for sent, received, steps, rate in per_node)


def ring_allreduce_bytes(nodes: int, parameters: int, steps: int) -> float:
    """What each member of an fp32 ring all-reduce sends for `steps` gradient averagings."""
    return 2 * (nodes - 1) / nodes * 4 * parameters * steps


def results(
    workload: Workload, baselines: dict[str, float], runs: dict[str, list[dict[str, Any]]],
    rates: Sequence[Rate] | None = None,
) -> dict[str, Any]:  # fmt: skip
    from swarm.model.llama import count_parameters
    from swarm.model.presets import preset

    ddp, alone = baselines["ddp"], baselines["alone"]
    ring = ring_allreduce_bytes(workload.workers, count_parameters(preset(workload.model)), workload.steps)
    out: dict[str, Any] = {
        "workload": dataclasses.asdict(workload),
        "schedule": workload.schedule(),
        "ddp_eval_loss": ddp,
        "alone_eval_loss": alone,
        "ring_allreduce_bytes_per_node": ring,
        "link": None if rates is None else [str(r) for r in rates],  # node i's link; None: 127.0.0.1
    }
    keys = ("diloco_eval_loss", "ratio_to_ddp", "gap_closed", "bytes_sent_per_node", "reduction_factor")
    labels = ("codec", "density", "error_feedback", "mode", "fragments", "catch_up", "overlap_matchmaking", "bandwidth")
    timing = ("utilization", "round_s", "round_bound_s", "run_s")
    catching_up = ("fetches", "fetches_by_update", "fetched_bytes")  # per run, summed over nodes: the median run
    for key in (*keys, *timing, *catching_up, "full_group_share", "states_agree", *labels):
        out[key] = {}
    for name, repeats in runs.items():
        for key, value in SwarmConfig.parse(name).labels().items():
            out[key][name] = value
        loss = statistics.median(r["eval_loss"] for r in repeats)
        sent = statistics.median(statistics.fmean(r["bytes_sent"]) for r in repeats)
        out["diloco_eval_loss"][name] = loss
        out["ratio_to_ddp"][name] = loss / ddp
        out["gap_closed"][name] = gap_closed(alone, ddp, loss)
        out["bytes_sent_per_node"][name] = sent
        out["reduction_factor"][name] = ring / sent
        out["utilization"][name] = statistics.median(statistics.fmean(r["utilization"]) for r in repeats)
        out["round_s"][name] = statistics.median(statistics.fmean(r["round_s"]) for r in repeats)
        bounds = [r["round_bound_s"] for r in repeats if r.get("round_bound_s") is not None]
        out["round_bound_s"][name] = statistics.median(bounds) if bounds else None
        out["run_s"][name] = statistics.median(r["run_s"] for r in repeats)
        for key in catching_up:
            out[key][name] = statistics.median(sum(r[key]) for r in repeats)
        out["full_group_share"][name] = min(r["full_group_share"] for r in repeats)
        out["states_agree"][name] = all(r["states_agree"] for r in repeats)
    out["runs"] = runs
    return out


def print_table(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    w = res["workload"]
    links = res.get("link")
    where = "127.0.0.1" if not links else f"{links[0]} links" if len(set(links)) == 1 else f"links {','.join(links)}"
    table = Table(
        title=f"DiLoCo on {where}: {w['workers']} nodes, {w['model']}, {w['steps']} inner steps, "
        f"batch {w['batch_size']} x seq {w['seq_len']} per node, {Workload(**w).schedule_label()}"
    )
    columns = (
        "run",
        "eval loss",
        "/ DDP",
        "gap closed",
        "MB sent / node",
        "vs fp32 ring",
        "utilization",
        "round s",
        "link bound s",
        "run s",
        "full groups",
        "fetches (by update)",
    )
    for column in columns:
        table.add_column(column, justify="right")
    table.add_row("DDP (global batch)", f"{res['ddp_eval_loss']:.4f}", "1.000", "100%", *[""] * 8)
    alone_gap = f"{res['alone_eval_loss'] / res['ddp_eval_loss']:.3f}"
    table.add_row("one node alone", f"{res['alone_eval_loss']:.4f}", alone_gap, "0%", *[""] * 8)
    for name, loss in res["diloco_eval_loss"].items():
        agree = "" if res["states_agree"][name] else " (states differ!)"
        table.add_row(
            f"DiLoCo {name}{agree}", f"{loss:.4f}", f"{res['ratio_to_ddp'][name]:.3f}",
            f"{res['gap_closed'][name]:.1%}", f"{res['bytes_sent_per_node'][name] / 1e6:,.2f}",
            f"{res['reduction_factor'][name]:,.0f}x", f"{res['utilization'][name]:.1%}",
            f"{res['round_s'][name]:.2f}", f"{bound:.2f}" if (bound := res["round_bound_s"].get(name)) else "-",
            f"{res['run_s'][name]:.0f}", f"{res['full_group_share'][name]:.0%}",
            f"{res['fetches'][name]:g} ({res['fetches_by_update'][name]:g})",
        )  # fmt: skip
    Console(width=160).print(table)
    print(
        f"fp32 ring all-reduce at every step would send {res['ring_allreduce_bytes_per_node'] / 1e6:,.1f} MB per node"
    )


def main() -> None:
    defaults = Workload()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="inner steps per node (a multiple of each H)")
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per node and step")
    parser.add_argument("--nodes", type=int, default=defaults.workers)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}")
    parser.add_argument("--repeat", type=int, default=1, help="swarm runs per configuration (medians reported)")
    parser.add_argument("--seed", type=int, default=0, help="model weights and node identities")
    parser.add_argument(
        "--lr-schedule",
        choices=SCHEDULES,
        default=defaults.lr_schedule,
        help="inner schedule of the nodes and both baselines; decaying ones end at --steps",
    )
    parser.add_argument("--decay-fraction", type=float, default=defaults.decay_fraction, help="wsd's decay share")
    parser.add_argument("--lr", type=float, help="inner learning rate (default: DiLoCoConfig's)")
    parser.add_argument("--warmup-steps", type=int, help="default: DiLoCoConfig's")
    parser.add_argument("--outer-lr", type=float, help="default: the node's")
    parser.add_argument("--outer-momentum", type=float, help="default: the node's")
    parser.add_argument("--matchmaking-time", type=float, help="seconds nodes gather for a group (default: the node's)")
    parser.add_argument("--timeout", type=float, help="seconds per swarm run (default: from --steps)")
    parser.add_argument("--cache", help="JSON-lines file that keeps the baselines' results between runs")
    parser.add_argument("--keep", help="keep each run's folder (keys, logs, metrics) under this directory")
    parser.add_argument("--skip-baselines", action="store_true", help="swarm runs only (no ratios)")
    parser.add_argument("-v", "--verbose", action="store_true", help="nodes log at INFO")
    parser.add_argument("--link", metavar="RATE", help="each node on its own link of RATE (e.g. 100mbit; root)")
    parser.add_argument("--links", metavar="R1,R2,...", help="as --link, one rate per node (as many as --nodes)")
    parser.add_argument("--hiccup", metavar="NODE:AT:FOR", type=Hiccup.parse,
                        help="node NODE stops (SIGSTOP) AT seconds after the nodes start, for FOR seconds")  # fmt: skip
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="run each configuration again beside N processes that spin a core each, and compare "
                        "with the quiet run (scripts/bench/busy_machine.py)")  # fmt: skip
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--nproc-per-node", type=int, default=1,
                        help="N > 1: compare nodes of N ranks with nodes of 1 (same node batch): tokens/s, "
                        "utilization, bytes per node (scripts/bench/ranks.py); no baselines")  # fmt: skip
    args = parser.parse_args()
    rates = link_options(parser, args)

    import torch

    from swarm.model.diloco import DiLoCoConfig

    torch.set_num_threads(1)
    process_control.exit_on_sigterm()  # unwind: `finally` stops the nodes
    try:
        configs = [SwarmConfig.parse(name) for name in args.configs.split(",")]
        workload = Workload(
            steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size, workers=args.nodes, seed=args.seed,
            lr_schedule=args.lr_schedule, decay_fraction=args.decay_fraction,
        )  # fmt: skip
    except ValueError as e:
        parser.error(str(e))
    if args.hiccup is not None and args.hiccup.node >= workload.workers:
        parser.error(f"--hiccup: node {args.hiccup.node} of {workload.workers} (they count from 0)")
    if bad := [c.name for c in configs if workload.steps % c.inner_steps]:
        parser.error(f"--steps {workload.steps} is not a multiple of H for {', '.join(bad)}")
    inner = DiLoCoConfig()
    options = NodeOptions(
        lr=args.lr if args.lr is not None else inner.lr,
        warmup_steps=args.warmup_steps if args.warmup_steps is not None else inner.warmup_steps,
        outer_lr=args.outer_lr, outer_momentum=args.outer_momentum, matchmaking_time=args.matchmaking_time,
        verbose=args.verbose,
    )  # fmt: skip
    timeout = args.timeout or 180 + workload.steps * workload.workers * 0.5
    keep = Path(args.keep) if args.keep else None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.nproc_per_node > 1:
        from scripts.bench.ranks import compare_ranks, print_ranks

        res = compare_ranks(lambda o, c: run_swarm(workload, c, o, timeout, keep, rates), options, configs,
                            args.nproc_per_node, args.repeat, log)  # fmt: skip
        print(json.dumps(res) if args.json else print_ranks(res))
        return
    runs: dict[str, list[dict[str, Any]]] = {}
    busy_runs: dict[str, list[dict[str, Any]]] = {}
    for config, attempt, busy in [
        (c, a, b) for c in configs for b in sorted({0, args.busy}) for a in range(args.repeat)
    ]:
        log(
            f"swarm {config.name} run {attempt + 1}/{args.repeat}{f' beside {busy} busy processes' if busy else ''} ..."
        )
        with process_control.busy(busy):
            summary = run_swarm(workload, config, options, timeout, keep, rates, args.hiccup)
        (busy_runs if busy else runs).setdefault(config.name, []).append(summary)
        log(f"  eval {summary['eval_loss']:.4f}, sent {statistics.fmean(summary['bytes_sent']) / 1e6:.2f} MB/node, "
            f"utilization {statistics.fmean(summary['utilization']):.1%}, "
            f"full groups {summary['full_group_share']:.0%}, fetches {sum(summary['fetches'])} "
            f"({sum(summary['fetches_by_update'])} by update, {sum(summary['fetched_bytes']) / 1e6:.1f} MB), "
            f"all-reduce {statistics.fmean(summary['round_s']):.2f}s/step, {summary['run_s']:.0f}s")  # fmt: skip
    if args.skip_baselines:
        baselines = {"ddp": float("nan"), "alone": float("nan")}
    else:
        baselines = run_baselines(Cache(args.cache), workload, options.lr, options.warmup_steps, log)
    res = results(workload, baselines, runs, rates)
    if args.busy:
        res["busy"] = busy_results(runs, busy_runs, args.busy)
    if args.json:
        print(json.dumps(res))
    else:
        print_table(res)
        if args.busy:
            print("\n".join(busy_lines(res["busy"])))


def link_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Rate] | None:
    """Each node's rate from --link / --links, checked before anything starts: a bad rate, a
    count that is not --nodes, both flags, or a machine without root or iproute2 is one line."""
    if args.link is None and args.links is None:
        return None
    if args.link is not None and args.links is not None:
        parser.error("give --link (one rate for all) or --links (one per node), not both")
    flag = "--link" if args.link is not None else "--links"
    try:
        rates = node_rates(args.nodes, parse_rate(args.link) if args.link else None,
                           parse_rates(args.links) if args.links else None)  # fmt: skip
    except ValueError as e:
        parser.error(str(e))
    if (lacking := missing()) is not None:
        parser.error(f"{flag} {lacking}")
    return rates


if __name__ == "__main__":
    main()
