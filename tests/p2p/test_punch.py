"""Hole punching over a relayed connection (punch.py) on 127.0.0.1: the two ends dial each other
from their listening ports and move the session to the direct connection; a peer cannot make us
dial an address outside the one the relay observed for it. (Through real NATs: tests/netlab/test_nat.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from swarm.p2p import CallContext, PeerID, RemoteError
from swarm.p2p import handshake as hs
from swarm.p2p.circuit import is_relayed
from swarm.p2p.errors import BadRequest
from swarm.p2p.maddr import parse_maddr
from swarm.p2p.punch import CONNECT, PUNCHED, VERSION, Puncher, check_addrs, check_lan, punch_role
from swarm.p2p.relay import RelayService
from swarm.p2p.relay_client import RelayKeeper
from tests.waiting import until

Factory = Callable[..., Any]


async def echo(ctx: CallContext, args: Any) -> Any:
    return {"echo": args, "via": ctx.remote_address[0]}


@pytest.mark.timeout(60)
async def test_a_relayed_pair_punches_a_direct_connection_and_moves_to_it(make_host: Factory) -> None:
    relay = await make_host()
    target, dialer = await make_host(reuse_port=True), await make_host(reuse_port=True)
    target.add_handler("demo.echo", echo)
    service = await RelayService(relay).start()
    async with RelayKeeper(target, [relay.visible_maddrs[0]]) as keeper, Puncher(target), Puncher(dialer) as puncher:
        relayed = (await keeper.wait_reserved(timeout=10)).to_maddr()
        first = await dialer.call(relayed, "demo.echo", 1, timeout=10)
        assert first["via"].endswith("/p2p-circuit")
        assert await puncher.outcome(target.peer_id, timeout=20) == PUNCHED
        direct = [c for c in dialer.connections_to(target.peer_id) if not is_relayed(c.remote_address)]
        assert direct and direct[0].role == punch_role(dialer.peer_id, target.peer_id)
        again = await dialer.call(relayed, "demo.echo", 2, timeout=10)  # same peer: the direct connection
        assert again == {"echo": 2, "via": "127.0.0.1"}
        # the relayed connection, idle, was closed: the relay's circuit is free again
        await until(lambda: service.circuits == 0, 10, "the circuit to close")
    await service.close()


@pytest.mark.timeout(60)
async def test_a_reachable_dialer_is_dialed_back_directly_without_punching_itself(make_host: Factory) -> None:
    """A host peers can dial needs no reuse_port: it offers its listening address, the NATed end
    dials it from its own listening port, and the pair leaves the relay."""
    relay = await make_host()
    target, dialer = await make_host(reuse_port=True), await make_host()
    target.add_handler("demo.echo", echo)
    service = await RelayService(relay).start()
    async with (RelayKeeper(target, [relay.visible_maddrs[0]]) as keeper, Puncher(target),
                Puncher(dialer, reachable=True) as puncher):  # fmt: skip
        relayed = (await keeper.wait_reserved(timeout=10)).to_maddr()
        assert (await dialer.call(relayed, "demo.echo", 1, timeout=10))["via"].endswith("/p2p-circuit")
        assert await puncher.outcome(target.peer_id, timeout=20) == PUNCHED
        direct = [c for c in dialer.connections_to(target.peer_id) if not is_relayed(c.remote_address)]
        assert direct and direct[0].role == punch_role(dialer.peer_id, target.peer_id)
        assert (await dialer.call(relayed, "demo.echo", 2, timeout=10)) == {"echo": 2, "via": "127.0.0.1"}
        await until(lambda: service.circuits == 0, 10, "the circuit to close")
    await service.close()


@pytest.mark.timeout(30)
async def test_a_punch_request_for_a_third_partys_address_is_refused(make_host: Factory) -> None:
    relay = await make_host()
    target, dialer = await make_host(reuse_port=True), await make_host(reuse_port=True)
    target.add_handler("demo.echo", echo)
    service = await RelayService(relay).start()
    async with RelayKeeper(target, [relay.visible_maddrs[0]]) as keeper, Puncher(target):
        relayed = (await keeper.wait_reserved(timeout=10)).to_maddr()
        await dialer.call(relayed, "demo.echo", 1, timeout=10)  # the dialer runs no puncher: no punch
        (conn,) = dialer.connections_to(target.peer_id)
        for addrs, says in [
            (["/ip4/10.9.9.9/tcp/80"], "outside the address the relay observed"),
            (["/ip4/127.0.0.1/tcp/80/p2p/" + str(relay.peer_id)], "must be /ip4 or /ip6"),
            ([f"/ip4/127.0.0.1/tcp/{i}" for i in range(1, 6)], "1 to 4"),
            ("/ip4/127.0.0.1/tcp/80", "1 to 4"),
        ]:
            with pytest.raises(RemoteError, match=says) as info:
                await conn.call(CONNECT, {"v": VERSION, "addrs": addrs}, 5)
            assert info.value.code == "bad_request"
        # and never over a direct connection, where no relay vouches for the peer's address
        direct = await (await make_host()).connect(target.visible_maddrs[0])
        with pytest.raises(RemoteError, match="only over a relayed connection"):
            await direct.call(CONNECT, {"v": VERSION, "addrs": ["/ip4/127.0.0.1/tcp/80"]}, 5)
    await service.close()


async def test_punching_needs_dials_from_the_listening_port(make_host: Factory) -> None:
    with pytest.raises(ValueError, match="reuse_port=True"):
        Puncher(await make_host())


A, B = (PeerID.from_public_key(bytes([i]) * 32) for i in (1, 2))


def test_both_ends_of_a_punch_agree_on_the_roles() -> None:
    assert {punch_role(A, B), punch_role(B, A)} == {hs.DIALER, hs.LISTENER}
    assert punch_role(min(A, B), max(A, B)) == hs.DIALER


@pytest.mark.parametrize(
    ("addrs", "allowed", "says"),
    [
        (["/ip4/10.0.0.2/tcp/5"], "/ip4/10.0.0.1/tcp/9", "outside"),
        (["/ip4/10.0.0.1/tcp/5"], None, "no address for this peer"),
        ([], "/ip4/10.0.0.1/tcp/9", "1 to 4"),
        ([5], "/ip4/10.0.0.1/tcp/9", "must be /ip4 or /ip6"),
        (["/dns4/example.org/tcp/5"], "/ip4/10.0.0.1/tcp/9", "must be /ip4 or /ip6"),
        (["garbage"], "/ip4/10.0.0.1/tcp/9", "must be /ip4 or /ip6"),
    ],
)
def test_punch_addresses_must_lie_on_the_observed_ip(addrs: Any, allowed: str | None, says: str) -> None:
    with pytest.raises(BadRequest, match=says):
        check_addrs(addrs, None if allowed is None else parse_maddr(allowed))
    assert check_addrs(["/ip4/10.0.0.1/tcp/5", "/ip4/10.0.0.1/tcp/6"], parse_maddr("/ip4/10.0.0.1/tcp/9"))


PUBLIC = parse_maddr("/ip4/203.0.113.7/tcp/4001")


@pytest.mark.parametrize(
    ("lan", "ours", "theirs", "expected"),
    [
        (["/ip4/192.168.1.5/tcp/4001"], PUBLIC, PUBLIC, ["/ip4/192.168.1.5/tcp/4001"]),  # one NAT: dial it
        (["/ip4/192.168.1.5/tcp/4001"], PUBLIC, parse_maddr("/ip4/198.51.100.1/tcp/1"), []),  # two NATs: ignored
        (["/ip4/192.168.1.5/tcp/4001"], None, PUBLIC, []),  # the relay told us nothing: nothing to compare
        (None, PUBLIC, PUBLIC, []),  # not offered
    ],
)
def test_lan_addresses_are_dialed_only_for_a_peer_behind_our_own_nat(
    lan: Any, ours: Any, theirs: Any, expected: list[str]
) -> None:
    assert [a.to_maddr() for a in check_lan(lan, ours, theirs)] == expected


@pytest.mark.parametrize(
    ("lan", "says"),
    [
        (["/ip4/8.8.8.8/tcp/53"], "PRIVATE-HOST"),  # a public host: the punch must not be turned on it
        (["/ip4/127.0.0.1/tcp/22"], "PRIVATE-HOST"),  # our own machine
        (["/ip4/0.0.0.0/tcp/22"], "PRIVATE-HOST"),
        (["/ip4/169.254.1.1/tcp/22"], "PRIVATE-HOST"),
        (["/ip6/fd00::1/tcp/22"], "PRIVATE-HOST"),
        (["/ip4/10.0.0.1/tcp/22/p2p/12D3KooWCXP43ZcpwEPXPBELmtUZeQ5cjPFTpU21W1dCwHfTYs6r"], "PRIVATE-HOST"),
        ([5], "PRIVATE-HOST"),
        (["garbage"], "PRIVATE-HOST"),
        ([f"/ip4/10.0.0.{i}/tcp/1" for i in range(1, 6)], "at most 4"),
        ("/ip4/10.0.0.1/tcp/1", "at most 4"),
    ],
    ids=["public", "loopback", "unspecified", "link-local", "ipv6", "peer-id", "int", "garbage", "five", "string"],
)
def test_bad_lan_addresses_from_a_peer_behind_our_nat_are_refused(lan: Any, says: str) -> None:
    with pytest.raises(BadRequest, match=says):
        check_lan(lan, PUBLIC, PUBLIC)
