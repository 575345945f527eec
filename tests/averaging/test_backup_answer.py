"""A sender that cannot reach a part's owner (a relayed client whose relay died mid-round) asks a
backup for the part; the backup, still waiting on its own takeover of the part, learns the
owner's result through its own slice and answers the sender with those bytes at once. Before, it
dropped its takeover when its round ended and the sender waited out two part timeouts for an
answer that never came (about 100 s in the NAT lab's relay-death test). Real hosts on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import torch

from swarm.averaging.config import AveragingConfig
from swarm.averaging.messages import GroupInfo, MemberInfo
from tests.averaging.rounds import averagers
from tests.averaging.test_part_timeout import member

pytestmark = pytest.mark.swarm  # a round that waits out part timeouts on real sockets: 6 s


def closed_port() -> str:
    """A loopback address where nothing listens: a dial fails at once, as a dead relay's does."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"/ip4/127.0.0.1/tcp/{port}"


CUT_AFTER = 0.2  # share of the part timeout


@pytest.mark.timeout(60)
async def test_a_client_cut_off_from_an_owner_gets_its_part_from_a_backup_within_one_part_timeout() -> None:
    timeout = 6.0
    config = AveragingConfig(part_timeout=timeout, request_timeout=1.0, aggregator="mean")
    tensors = [torch.randn(200_000, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    async with averagers(4, config) as made:
        owner, backup, other, cut_off = made
        # the owner's address in the group reaches nobody; the other owners hold a connection to it
        # already (as the cone owners of the lab held punched ones), the client none (its relay died)
        for peer in (backup, other):
            await peer.host.connect(owner.host.visible_maddrs[0], timeout=5)
        infos = (member(owner, 1.0, (closed_port(),)), member(backup, 1.0), member(other, 1.0),
                 MemberInfo(cut_off.host.peer_id, (), 1.0, 0.0, True))  # fmt: skip
        group = GroupInfo.create("run", 0, infos)

        async def timed(i: int) -> tuple[float, torch.Tensor, dict[int, list[int]]]:
            if made[i] is cut_off:  # its relay dies a moment into the round: it turns to the backup then
                await asyncio.sleep(CUT_AFTER * timeout)
            began = time.monotonic()
            averaged, report = await made[i].run_round(group, [tensors[i]])
            return time.monotonic() - began, averaged[0], report.contributions

        outcomes = await asyncio.gather(*(timed(i) for i in range(4)))
    results = [averaged for _, averaged, _ in outcomes]
    assert all(torch.equal(r, results[0]) for r in results), "the members hold different results"
    part = group.index_of(owner.host.peer_id)
    assert sorted(outcomes[0][2][part]) == sorted({0, 1, 2, 3} - {group.index_of(cut_off.host.peer_id)})
    took = outcomes[3][0]
    # the owner waits one part timeout for the client's slice, then answers: so does the backup
    # (it dropped its takeover when its round ended, and the client waited out two part timeouts)
    assert took < 1.5 * timeout, f"the cut-off client waited {took:.1f}s for its part"
