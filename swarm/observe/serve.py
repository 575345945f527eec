"""MetricsServer: what `swarm-node --metrics-port PORT` serves, from the node's own event loop.

    server = MetricsServer(run_id, HttpConfig(port=9100), initial_peers=(...))
    node = SwarmNode(config, on_event=server.observe, ...)
    async with server:                       # binds at once: a port in use fails before training
        await node.run(stop)

    GET /metrics    the node's Prometheus metrics (NodeMetrics, its own registry)
    GET /           the run's dashboard (observe/dashboard.py), read from the DHT through a
                    client-mode DHT node of the server's own, bootstrapped from this node's
                    addresses (or, for a node in client mode, its initial peers) at the first
                    request: a node nobody watches pays nothing for it
    GET /api/run    the dashboard's JSON

Requests and their limits: observe/http.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from swarm.dht.config import DHTConfig
from swarm.observe.dashboard import Dashboard, DhtReader
from swarm.observe.http import HttpConfig, HttpServer, Response
from swarm.observe.metrics import NodeMetrics


class MetricsServer:
    """Owns a node's NodeMetrics, its HTTP server and its lazy dashboard."""

    def __init__(self, run_id: str, config: HttpConfig, *, initial_peers: Sequence[str] = (),
                 dht_config: DHTConfig | None = None, metrics: NodeMetrics | None = None) -> None:  # fmt: skip
        self.metrics = metrics or NodeMetrics()
        self._initial_peers = tuple(initial_peers)
        self._own: tuple[str, ...] = ()  # the node's addresses, from its start event
        self.reader = DhtReader(run_id, self._bootstrap_peers, dht_config=dht_config)
        self.dashboard = Dashboard(run_id, self.reader, lazy=True, dht_config=self.reader.dht_config)
        self.http = HttpServer({**self.dashboard.routes(), "/metrics": self._scrape}, config)

    def observe(self, event: dict[str, Any]) -> None:
        """The node's event subscriber."""
        if event.get("event") == "start" and isinstance(event.get("maddrs"), list):
            self._own = tuple(m for m in event["maddrs"] if isinstance(m, str))
        self.metrics(event)

    @property
    def url(self) -> str:
        return self.http.url

    async def start(self) -> MetricsServer:
        await self.http.start()
        return self

    async def close(self) -> None:
        await self.http.close()
        await self.dashboard.close()
        await self.reader.close()

    async def __aenter__(self) -> MetricsServer:
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    def _bootstrap_peers(self) -> tuple[str, ...]:
        return self._own or self._initial_peers

    def _scrape(self, query: str) -> Response:
        return Response(200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST)
