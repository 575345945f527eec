"""Dial-back (swarm/p2p/autonat.py): a peer tells us whether our announced addresses reach us."""

from __future__ import annotations

import asyncio

import pytest

from swarm.p2p.autonat import DIALBACK, check_reachability
from swarm.p2p.errors import RemoteError


async def test_a_reachable_host_is_confirmed_and_the_probe_is_not_kept(make_host) -> None:
    asker, helper = await make_host(), await make_host()
    result = await check_reachability(asker, asker.visible_maddrs, helper.visible_maddrs)
    assert result.reachable is True and result.address is not None
    assert str(asker.peer_id) in result.address
    await asyncio.sleep(0.1)
    # the asker keeps only the connection it dialed: calls never land on the closed probe
    assert len(asker._pool.by_peer.get(helper.peer_id, [])) == 1
    assert await helper.call(asker.peer_id, DIALBACK, {"maddrs": helper.visible_maddrs}, timeout=5) == {
        "ok": helper.visible_maddrs[0]
    }


async def test_an_address_where_nothing_listens_is_unreachable(make_host) -> None:
    asker, helper = await make_host(), await make_host()
    result = await check_reachability(asker, ["/ip4/127.0.0.1/tcp/9"], helper.visible_maddrs)
    assert result.reachable is False and "answered" in result.reason


async def test_only_the_askers_own_ip_is_dialed(make_host) -> None:
    asker, helper = await make_host(), await make_host()
    result = await check_reachability(asker, ["/ip4/10.9.8.7/tcp/4001"], helper.visible_maddrs)
    assert result.reachable is False and "IP the request came from" in result.reason


async def test_no_helper_answers_means_unknown(make_host) -> None:
    asker = await make_host()
    result = await check_reachability(asker, asker.visible_maddrs, ["/ip4/127.0.0.1/tcp/9"], timeout=2)
    assert result.reachable is None and "/ip4/127.0.0.1/tcp/9" in result.reason


@pytest.mark.parametrize("args", [None, {"maddrs": []}, {"maddrs": "x"}, {"maddrs": ["/ip4/127.0.0.1/tcp/1"] * 9}])
async def test_malformed_requests_get_bad_request(make_host, args) -> None:
    asker, helper = await make_host(), await make_host()
    with pytest.raises(RemoteError, match=r"maddrs"):
        await asker.call(helper.visible_maddrs[0], DIALBACK, args, timeout=5)


async def test_garbage_addresses_are_skipped(make_host) -> None:
    asker, helper = await make_host(), await make_host()
    reply = await asker.call(helper.visible_maddrs[0], DIALBACK, {"maddrs": ["nonsense", 7, *asker.visible_maddrs]})
    assert reply == {"ok": asker.visible_maddrs[0]}


async def test_a_busy_helper_is_asked_again(make_host, monkeypatch) -> None:
    """Nodes that start together through one bootstrap peer: the helper probes one at a time, so
    the second asker gets `busy` and must ask again instead of giving up (it then could not tell
    it is unreachable, and would not run in client mode)."""
    monkeypatch.setattr("swarm.p2p.autonat.PROBE_TIMEOUT", 1.0)
    monkeypatch.setattr("swarm.p2p.autonat.MAX_PROBES", 1)
    first, second, helper = await make_host(), await make_host(), await make_host()
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # accepts, never answers
    try:
        port = silent.sockets[0].getsockname()[1]
        slow = asyncio.ensure_future(check_reachability(first, [f"/ip4/127.0.0.1/tcp/{port}"], helper.visible_maddrs))
        await asyncio.sleep(0.2)  # the helper is now probing the silent port for `first`
        result = await check_reachability(second, ["/ip4/127.0.0.1/tcp/9"], helper.visible_maddrs, timeout=5)
        assert result.reachable is False and "answered" in result.reason
        assert (await slow).reachable is False
    finally:
        silent.close()
