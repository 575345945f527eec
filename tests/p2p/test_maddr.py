from __future__ import annotations

import pytest

from swarm.p2p import MultiaddrError, parse_maddr, parse_maddrs
from swarm.p2p.maddr import CircuitAddress, parse_address

PEER = "12D3KooWBtg3aaRMjxwedh83aGiUkwSxDwUZkzuJcfaqUmo7R3pq"


@pytest.mark.parametrize(
    ("text", "proto", "host", "port"),
    [
        ("/ip4/127.0.0.1/tcp/31337", "ip4", "127.0.0.1", 31337),
        (f"/ip4/10.0.0.1/tcp/1/p2p/{PEER}", "ip4", "10.0.0.1", 1),
        ("/ip6/::1/tcp/4001", "ip6", "::1", 4001),
        ("/dns4/bootstrap.example.org/tcp/443", "dns4", "bootstrap.example.org", 443),
        ("/dns/example.org/tcp/80", "dns", "example.org", 80),
    ],
)
def test_valid_maddrs(text: str, proto: str, host: str, port: int) -> None:
    addr = parse_maddr(text)
    assert (addr.host_protocol, addr.host, addr.port) == (proto, host, port)
    assert parse_maddr(addr.to_maddr()) == addr
    assert (addr.peer_id is not None) == ("/p2p/" in text)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),
        ("ip4/1.2.3.4/tcp/5", "must start with '/'"),
        ("/ip4/1.2.3/tcp/5", "not IPv4"),
        ("/ip4/1.2.3.4/tcp/99999", "range"),
        ("/ip4/1.2.3.4", "no /tcp/PORT"),
        ("/ip4/1.2.3.4/udp/5", "no /tcp/PORT"),
        ("/tcp/5", "must begin with"),
        ("/foo/bar", "unknown protocol"),
        ("/ip4/1.2.3.4/tcp/5/p2p/notapeer", "/ip4/1.2.3.4/tcp/5/p2p/notapeer"),
        ("/ip4/1.2.3.4/tcp/5/ws", "unsupported part /ws"),
        ("/ip4/1.2.3.4/tcp/5/" + "a" * 600, "longer than"),
    ],
)
def test_malformed_maddrs_get_one_clear_line(text: str, reason: str) -> None:
    with pytest.raises(MultiaddrError) as info:
        parse_maddr(text)
    message = str(info.value)
    assert reason in message and "\n" not in message


def test_parse_many_separated_by_spaces_or_commas() -> None:
    addrs = parse_maddrs("/ip4/1.2.3.4/tcp/1, /ip4/1.2.3.4/tcp/2 /ip4/1.2.3.4/tcp/3")
    assert [a.port for a in addrs] == [1, 2, 3]
    assert [a.port for a in parse_maddrs(["/ip4/1.2.3.4/tcp/1,/ip4/1.2.3.4/tcp/2"])] == [1, 2]


RELAY = "12D3KooWHcwjPPHr2CeUrVcAJDv5i9aNJonp85wTymdUA1CgPi9C"


def test_a_relayed_maddr_names_the_relay_and_the_peer() -> None:
    text = f"/ip4/10.0.0.1/tcp/31337/p2p/{RELAY}/p2p-circuit/p2p/{PEER}"
    addr = parse_address(text)
    assert isinstance(addr, CircuitAddress)
    assert (addr.relay.host, addr.relay.port, str(addr.relay.peer_id), str(addr.peer_id)) == (
        "10.0.0.1",
        31337,
        RELAY,
        PEER,
    )
    assert addr.to_maddr() == text and parse_address(addr.to_maddr()) == addr
    assert parse_address(f"/ip4/10.0.0.1/tcp/1/p2p/{PEER}") == parse_maddr(f"/ip4/10.0.0.1/tcp/1/p2p/{PEER}")
    with pytest.raises(MultiaddrError, match="is a relayed address"):
        parse_maddr(text)  # where only a TCP address will do (listening, dial-back), it is refused


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (f"/ip4/10.0.0.1/tcp/1/p2p-circuit/p2p/{PEER}", "before /p2p-circuit comes the relay"),
        (f"/p2p-circuit/p2p/{PEER}", "before /p2p-circuit comes the relay"),
        (f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY}/p2p-circuit", "followed by /p2p/<PeerID>"),
        (f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/", "followed by /p2p/<PeerID>"),
        (f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/{PEER}/tcp/5", "and nothing else"),
        (f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/notapeer", "bad /p2p/ peer id after /p2p-circuit"),
        (f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY}/p2p-circuit/ip4/1.2.3.4", "followed by /p2p/<PeerID>"),
        (f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/{RELAY}", "to itself"),
        (f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/{PEER}/p2p-circuit/p2p/{RELAY}", "one /p2p-circuit"),
        (f"/ip4/10.0.0/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/{PEER}", "not IPv4"),
        (f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/{PEER}" + "x" * 500, "longer than"),
    ],
)
def test_malformed_relayed_maddrs_get_one_clear_line(text: str, reason: str) -> None:
    with pytest.raises(MultiaddrError) as info:
        parse_address(text)
    assert reason in str(info.value) and "\n" not in str(info.value)
