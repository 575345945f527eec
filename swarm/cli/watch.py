"""`swarm-dht inspect --run-id R --serve PORT`: the run's live dashboard (swarm/observe/dashboard.py)
from a client-mode DHT node, until SIGINT or SIGTERM.

It prints the page's address (`--json`: {"url", "run_id"} on one line, which swarm-sim
--dashboard reads), then serves: `/` the page, `/api/run` its JSON. Read-only; it binds
127.0.0.1 unless told otherwise (`--serve-host`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

import click

from swarm.cli.common import CliError, run_network
from swarm.cli.dht_client import ClientOptions
from swarm.cli.output import echo_json
from swarm.observe.dashboard import Dashboard, DhtReader
from swarm.observe.http import HttpConfig, HttpServer


def serve_dashboard(run_id: str, opts: ClientOptions, host: str, port: int) -> None:
    if not opts.initial_peers:
        raise click.UsageError("--serve needs --initial-peers: the multiaddr of any node of the DHT")
    try:
        http_config = HttpConfig(host=host, port=port)
    except ValueError as e:
        raise click.UsageError(str(e)) from None

    async def run() -> None:
        reader = DhtReader(run_id, lambda: opts.initial_peers, identity=opts.identity, dht_config=opts.dht_config(),
                           p2p_config=opts.p2p_config())  # fmt: skip
        try:
            await asyncio.wait_for(reader.start(), opts.timeout)
            dashboard = Dashboard(run_id, reader, timeout=opts.timeout, dht_config=reader.dht_config).start()
            try:
                await _serve(dashboard, http_config, run_id, opts.as_json)
            finally:
                await dashboard.close()
        finally:
            await reader.close()

    run_network(run, opts.timeout)


async def _serve(dashboard: Dashboard, config: HttpConfig, run_id: str, as_json: bool) -> None:
    server = HttpServer(dashboard.routes(), config)
    try:
        await server.start()
    except OSError as e:
        raise CliError(f"cannot serve on {config.host}:{config.port}: {e.strerror or e}") from None
    try:
        if as_json:
            echo_json({"url": server.url, "run_id": run_id})
        else:
            click.echo(f"dashboard of run {run_id!r}: {server.url} (Ctrl+C stops)")
        click.get_text_stream("stdout").flush()
        await _until_signalled()
    finally:
        await server.close()


async def _until_signalled() -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in signals:
            with contextlib.suppress(NotImplementedError):
                loop.remove_signal_handler(sig)
