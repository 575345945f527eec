"""`swarm-node check --initial-peers ...`: a volunteer's pre-flight, before a first run.

It takes every option of swarm-node (paste your join line after `check`) and, without joining:
dials the initial peers and reads the run's records (how many nodes, at what pace), compares the
run's settings with the ones given, asks a peer to dial this machine back (reachability), times a
download of one shard of the run's state from a holder (the link a newcomer's fetch uses),
checks that the model and its optimizer state fit the device's memory, and times one inner
step there. It prints a table of what it found, a verdict, and for each failure the fix; the
exit code is 0 when the node can join, 1 when it cannot.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from swarm.cli.common import CliError, OneLineCommand, run_network, setup_logging
from swarm.cli.node_settings import adopt_run_settings, refuse_other_settings
from swarm.cli.options import OpenNetworkLimits, open_network_options, relay_options
from swarm.cli.output import cell, new_table, print_table
from swarm.dht.node import DHTNode
from swarm.dht.run_keys import nodes_key
from swarm.node.config import NodeConfig
from swarm.node.progress import decode_progress
from swarm.p2p.autonat import check_reachability
from swarm.p2p.errors import P2PError
from swarm.p2p.host import P2PHost
from swarm.p2p.identity import Identity
from swarm.state import protocol
from swarm.state.holders import choose_state, direct_donors, find_holders

PROBE_TIMEOUT = 20.0  # seconds for each network check
T = TypeVar("T")
SLOW_FACTOR = 3.0  # an inner step this many times slower than the run's median is a straggler's
OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass(frozen=True, slots=True)
class Finding:
    check: str
    result: str
    status: str  # OK, WARN or FAIL
    fix: str = ""


@dataclass(frozen=True, slots=True)
class RunProbe:
    """What the network told: the run's nodes and pace, our reachability, a timed download."""

    nodes: int
    sec_per_step: float | None  # the median of the run's records
    reachable: bool | None
    reach_reason: str
    download: str | None  # e.g. "12.3 MB/s (15.9 MB from 12D3…abc)", None: no holder answered
    download_why: str


def check_command(node: click.Command) -> click.Command:
    """The `check` command, with node's options (swarm-node's)."""

    @open_network_options
    @relay_options
    def callback(**options: Any) -> None:
        findings = run_checks(**options)
        print_findings(findings)
        if any(f.status == FAIL for f in findings):
            raise click.exceptions.Exit(1)

    return OneLineCommand("check", callback=callback, params=list(node.params), context_settings=node.context_settings,
                          help="Pre-flight: check that this machine can join the run of --initial-peers with these "
                          "options (peers, settings, reachability, bandwidth, device memory, step time).")  # fmt: skip


def run_checks(
    *, initial_peers: tuple[str, ...], host_maddrs: tuple[str, ...], announce_maddrs: tuple[str, ...],
    verbose: int, limits: OpenNetworkLimits, shard_mb: float, **options: Any,
) -> list[Finding]:  # fmt: skip
    setup_logging(verbose)
    if not initial_peers:
        raise click.UsageError("check needs --initial-peers: the run to check this machine against")
    node_only = ("identity", "threads", "nproc_per_node", "shard", "rank_timeout", "metrics_file", "metrics_port",
                 "metrics_host", "wandb", "relay")  # fmt: skip
    try:
        config = NodeConfig(**{k: v for k, v in options.items() if k not in node_only},
                            shard_bytes=max(1, int(shard_mb * 2**20)))  # fmt: skip
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    identity = Identity.generate()  # a throwaway: the check never runs as the node it checks
    config, theirs = adopt_run_settings(config, initial_peers, limits, identity, None)
    findings: list[Finding] = []
    try:
        probe = run_network(lambda: _probe(config.run_id, initial_peers, limits, host_maddrs or ("/ip4/0.0.0.0/tcp/0",),
                                           announce_maddrs, identity))  # fmt: skip
    except CliError as e:
        if theirs is not None:  # the run's settings came from those peers: they are there, a later step timed out
            fix = "the run's peers answered its settings; on a busy machine or link, run the check again"
            return [Finding("peers", f"the run answered, then {e.message}", FAIL, fix)]
        fix = "check the address (copy it whole from the join line), that the node there runs, and your firewall"
        return [Finding("peers", f"none answered: {e.message}", FAIL, fix)]
    findings.append(Finding("peers", f"{len(initial_peers)} dialed; {probe.nodes} node(s) in run {config.run_id!r}",
                            OK if probe.nodes else WARN, "" if probe.nodes else "no node trains this run yet: "
                            "check --run-id, or you will start it"))  # fmt: skip
    findings.append(_settings_finding(config, theirs))
    findings.append(_reach_finding(probe, bool(config.client_mode)))
    findings.append(Finding("bandwidth", probe.download or f"not measured: {probe.download_why}",
                            OK if probe.download else WARN))  # fmt: skip
    findings.extend(_device_findings(config, probe.sec_per_step))
    return findings


def _settings_finding(config: NodeConfig, theirs: Any) -> Finding:
    if theirs is None:
        return Finding("settings", "the run publishes none yet: this node's own", WARN)
    try:
        refuse_other_settings(config, theirs)
    except CliError as e:
        text = e.message.removeprefix("this run trains with other settings: ")
        differs, _, fix = text.partition(". ")
        return Finding("settings", f"differ: {differs}", FAIL, fix)
    return Finding("settings", f"the run's (model {config.model}, H {config.inner_steps})", OK)


def _reach_finding(probe: RunProbe, client_mode: bool) -> Finding:
    if client_mode:
        return Finding("reachability", "not asked (--client-mode: trains, serves nothing)", OK)
    if probe.reachable is False:
        return Finding("reachability", f"peers cannot dial this machine ({probe.reach_reason})", WARN,
                       "it will train through a relayed address and punched holes; to be dialed directly, forward "
                       "the port and pass --announce-maddrs /ip4/<public ip>/tcp/<port>")  # fmt: skip
    if probe.reachable is None:
        return Finding("reachability", f"unknown: {probe.reach_reason}", WARN)
    return Finding("reachability", "peers dial this machine directly", OK)


async def _probe(run_id: str, initial_peers: tuple[str, ...], limits: OpenNetworkLimits, host_maddrs: tuple[str, ...],
                 announce_maddrs: tuple[str, ...], identity: Identity) -> RunProbe:  # fmt: skip
    host = await P2PHost(identity, limits.p2p(host_maddrs=host_maddrs, announce_maddrs=announce_maddrs)).start()
    try:
        dht = DHTNode(host=host, initial_peers=list(initial_peers), config=limits.dht(), client_mode=True)
        await _stage("joining the run's DHT", dht.start())
        try:
            found = await _stage("reading the run's node records", dht.get(nodes_key(run_id), latest=True))
            records = found.value if found is not None and isinstance(found.value, dict) else {}
            progress = [p for p in (decode_progress(k, getattr(v, "value", None)) for k, v in records.items()) if p]
            paces = [p.sec_per_step for p in progress if p.sec_per_step > 0]
            dial_back = check_reachability(host, host.visible_maddrs, initial_peers[:3])
            reach = await _stage("the dial-back check", dial_back)
            download, why = await _timed_download(host, dht, run_id)
        finally:
            await dht.close()
    finally:
        await host.close()
    return RunProbe(len(progress), statistics.median(paces) if paces else None, reach.reachable,
                    str(reach.reason), download, why)  # fmt: skip


async def _stage(what: str, step: Awaitable[T]) -> T:
    """One network step of the probe within PROBE_TIMEOUT; its timeout names the step (a user
    told only "no answer" took a live run for a wrong address)."""
    try:
        return await asyncio.wait_for(step, PROBE_TIMEOUT)
    except (asyncio.TimeoutError, TimeoutError):
        raise CliError(f"{what}: no answer within {PROBE_TIMEOUT:g}s") from None


async def _timed_download(host: P2PHost, dht: DHTNode, run_id: str) -> tuple[str | None, str]:
    """One shard of the run's current state from a direct holder, timed: (rate line, '') or (None, why)."""
    from swarm.model.checkpoint import parse_manifest  # torch: only once the network answered

    chosen = choose_state(direct_donors(await find_holders(dht, run_id)))
    if chosen is None:
        return None, "no node advertises a state a newcomer could fetch directly"
    step, sha, holders = chosen
    reasons = []
    for holder in holders[:3]:
        try:
            reply = await host.call(holder.maddrs[0], protocol.MANIFEST, protocol.manifest_args(run_id, sha),
                                    timeout=PROBE_TIMEOUT)  # fmt: skip
            shard = max(parse_manifest(reply["manifest"]).shards, key=lambda s: s.nbytes)
            began, received = time.perf_counter(), 0
            args = protocol.shard_args(run_id, sha, shard.name)
            opened = await host.open_stream(holder.maddrs[0], protocol.SHARD, args, timeout=PROBE_TIMEOUT)
            async with opened as stream:
                await stream.end()
                while (chunk := await stream.read(timeout=PROBE_TIMEOUT)) is not None and received <= shard.nbytes:
                    received += len(chunk)
            seconds = time.perf_counter() - began
        except (P2PError, KeyError, TypeError, ValueError, OSError) as e:
            reasons.append(f"{str(holder.peer_id)[-6:]}: {e}")
            continue
        return (f"{received / 1e6 / seconds:.1f} MB/s down ({received / 1e6:.1f} MB of the state of outer step {step} "
                f"from …{str(holder.peer_id)[-6:]})"), ""  # fmt: skip
    return None, "; ".join(reasons)[:200]


def _device_findings(config: NodeConfig, run_sec_per_step: float | None) -> list[Finding]:
    """The device, whether the model and its optimizers' state fit its memory, one inner step's time."""
    import torch

    from swarm.model.llama import build_model, count_parameters
    from swarm.model.loss import lm_loss
    from swarm.model.presets import preset
    from swarm.utils.process_memory import resident_bytes

    device = config.torch_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        return [Finding("device", f"--device {config.device}: no CUDA device here", FAIL, "pass --device cpu")]
    vocab = 256 if config.data == "stdlib" else None  # byte-level; a tokenizer's size is in its data
    if vocab is None:
        return [Finding("device", f"{device}: model not checked (its vocabulary is in --data, not read here)", WARN)]
    model_config = preset(config.model, vocab_size=vocab)
    params = count_parameters(model_config)
    need = params * 4 * 6  # fp32: θ_inner, grads, AdamW's two moments, θ_outer, outer momentum
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else _available_ram()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    found = [Finding("device", f"{name}: {free / 2**30:.1f} GiB free", OK)]
    if need > free:
        result = (f"model {config.model} ({params / 1e6:.0f} M parameters) needs {need / 2**30:.1f} GiB before "
                  f"activations; {free / 2**30:.1f} GiB free")  # fmt: skip
        fix = "a device with more memory, or --offload-outer (θ_outer and momentum in CPU memory)"
        found.append(Finding("memory", result, FAIL, fix))
        return found
    before = resident_bytes()
    try:
        step_s, peak = _time_inner_step(config, model_config, device, build_model, lm_loss)
    except torch.cuda.OutOfMemoryError:
        found.append(Finding("memory", "one inner step ran out of memory", FAIL,
                             "a device with more memory (--batch-size and --seq-len are the run's)"))  # fmt: skip
        return found
    used = peak if device.type == "cuda" else max(0, resident_bytes() - before)
    found.append(Finding("memory", f"{used / 2**30:.2f} GiB for model {config.model} and one step", OK))
    pace = f"; the run's median {run_sec_per_step:.3f}s" if run_sec_per_step else ""
    slow = run_sec_per_step is not None and step_s > SLOW_FACTOR * run_sec_per_step
    found.append(Finding("inner step", f"{step_s:.3f}s{pace}", WARN if slow else OK,
                         "this node trains fewer inner steps per outer step than the others (it still contributes "
                         "them); --compile on a GPU may help" if slow else ""))  # fmt: skip
    return found


def _time_inner_step(config: NodeConfig, model_config: Any, device: Any, build: Callable[..., Any],
                     loss_fn: Callable[..., Any]) -> tuple[float, int]:  # fmt: skip
    """Seconds of one inner step (forward, backward, AdamW; the second of two) and peak CUDA bytes."""
    import torch

    model = build(model_config, config.seed, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    tokens = torch.randint(0, model_config.vocab_size, (config.batch_size, config.seq_len + 1), device=device)
    took = 0.0
    for _ in range(2):
        began = time.perf_counter()
        loss_fn(model, tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took = time.perf_counter() - began
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return took, peak


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def print_findings(findings: list[Finding]) -> None:
    table = new_table("check", "result", "", title="swarm-node check")
    for f in findings:
        table.add_row(cell(f.check), cell(f.result), cell(f.status))
    print_table(table)
    failed = [f for f in findings if f.status == FAIL]
    verdict = "cannot join: " + "; ".join(f"{f.check}: {f.fix}" for f in failed) if failed else "ready to join"
    warned = [f for f in findings if f.status == WARN and f.fix]
    click.echo(f"verdict: {verdict}")
    for f in warned:
        click.echo(f"note ({f.check}): {f.fix}")
