"""Dashboard: a run's live web page, read-only, from the run's records in the DHT.

    reader = DhtReader(run_id, initial_peers=[...])          # a client-mode DHT node of its own
    dashboard = Dashboard(run_id, reader).start()            # polls every `interval` seconds
    async with HttpServer(dashboard.routes()) as server:     # "/": the page, "/api/run": its JSON
        ...
    await dashboard.close()

The page (dashboard.html, package data) is one file with its script and style inline: no CDN,
no other request than its own JSON, which it polls; it draws the loss curve and the throughput
as plain SVG. Each answer embeds the latest snapshot, so the page shows the run at once.

A route never waits on the DHT: it hands out what the last poll found (RunView). Each poll is
bounded by `timeout`; a failed one keeps the last view and says why on the page. `lazy`: the
poller (and so the reader's DHT node) starts at the first request, as on a node's metrics port,
where nobody may ever look.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from importlib import resources
from typing import Any

from swarm.data.progress import read_progress
from swarm.dht.config import DHTConfig
from swarm.dht.errors import DHTError
from swarm.dht.node import DHTNode, user_value
from swarm.dht.run_keys import chunks_key, nodes_key, state_key
from swarm.observe.http import Response, Route
from swarm.observe.runview import RunView
from swarm.p2p.config import P2PConfig
from swarm.p2p.errors import P2PError
from swarm.p2p.identity import Identity
from swarm.utils.supervised import Supervised

logger = logging.getLogger(__name__)

Entries = list[tuple[Any, Any]]  # (subkey, value) of a key's records
Reader = Callable[[], Awaitable[tuple[Entries, Entries, Entries]]]  # -> the run's nodes, state and chunk records
JSON_TYPE = "application/json"
HTML_TYPE = "text/html; charset=utf-8"
PAGE_MARK = "/*INITIAL*/null"  # where the page takes the snapshot embedded in it


def page_template() -> str:
    return resources.files("swarm.observe").joinpath("dashboard.html").read_text(encoding="utf-8")


class Dashboard:
    """Owns a run's RunView and the task that keeps it fresh."""

    def __init__(self, run_id: str, read: Reader, *, interval: float = 2.0, timeout: float = 15.0,
                 lazy: bool = False, dht_config: DHTConfig | None = None) -> None:  # fmt: skip
        if interval <= 0 or timeout <= 0:
            raise ValueError("interval and timeout must be > 0")
        self.view = RunView(run_id)
        self.dht_config = dht_config or DHTConfig()  # the proof a claim record needs, and how many are read
        self.read, self.interval, self.timeout, self.lazy = read, interval, timeout, lazy
        self._poller = Supervised(f"dashboard of run {run_id!r}", self._poll_forever)
        self._page = page_template()
        self._json = b""
        self._closed = False
        self._render()

    def start(self) -> Dashboard:
        if not self._closed:
            self._poller.start()
        return self

    async def close(self) -> None:
        self._closed = True
        if (error := await self._poller.close()) is not None:
            logger.warning("the dashboard's poller had failed %d time(s), last: %r", self._poller.failures, error)

    def routes(self) -> dict[str, Route]:
        return {"/": self._page_route, "/index.html": self._page_route, "/api/run": self._json_route}

    async def poll_once(self) -> None:
        try:
            nodes, holders, chunks = await asyncio.wait_for(self.read(), self.timeout)
        except (P2PError, DHTError, OSError, ValueError, asyncio.TimeoutError, TimeoutError) as e:
            self.view.failed(f"could not read the DHT: {e or type(e).__name__}")
        else:
            now, config = time.time(), self.dht_config
            # up to 1,000 claim records of up to 16 KiB of bitmap each: decoded off the event loop
            data = await asyncio.to_thread(read_progress, chunks, id_bits=config.id_bits,
                                           max_records=config.max_subkeys_per_key, now=now)  # fmt: skip
            self.view.update(nodes, holders, now, data)
        self._render()

    async def _poll_forever(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval)

    def _render(self) -> None:
        self._json = json.dumps(self.view.snapshot(), separators=(",", ":"), allow_nan=False).encode()

    def _json_route(self, query: str) -> Response:
        if self.lazy:
            self.start()
        return Response(200, self._json, JSON_TYPE)

    def _page_route(self, query: str) -> Response:
        """The page with the latest snapshot in it; `?live`: without, so that what it shows comes
        from its own polls (the browser test checks that path)."""
        if self.lazy:
            self.start()
        if "live" in query.split("&"):
            return Response(200, self._page.encode(), HTML_TYPE)
        embedded = self._json.decode().replace("<", "\\u003c")  # JSON inside <script>: no "</script>"
        return Response(200, self._page.replace(PAGE_MARK, embedded, 1).encode(), HTML_TYPE)


class DhtReader:
    """Reads a run's records through a client-mode DHT node of its own (it asks, stores and
    serves nothing), made at the first read; a read that reaches no DHT node bootstraps again
    from `initial_peers` (a callable: a node's own addresses are known only once it listens)."""

    def __init__(self, run_id: str, initial_peers: Callable[[], Sequence[str]], *, identity: Identity | None = None,
                 dht_config: DHTConfig | None = None, p2p_config: P2PConfig | None = None) -> None:  # fmt: skip
        self.keys = (nodes_key(run_id), state_key(run_id), chunks_key(run_id))
        self.initial_peers = initial_peers
        self.identity, self.dht_config = identity, dht_config or DHTConfig()
        self.p2p_config = p2p_config or P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))
        self.node: DHTNode | None = None

    async def start(self) -> DhtReader:
        if self.node is None:
            peers = list(self.initial_peers())
            if not peers:
                raise DHTError("no DHT node to read from yet")
            node = DHTNode(self.identity, peers, config=self.dht_config, p2p_config=self.p2p_config,
                           client_mode=True)  # fmt: skip
            await node.start()  # closes itself when it fails
            self.node = node
        return self

    async def close(self) -> None:
        node, self.node = self.node, None
        if node is not None:
            await node.close()

    async def __call__(self) -> tuple[Entries, Entries, Entries]:
        await self.start()
        assert self.node is not None
        results = await asyncio.gather(*(self.node.lookup_value(key, latest=True) for key in self.keys))
        if not any(r.closest for r in results):  # nobody answered: the nodes we knew left
            await self.node.bootstrap(list(self.initial_peers()))
            raise DHTError("no DHT node answered; bootstrapped again")
        now = time.time()
        found = [user_value(r.records(now)) for r in results]
        return _entries(found[0]), _entries(found[1]), _entries(found[2])


def _entries(found: Any) -> Entries:
    value = getattr(found, "value", None)
    if not isinstance(value, dict):
        return []
    return [(subkey, getattr(entry, "value", None)) for subkey, entry in value.items()]
