"""DHT: a DHTNode on its own event-loop thread, for code that is not async (training loops).

    with DHT(initial_peers=[maddr]) as dht:
        dht.store("run1/note", "hello", time.time() + 60)
        print(dht.get("run1/note"))
        dht.run_coroutine(lambda node: node.find_node(node.node_id))  # anything else, as a coroutine

Each call blocks the calling thread (never the DHT's loop) and has a timeout; the loop keeps
answering peers while the caller computes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from swarm.dht.config import DHTConfig
from swarm.dht.ids import Key
from swarm.dht.node import DHTNode
from swarm.dht.records import ValueWithExpiration
from swarm.p2p.config import P2PConfig
from swarm.p2p.identity import Identity
from swarm.utils.eventloop import loop_factory

T = TypeVar("T")


class DHT:
    def __init__(
        self,
        identity: Identity | None = None,
        initial_peers: Iterable[str] = (),
        *,
        config: DHTConfig | None = None,
        p2p_config: P2PConfig | None = None,
        client_mode: bool = False,
        start_timeout: float = 60.0,
        use_uvloop: bool = True,
        id_proof_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self._loop = loop_factory(use_uvloop)()
        self._thread = threading.Thread(target=self._loop.run_forever, name="swarm-dht", daemon=True)
        self._thread.start()
        self.node = DHTNode(
            identity, initial_peers, config=config, p2p_config=p2p_config, client_mode=client_mode,
            id_proof_path=id_proof_path,
        )  # fmt: skip
        try:
            self._submit(self.node.start(), start_timeout)
        except BaseException:
            self._stop_loop()
            raise
        self.peer_id = self.node.peer_id
        self._closed = False

    @property
    def visible_maddrs(self) -> list[str]:
        return self.node.visible_maddrs

    def store(
        self, key: Key, value: Any, expiration_time: float, subkey: Key | None = None, timeout: float | None = None
    ) -> int:
        return self._submit(self.node.store(key, value, expiration_time, subkey), timeout)

    def get(self, key: Key, latest: bool = False, timeout: float | None = None) -> ValueWithExpiration | None:
        return self._submit(self.node.get(key, latest), timeout)

    def run_coroutine(self, fn: Callable[[DHTNode], Awaitable[T]], timeout: float | None = None) -> T:
        """Run fn(node) on the DHT's loop and return its result."""
        return self._submit(fn(self.node), timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._submit(self.node.close(), timeout)
        finally:
            self._stop_loop()

    def __enter__(self) -> DHT:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def _submit(self, coro: Awaitable[T], timeout: float | None) -> T:
        timeout = self.node.config.lookup_timeout + 5 if timeout is None else timeout
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:  # not the builtin TimeoutError before 3.11
            future.cancel()
            raise

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()
