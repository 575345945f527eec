"""The ready sets of one run's steps as this node may believe them (matchmaking/matchmaker.py reads them
here): decoded and bounded (ready.decode_view), without the owners our audits caught, without
the FORMED markers of owners that promised a result that never came, and with the owners that
have not proven they are alive marked unverified (matchmaking/liveness.py)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Set
from dataclasses import replace

from swarm.averaging.config import AveragingConfig
from swarm.averaging.matchmaking.liveness import Liveness
from swarm.averaging.matchmaking.ready import ReadyView, decode_view
from swarm.dht.errors import DHTError
from swarm.dht.node import DHTNode
from swarm.dht.run_keys import ready_key
from swarm.p2p.errors import P2PError
from swarm.p2p.host import P2PHost
from swarm.p2p.peer_id import PeerID
from swarm.utils.log_once import OncePerPeer

logger = logging.getLogger(__name__)

SETTLE = 2.0  # seconds we wait for the liveness check of a peer we did not expect
MAX_DISTRUSTED = 4096  # peers whose FORMED markers we ignore (a bound on memory)


class ReadyBoard:
    """Reads `<run>/ready/<N>` for the Matchmaker. Owns the Liveness checks (and so the
    `avg.alive` handler of a server) and the set of distrusted FORMED markers; shares the
    Averager's set of excluded owners. `read` a step's view, `ask`/`settled` to check who is
    alive, `marked` for what is known now; `close` when done."""

    def __init__(
        self,
        dht: DHTNode,
        host: P2PHost,
        run_id: str,
        config: AveragingConfig,
        excluded: Set[PeerID],
        bad_input: OncePerPeer,
    ) -> None:
        self.dht, self.run_id, self.config = dht, run_id, config
        self.peer_id = host.peer_id
        self.excluded = excluded  # peers the owner audit caught (the Averager's set, shared)
        self.distrusted: set[PeerID] = set()  # their FORMED markers never came with a result
        self.liveness = Liveness(host, run_id, config.request_timeout, serve=not config.client_mode)
        self._bad_input = bad_input

    def close(self) -> None:
        self.liveness.close()

    async def read(self, step: int) -> ReadyView:
        """One read of the step's ready set (an empty view when the DHT cannot be read)."""
        try:
            found = await self.dht.get(ready_key(self.run_id, step), latest=True)
        except (P2PError, DHTError, TimeoutError) as e:
            logger.warning("could not read who is ready for step %d: %s", step, e)
            return ReadyView()
        if found is None or not isinstance(found.value, dict):
            return ReadyView()
        entries = {k: getattr(v, "value", None) for k, v in found.value.items()}
        view, skipped = decode_view(entries, self.config.max_weight, self.dht.config.id_bits, self.config.settings)
        for item in skipped:
            self._bad_input.log(item.owner, "ready record", "ignoring %s (step %d)", item.reason, step)
        if ignored := self.distrusted & view.formed.keys():  # their markers are not believed
            view = replace(view, formed={p: s for p, s in view.formed.items() if p not in ignored},
                           refused=view.refused | ignored)  # fmt: skip
        if caught := self.excluded & (view.ready.keys() | view.formed.keys()):
            # owners our audits caught lying: never grouped with, and their "formed" markers mean
            # nothing (the liar applied its own result: no honest node waits for it)
            view = replace(view, ready={p: m for p, m in view.ready.items() if p not in caught},
                           formed={p: s for p, s in view.formed.items() if p not in caught},
                           refused=view.refused | caught)  # seen: nobody waits for them  # fmt: skip
        return view

    def ask(self, step: int, view: ReadyView, expected: Set[PeerID]) -> None:
        """Start checking the owners in `view` that we know nothing current of (expected first)."""
        self.liveness.ask(step, [*view.ready.values(), *view.formers.values()], expected)

    async def settled(self, step: int, view: ReadyView, expected: Set[PeerID], until: float = math.inf) -> ReadyView:
        """`view` with the owners that have not proven they are alive marked unverified, after
        asking the ones not asked yet and waiting for the answers (request_timeout at most for
        the peers we expect, SETTLE for the others; never past the loop time `until`)."""
        self.ask(step, view, expected)
        now = asyncio.get_running_loop().time()
        owners = view.ready.keys() | view.formed.keys()
        # the peers we expect are worth a request's wait; an unknown one (maybe a flood of
        # addresses that never answer) only a short one: it counts once it has answered
        await self.liveness.settle(owners & expected, min(until, now + self.config.request_timeout))
        await self.liveness.settle(owners - expected, min(until, now + min(SETTLE, self.config.request_timeout)))
        return self.marked(view)

    def marked(self, view: ReadyView) -> ReadyView:
        """`view` with the owners not known to be alive marked unverified."""
        owners = view.ready.keys() | view.formed.keys()
        return replace(view, unverified=frozenset(owners - self.liveness.alive(owners)))

    def distrust_formed(self, peers: Set[PeerID]) -> None:
        """Ignore these peers' FORMED markers from now on: they made us wait for a result that
        did not come in max_wait (node.py). Without this, one identity that renews a FORMED
        marker of our state (it answers liveness checks, so it counts) would keep every node
        "late" forever; with it, each identity delays the swarm by one max_wait at most."""
        fresh = set(peers) - self.distrusted - {self.peer_id}
        if fresh:
            logger.warning("ignoring the FORMED markers of %s from now on: no result came of them",
                           ", ".join(str(p) for p in sorted(fresh, key=PeerID.to_bytes)))  # fmt: skip
        self.distrusted |= fresh
        while len(self.distrusted) > MAX_DISTRUSTED:
            self.distrusted.pop()
