"""How swarm-node runs a built node in this process: on the network's event loop until a signal
(the first finishes the round under way, a second stops at once), with the --metrics-port server
beside it, and the --wandb logger."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from typing import TYPE_CHECKING

import click

from swarm.cli.common import CliError
from swarm.cli.options import OpenNetworkLimits

if TYPE_CHECKING:  # torch and the node load inside main(), after the flags are checked
    from swarm.node import SwarmNode
    from swarm.observe.serve import MetricsServer
    from swarm.observe.wandb_log import WandbLogger


def metrics_server(port: int | None, host: str, run_id: str, initial_peers: tuple[str, ...],
                   limits: OpenNetworkLimits) -> MetricsServer | None:  # fmt: skip
    """--metrics-port: the server (bound when the node's loop runs), counting this process's
    WARNING and ERROR log lines by layer."""
    if port is None:
        return None
    from swarm.observe.http import HttpConfig
    from swarm.observe.serve import MetricsServer

    try:
        server = MetricsServer(run_id, HttpConfig(host=host, port=port), initial_peers=initial_peers,
                               dht_config=limits.dht())  # fmt: skip
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    server.metrics.count_logs(logging.getLogger("swarm"))
    return server


def check_wandb(project: str) -> None:
    """--wandb: a UsageError of one line when the optional extra is not installed or the name is bad."""
    from swarm.observe.wandb_log import WandbMissing, import_wandb

    if not project or "/" in project:
        raise click.BadParameter("a wandb project is a non-empty name without '/'", param_hint="--wandb")
    # wandb would prompt for a missing API key from the logger's worker thread, and print over
    # the live panel: silent, it says what fails in an exception, which the logger logs in one line
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        import_wandb()
    except WandbMissing as e:
        raise click.UsageError(str(e)) from None


def wandb_logger(project: str, watch: MetricsServer | None) -> WandbLogger:
    """--wandb: the metrics --metrics-port serves (or, without it, the same figures counted for
    wandb alone) logged at each outer step, from a worker thread."""
    from swarm.observe.wandb_log import WandbLogger

    wandb = WandbLogger(project, watch.metrics if watch is not None else None)
    if watch is None:
        wandb.metrics.count_logs(logging.getLogger("swarm"))
    return wandb


async def run_until_signalled(node: SwarmNode, watch: MetricsServer | None = None) -> str:
    if watch is not None:
        try:
            await watch.start()
        except OSError as e:
            raise CliError(f"cannot serve --metrics-port on {watch.http.config.host}:{watch.http.config.port}: "
                           f"{e.strerror or e}") from None  # fmt: skip
        try:
            return await run_until_signalled(node)
        finally:
            await watch.close()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    main_task = asyncio.current_task()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            logging.getLogger("swarm.node").warning("stopping after the current round (signal again to stop now)")
            stop.set()
        elif main_task is not None:
            main_task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, on_signal)
    try:
        return await node.run(stop)
    except asyncio.CancelledError:
        raise click.exceptions.Exit(130) from None
