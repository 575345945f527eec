"""swarm-node: join a run (or start one) and train the shared model with DiLoCo.

    swarm-node --run-id demo                                   # the first node of a run
    swarm-node --run-id demo --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo...
    swarm-node check --run-id demo --initial-peers ...   # pre-flight: can this machine join? (node_check.py)

A node with --initial-peers adopts the run's settings (model, H, batch, schedule, ...) that it
was not given (swarm/node/run_lookup.py); a given one that contradicts the run is refused.

`--config FILE` reads the same options from TOML (`inner-steps = 50` or `inner_steps = 50`);
flags on the command line override it. SIGINT or SIGTERM: finish the round under way, leave,
exit 0; a second signal stops at once (exit 130).
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from swarm.averaging.config import CODECS
from swarm.cli import node_ranks
from swarm.cli.common import CliError, OneLineCommand, run_network, setup_logging
from swarm.cli.node_data import open_prepared, refuse_with_ranks
from swarm.cli.node_display import MetricsFile, display_for_terminal, join_lines
from swarm.cli.node_identity import IDENTITY_FILE, node_identity
from swarm.cli.node_run import check_wandb, metrics_server, run_until_signalled, wandb_logger
from swarm.cli.node_settings import adopt_run_settings, read_config_file, refuse_other_settings
from swarm.cli.options import (
    OpenNetworkLimits,
    compression_option,
    identity_option,
    initial_peers_option,
    maddr_list,
    open_network_options,
    relay_options,
    verbose_option,
)
from swarm.dht.id_proof import proof_path_for
from swarm.model.presets import PRESETS
from swarm.model.schedule import SCHEDULES
from swarm.node.config import CATCH_UP_MODES, OVERLAP_MODES, NodeConfig
from swarm.p2p.relay import RelayConfig

if TYPE_CHECKING:  # torch and the node load inside main(), after the flags are checked
    from swarm.node import Event

DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0",)
_DEFAULTS = NodeConfig()


def _bandwidth(ctx: click.Context, param: click.Parameter, value: str | float) -> float | None:
    """--bandwidth: "auto" (None: measured) or a positive number of MB/s."""
    if value == "auto":
        return None
    try:
        mb_s = float(value)
    except ValueError:
        raise click.BadParameter(f"a number of MB/s or 'auto', got {value!r}") from None
    if not (math.isfinite(mb_s) and mb_s > 0):
        raise click.BadParameter(f"a positive number of MB/s or 'auto', got {value!r}")
    return mb_s


def _opt(name: str, type_: Any, help: str, **kwargs: Any) -> Any:
    default = getattr(_DEFAULTS, name.split("/")[0].replace("-", "_"))
    return click.option(f"--{name}", type=type_, default=default, show_default=True, help=help, **kwargs)


class NodeCommand(OneLineCommand):
    """swarm-node, and `swarm-node check ...`: the pre-flight with the same options (node_check.py)."""

    def main(self, args: Any = None, prog_name: str | None = None, **kwargs: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        if argv[:1] == ["check"]:
            from swarm.cli.node_check import check_command

            prog = prog_name or Path(sys.argv[0]).name
            return check_command(self).main(argv[1:], prog_name=f"{prog} check", **kwargs)
        return super().main(argv, prog_name=prog_name, **kwargs)


@click.command(cls=NodeCommand, context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    callback=read_config_file,
    is_eager=True,
    expose_value=False,
    help="A TOML file with any of these options; flags override it.",
)
@initial_peers_option(help="Multiaddr of any node of the swarm; none: start a new swarm.")
@click.option("--host-maddrs", multiple=True, metavar="MADDR", callback=maddr_list,
              help=f"Where to listen (repeatable). Default: {DEFAULT_HOST_MADDRS[0]}.")  # fmt: skip
@click.option("--announce-maddrs", multiple=True, metavar="MADDR", callback=maddr_list,
              help="What peers should dial instead of the listen addresses (public IP, forwarded port).")  # fmt: skip
@identity_option(
    help="Key file of this node (mode 0600), created if missing and kept: a restarted node keeps its PeerID and its "
    f"join line. Default: {IDENTITY_FILE} in --checkpoint-dir, else ~/.config/swarm/identity/RUN[-tcpPORT].key "
    "(see docs: swarm-node); 'ephemeral': a new one at each start."
)
@_opt("run-id", str, "The training run to join.")
@_opt("model", click.Choice(list(PRESETS)), "Model preset.")
@_opt(
    "data",
    str,
    "Training data: 'stdlib' (built in), a folder of swarm-data prepare (a path, its http(s) URL "
    "or 'hf-prepared:ORG/NAME[/PATH][@REV]': shards fetched as claimed), or 'hf:<dataset>[:<config>]' "
    "(needs --tokenizer).",
)
@_opt("tokenizer", str, "Hugging Face tokenizer for --data hf:...")
@_opt("seed", click.IntRange(0), "The run's seed: initial weights are a function of it.")
@_opt("inner-steps", click.IntRange(1), "H: inner steps per outer step (the same on every node).")
@_opt("batch-size", click.IntRange(1), "Sequences per inner step.")
@_opt("seq-len", click.IntRange(1), "Tokens per sequence.")
@_opt("lr", click.FloatRange(0, min_open=True), "Peak inner AdamW learning rate.")
@_opt("warmup-steps", click.IntRange(0), "Inner learning-rate warmup, in inner steps.")
@_opt(
    "lr-schedule",
    click.Choice(SCHEDULES),
    "Inner learning rate after warmup: constant, cosine to "
    "--min-lr-ratio at --total-steps, or wsd (stable, then linear decay over the last --decay-fraction).",
)
@_opt(
    "total-steps",
    click.IntRange(1),
    "Where cosine and wsd end, in inner steps of the swarm's clock (outer steps done x H + inner), counted from "
    "the run's start. Required by them; without --max-outer-steps the run ends there too.",
)
@_opt("decay-fraction", click.FloatRange(0, 1, min_open=True), "wsd: the share of --total-steps spent decaying.")
@_opt("min-lr-ratio", click.FloatRange(0, 1), "cosine and wsd: the final rate, as a fraction of --lr.")
@_opt("outer-lr", click.FloatRange(0, min_open=True), "Outer SGD learning rate.")
@_opt("outer-momentum", click.FloatRange(0, 1, max_open=True), "Outer Nesterov momentum.")
@_opt("fragments", click.IntRange(1), "Streaming DiLoCo: each outer step syncs one of this many fragments of "
      "the model in turn (each fragment every FRAGMENTS x --inner-steps inner steps).")  # fmt: skip
@_opt("compression", str, f"How pseudo-gradients travel: {'|'.join(CODECS)}, optionally :DENSITY, the share "
      "of their blocks each outer step sends (e.g. int8:0.25).", callback=compression_option(CODECS),
      metavar="CODEC[:D]")  # fmt: skip
@_opt("error-feedback", click.FloatRange(0, 1), "Send what the codec dropped in later steps, decayed by this (0: off).")
@_opt("max-group-size", click.IntRange(2), "Largest flat all-reduce; all ready nodes still average as one group.")
@_opt("matchmaking-time", click.FloatRange(0, min_open=True), "Longest wait for a step's expected peers.")
@_opt(
    "part-timeout",
    click.FloatRange(0, min_open=True),
    "Longest wait of the all-reduce for one member (a member that died mid-round costs this much).",
)
@click.option("--bandwidth", default="auto", show_default=True, callback=_bandwidth, metavar="MB/S|auto",
              help="MB/s to announce: parts of the all-reduce are split by it. auto: what this node's rounds "
              "measure (100 until one has), and each round's uploads paced by it; a number: announced as "
              "it is, nothing paced.")  # fmt: skip
@_opt(
    "overlap",
    click.Choice(OVERLAP_MODES),
    "Average each outer step while the next one's inner steps already "
    "run: eager (they start from our own update, corrected when the group's lands) or delayed; none blocks.",
)
@_opt(
    "overlap-matchmaking/--no-overlap-matchmaking",
    bool,
    "With --overlap: train the next outer step from the end of this one's inner steps, while the wait for "
    "slower peers and the matchmaking go on (once the swarm trains as one group), not only once the group formed.",
)
@_opt(
    "catch-up",
    click.Choice(CATCH_UP_MODES),
    "How this node catches up when it is one outer step behind (it missed a group): update (the step's "
    "averaged update from its holders, checked against the state they advertise; int8: ~1/8 of the state) "
    "or state (the whole state).",
)
@_opt(
    "start-with",
    click.IntRange(1),
    "Nodes (this one included) that start a new run together: at the run's first outer step, train once "
    "this many are live (at most 10 minutes, then alone). A run already under way is joined at once.",
)
@_opt("max-outer-steps", click.IntRange(1), "The run's length, a run setting: the outer steps the swarm trains, "
      "counted from the run's start (not from this node's), the same on every node; a joining node takes the run's. "
      "Default: until stopped, or where a decaying --lr-schedule ends.")  # fmt: skip
@_opt(
    "leave-after-steps",
    click.IntRange(1),
    "This node's own stay, not a run setting: leave once the swarm has done this many outer steps since this "
    "node joined (or resumed); the run goes on. Default: stay to the run's end.",
)
@_opt("device", str, "Torch device: auto (cuda when present), cpu, cuda, cuda:1, ...")
@_opt("offload-outer/--no-offload-outer", bool, "Keep θ_outer and outer momentum in CPU memory.")
@_opt("compile/--no-compile", bool, "torch.compile the model: faster inner steps on a GPU, after a compile at start.")
@_opt("client-mode/--no-client-mode", bool, "Accept no inbound connections (behind NAT): trains, serves nothing.")
@_opt("checkpoint-dir", click.Path(file_okay=False), "Checkpoint the state here (and resume from it).")
@_opt("checkpoint-every", click.IntRange(1), "Outer steps between local checkpoints.")
@click.option("--shard-mb", type=click.FloatRange(0.001), default=_DEFAULTS.shard_bytes / 2**20, show_default=True,
              help="Size of the state's shards (checkpoints and peers fetching from this node), MiB.")  # fmt: skip
@_opt("eval-every", click.IntRange(1), "Outer steps between eval losses.")
@_opt("eval-windows", click.IntRange(1), "Eval windows of --seq-len tokens.")
@click.option("--threads", type=click.IntRange(1), default=None, help="Torch CPU threads (default: torch's).")
@click.option("--nproc-per-node", type=click.IntRange(1), default=1, show_default=True,
              help="Local ranks of this one node (one per GPU; gloo on the CPU): they train under DDP, rank 0 "
              "speaks to the swarm. Under torchrun, leave it out.")  # fmt: skip
@click.option("--shard/--no-shard", default=False, show_default=True,
              help="With several ranks: shard the model over them (FSDP2), not one copy per rank (DDP).")  # fmt: skip
@click.option("--rank-timeout", type=click.FloatRange(1), default=120.0, show_default=True,
              help="Longest wait for another rank of this node (to start, in a step) before it leaves.")  # fmt: skip
@click.option("--metrics-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Append every event (start, progress, outer_step, exit) as a JSON line.")  # fmt: skip
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve Prometheus metrics at /metrics and the run's dashboard at / (0: any port).")  # fmt: skip
@click.option("--metrics-host", default="127.0.0.1", show_default=True,
              help="Where --metrics-port listens (0.0.0.0: every interface; the pages are read-only).")  # fmt: skip
@click.option("--wandb", "wandb", default=None, metavar="PROJECT",
              help="Log the metrics to Weights & Biases at each outer step: one run per node in PROJECT, "
              "grouped by --run-id (the extra: pip install -e '.[wandb]'; WANDB_MODE=offline works).")  # fmt: skip
@open_network_options
@relay_options
@verbose_option
def main(
    initial_peers: tuple[str, ...],
    host_maddrs: tuple[str, ...],
    announce_maddrs: tuple[str, ...],
    identity: Path | None,
    threads: int | None,
    nproc_per_node: int,
    shard: bool,
    rank_timeout: float,
    metrics_file: Path | None,
    metrics_port: int | None,
    metrics_host: str,
    wandb: str | None,
    shard_mb: float,
    verbose: int,
    limits: OpenNetworkLimits,
    relay: RelayConfig | None,
    **options: Any,
) -> None:
    """Train the swarm's model with DiLoCo, averaging with whoever is ready each outer step.

    `swarm-node check OPTIONS` (the same options): a pre-flight that tells whether this machine
    can join the run of --initial-peers, and what to fix."""
    setup_logging(verbose)
    try:
        config = NodeConfig(**options, shard_bytes=max(1, int(shard_mb * 2**20)))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if wandb is not None:  # the optional extra, checked before anything slow
        check_wandb(wandb)
    launch = node_ranks.plan(nproc_per_node, config)  # None: one rank, the plain node
    refuse_with_ranks(config, launch is not None)
    if launch is not None and config.overlap != "none":  # its ranks' clocks assume one step at a time
        raise click.UsageError("--overlap is not yet supported with --nproc-per-node (several ranks per node)")
    if launch is not None and config.fragments > 1:  # not tried with several ranks yet
        raise click.UsageError("--fragments is not yet supported with --nproc-per-node (several ranks per node)")
    if launch is not None and config.compile:  # its ranks build their models apart
        raise click.UsageError("--compile is not yet supported with --nproc-per-node (several ranks per node)")
    if shard and launch is None:
        raise click.UsageError("--shard shards the model over several ranks: add --nproc-per-node N (N >= 2)")
    if launch is not None and not launch.leader:  # a rank >= 1 under torchrun: rank 0 speaks to the swarm
        from swarm.ranks.follower import follow

        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        sys.exit(follow(launch, timeout=rank_timeout))
    # one identity for the settings lookup and the node, kept across restarts (node_identity.py)
    node_key, key_file = node_identity(identity, checkpoint_dir=config.checkpoint_dir, name=config.run_id,
                                       host_maddrs=host_maddrs or DEFAULT_HOST_MADDRS)  # fmt: skip
    proof_path = proof_path_for(key_file) if key_file is not None else None  # its costly id, solved once
    theirs = None  # the run's settings, as its records say
    if initial_peers:  # refusals first: the run's settings, read and compared before torch, data and model load
        config, theirs = adopt_run_settings(config, initial_peers, limits, node_key, proof_path)
        refuse_other_settings(config, theirs)
        if launch is not None:  # the run's batch must split over our ranks too
            node_ranks.plan(nproc_per_node, config)
    import torch  # the flags and the run's settings are checked: now the slow imports (seconds on a busy machine)

    from swarm.model.data import DataUnavailableError
    from swarm.node import NodeError, SwarmNode

    if threads is not None:
        torch.set_num_threads(threads)
    try:
        p2p_config = limits.p2p(host_maddrs=host_maddrs or DEFAULT_HOST_MADDRS, announce_maddrs=announce_maddrs)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    config, prepared = open_prepared(config)  # --data DIR: the setting becomes tokens:<digest>
    if prepared is not None:  # the folder's tokens against the run's
        refuse_other_settings(config, theirs)
    sinks: list[Any] = []
    watch = metrics_server(metrics_port, metrics_host, config.run_id, initial_peers, limits)
    if watch is not None:
        sinks.append(watch.observe)
    if wandb is not None:  # after the metrics server's subscriber: it logs the figures that one just took in
        sinks.append(wandb_logger(wandb, watch))
    try:
        if metrics_file is not None:
            try:
                sinks.append(MetricsFile(metrics_file))
            except OSError as e:
                raise CliError(f"cannot write --metrics-file {metrics_file}: {e.strerror or e}") from None
        display = display_for_terminal()
        sinks.append(display)

        def on_event(event: Event) -> None:
            if event["event"] == "start":  # above the live panel, where its redraws leave it
                watching = [f"metrics: {watch.url}metrics  dashboard: {watch.url}"] if watch is not None else []
                display.banner(join_lines(event, config) + watching)
            for sink in sinks:
                sink(event)

        try:
            with contextlib.ExitStack() as stack:
                extra: dict[str, Any] = {} if prepared is None else {"data": prepared}
                if launch is not None:  # rank 0 of several: the ranks train together, we speak for them
                    ranks = stack.enter_context(node_ranks.NodeRanks.open(
                        launch, config, node_key.peer_id.to_bytes(), threads=threads, verbose=verbose,
                        timeout=rank_timeout, shard=shard))  # fmt: skip
                    config, extra = ranks.config, {"data": ranks.data, "model": ranks.model,
                                                   "training_thread": ranks.training_thread,
                                                   "inner_optimizer": ranks.inner_optimizer}  # fmt: skip
                    logging.getLogger("swarm.ranks").info("rank 0 of %d: ranks 1.. run as pids %s", launch.world_size,
                                                          list(ranks.pids))  # fmt: skip
                node = SwarmNode(
                    config,
                    identity=node_key,
                    initial_peers=initial_peers,
                    p2p_config=p2p_config,
                    on_event=on_event,
                    id_proof_path=proof_path,
                    dht_config=limits.dht(),
                    relay=relay,
                    **extra,
                )
                run_network(lambda: run_until_signalled(node, watch))
        except (NodeError, DataUnavailableError) as e:
            raise CliError(str(e)) from None
    finally:
        for sink in sinks:
            if hasattr(sink, "close"):
                sink.close()


if __name__ == "__main__":  # torchrun -m swarm.cli.node ...
    main()
