"""What a training node does about how peers reach it, for one run.

    async with NodeReach(host, nated=True, relays=initial_peers, relay=RelayConfig()) as reach:
        reach.use_dht(dht)                                       # ... await reach.detach_dht()
        if not await reach.reserve(within=RESERVE_WAIT_S): ...   # no relay took us: client mode
        averager = Averager(..., reach=reach.reach)

- A node that peers can dial (its dial-back check passed, or nobody could tell) relays for the
  others: it serves a RelayService (p2p/relay.py) unless `relay` is None (--relay off), and
  lists itself in the DHT's relay records (relay_records.py) once given the DHT. When it
  dials a NATed peer through a relay, its Puncher (reachable=True) offers its listening address
  and the peer dials it directly: relays carry no traffic between it and the NATed.
- A node behind NAT keeps reservations on two relays (RelayKeeper, nearest first: the initial
  peers that name their PeerID and, once given the DHT, the relays its records name), replaces
  one that dies, announces only its relayed addresses, and runs a Puncher, so
  that peers that dial that address get a direct connection where both NATs allow it. Its host
  must dial from its listening port (P2PConfig.reuse_port). Without a reservation it can only be
  a client (it dials out, serves nothing), as every NATed node was before relays.
- `reach()` says, at every matchmaking, how the others reach us (p2p/reach.py): direct, punched
  or relayed; a relayed member owns no part.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from swarm.dht.node import DHTNode
from swarm.node.relay_records import advertise_relay_forever, find_relays
from swarm.p2p.errors import MultiaddrError, RelayRefused
from swarm.p2p.host import P2PHost
from swarm.p2p.maddr import TcpAddress, parse_address
from swarm.p2p.punch import PunchConfig, Puncher
from swarm.p2p.reach import DIRECT, RELAYED, own_reach
from swarm.p2p.relay import RelayConfig, RelayService
from swarm.p2p.relay_client import RelayKeeper
from swarm.utils.supervised import Supervised

logger = logging.getLogger(__name__)

RESERVE_WAIT_S = 20.0  # how long a NATed node waits for a relay to take its reservation at start
RESERVATIONS = 2  # a NATed node's relays: the second keeps it reachable while one is replaced


def relay_candidates(peers: Sequence[str]) -> list[str]:
    """The peers that may relay for us: those whose multiaddr is a direct one naming a PeerID
    (a relayed address is no relay: circuits do not chain)."""
    out = []
    for text in peers:
        try:
            addr = parse_address(text)
        except MultiaddrError:
            continue
        if isinstance(addr, TcpAddress) and addr.peer_id is not None:
            out.append(text)
    return out


class NodeReach:
    """A node's relay service, or its reservation and hole punching (module docstring)."""

    def __init__(self, host: P2PHost, *, nated: bool, relays: Sequence[str], relay: RelayConfig | None,
                 punch: PunchConfig | None = None) -> None:  # fmt: skip
        self.host, self.nated = host, nated
        self.service = RelayService(host, relay) if relay is not None and not nated else None
        # behind NAT we keep reservations even when no initial peer can relay: the DHT's relay
        # records may name relays once use_dht() gives us the DHT
        self.keeper = (
            RelayKeeper(host, relay_candidates(relays), want=RESERVATIONS, discover=self._discover) if nated else None
        )
        self._dht: DHTNode | None = None
        self._advert: Supervised | None = None  # our relay record, while we relay and have the DHT
        # behind NAT we punch (ValueError without reuse_port); reachable, we let NATed peers that
        # we dial through their relay dial us back directly
        self.puncher = Puncher(host, punch, reachable=not nated)
        self._started = False

    async def start(self) -> NodeReach:
        if not self._started:
            self._started = True
            if self.service is not None:
                await self.service.start()
            await self.puncher.start()
            if self.nated:
                self.host.announce_listening = False  # nobody can dial our own addresses
            if self.keeper is not None:
                await self.keeper.start()
        return self

    async def close(self) -> None:
        if self._started:
            self._started = False
            await self.detach_dht()
            for part in (self.keeper, self.service, self.puncher):
                if part is not None:
                    await part.close()

    async def __aenter__(self) -> NodeReach:
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    def use_dht(self, dht: DHTNode) -> None:
        """From now on, learn relays from `dht`'s records (behind NAT) or list ours there (relaying)."""
        self._dht = dht
        if self.keeper is not None:
            self.keeper.look_again()
        if self.service is not None and self._advert is None:
            self._advert = Supervised(
                "relay record", lambda: advertise_relay_forever(dht, lambda: self.host.visible_maddrs)
            )
            self._advert.start()

    async def detach_dht(self) -> None:
        """Stop using the DHT (before it closes)."""
        self._dht = None
        if self._advert is not None:
            advert, self._advert = self._advert, None
            await advert.close()

    async def _discover(self) -> list[str]:
        dht = self._dht
        if dht is None or self.keeper is None:
            return []
        return await find_relays(dht, exclude=[*self.keeper.held, *self.keeper.ruled_out])

    async def reserve(self, within: float = RESERVE_WAIT_S) -> bool:
        """Behind NAT: True once a relay holds a reservation for us; False after `within` seconds,
        or once every relay we know of has refused or not answered, those the DHT names included
        when use_dht() came first (so call it after use_dht(): an initial peer that does not relay
        is no reason to give up on the relays the DHT knows). Not behind NAT: True at once."""
        if not self.nated:
            return True
        if self.keeper is None:
            return False
        try:
            await self.keeper.wait_reserved(within)
        except RelayRefused as e:
            logger.warning("no relay took a reservation for this node: %s", e)
            return False
        return True

    def reach(self) -> str:
        """How the others reach us now (p2p/reach.py)."""
        if not self.nated:
            return DIRECT
        if self.keeper is None or self.keeper.current is None:
            return RELAYED  # no reservation right now: nobody reaches us at all until it is back
        listening = self.host.listening_address()
        reservation = self.keeper.reservation
        observed = reservation.observed if reservation is not None else None
        return own_reach(reachable=False, listen_port=listening.port if listening is not None else None,
                         observed_port=observed.port if observed is not None else None,
                         outcomes=self.puncher.outcomes.values())  # fmt: skip
