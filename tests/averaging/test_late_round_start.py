"""A member's round begins only once its inner steps end, while a member that was already
waiting in matchmaking sends its slices the moment the group forms. The late member's host
holds those streams until its round begins (RoundRegistry.expect), up to the group's part
timeout, not request_timeout: refused, the early member took every other owner for dead,
reduced their parts alone and ended the round with another result than its group's (a 6-node
soak on a busy machine, with its other members 3-8 s behind)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from swarm.averaging.config import AveragingConfig
from swarm.averaging.rounds.registry import PART
from swarm.p2p.errors import RemoteError
from tests.averaging.rounds import MakeGroup, averagers

REQUEST_S = 0.5  # request_timeout: what an unknown group's streams wait for
LATE_S = 4 * REQUEST_S  # the others' inner steps end this long after the group formed


@pytest.mark.timeout(60)
async def test_members_still_training_when_their_group_forms_hold_the_early_members_slices() -> None:
    # the gathering ends once all three are in: a long window costs nothing and keeps a loaded
    # machine from forming a group of two
    config = AveragingConfig(request_timeout=REQUEST_S, part_timeout=10.0, matchmaking_time=5.0, codec="none")
    async with averagers(3, config, joined=True) as made:
        expected = frozenset(a.host.peer_id for a in made)
        found = await asyncio.gather(*(a.form_group(1.0, 0, expected=expected) for a in made))
        group = found[0].group
        assert group is not None and all(f.group == group for f in found)
        gen = torch.Generator().manual_seed(3)
        vectors = [torch.randn(30_000, generator=gen) for _ in made]

        async def average(i: int) -> tuple[list[torch.Tensor], object]:
            if i:  # still in their last inner steps
                await asyncio.sleep(LATE_S)
            return await made[i].run_round(group, [vectors[i]])

        outcomes = await asyncio.gather(*(average(i) for i in range(3)))
    results = [averaged[0] for averaged, _ in outcomes]
    assert all(torch.equal(r, results[0]) for r in results)
    assert torch.allclose(results[0], torch.stack(vectors).mean(0), atol=1e-5)
    for _, report in outcomes:  # every part holds every member's slice: nobody was left out
        assert all(sorted(inc) == [0, 1, 2] for inc in report.contributions.values()), report.contributions


@pytest.mark.timeout(30)
async def test_a_group_we_will_not_average_with_refuses_its_streams_at_once(make_group: MakeGroup) -> None:
    """A group we formed and then gave up (a larger group of our state formed beside it) holds
    its members' streams no longer: they go to a backup without waiting out its part timeout."""
    group, members = await make_group(2, part_timeout=20.0, request_timeout=REQUEST_S)
    sender, receiver = members[0].host, members[1].registry
    receiver.expect(group.group_id, 20.0)

    async def send_part() -> bytes:
        address = group.members[1].address()
        async with await sender.open_stream(address, PART, {"g": group.group_id, "i": 0, "p": 1}, timeout=20.0) as s:
            await s.end()
            return bytes(await s.read_all(max_bytes=1 << 20, timeout=20.0))

    sending = asyncio.ensure_future(send_part())
    await asyncio.sleep(4 * REQUEST_S)  # held past request_timeout: the round is expected
    assert not sending.done()
    began = time.monotonic()
    receiver.abandon(group.group_id)
    with pytest.raises(RemoteError, match="no such group"):
        await sending
    assert time.monotonic() - began < 2.0
