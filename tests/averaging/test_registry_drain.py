"""A member that stops after its round first waits for the streams it is still serving
(RoundRegistry.drain): the answers its group's senders wait for go out before its host closes.
(A backup that closed its host under its half-written result sent its senders to the next
backup, which reduced the part again: the stopped node left holding another state.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from swarm.averaging.rounds.flat import AllReduceRound
from swarm.p2p.handlers import CallContext
from swarm.p2p.stream import Stream
from tests.averaging.rounds import EXACT, MakeGroup


@pytest.mark.timeout(60)
async def test_drain_waits_for_the_answers_being_served(make_group: MakeGroup) -> None:
    group, members = await make_group(2, part_timeout=10.0, request_timeout=5.0, **EXACT)
    gen = torch.Generator().manual_seed(2)
    rounds = [AllReduceRound(m.host, m.registry, group, torch.randn(4_000, generator=gen), m.config) for m in members]
    serving, release = asyncio.Event(), asyncio.Event()
    honest = rounds[1].serve_part

    async def slow(ctx: CallContext, args: dict[str, Any], stream: Stream) -> None:
        serving.set()
        await release.wait()  # the answer is still on its way (a busy machine, a slow link)
        await honest(ctx, args, stream)

    rounds[1].serve_part = slow  # type: ignore[method-assign]
    runs = [asyncio.ensure_future(r.run()) for r in rounds]
    try:
        await asyncio.wait_for(serving.wait(), 10)
        assert await members[1].registry.drain(0.2) == 1  # one stream still being served: not idle
        release.set()
        assert await members[1].registry.drain(10) == 0
        outcomes = await asyncio.gather(*runs)
        assert torch.equal(outcomes[0][0], outcomes[1][0])
    finally:
        release.set()
        for run in runs:
            run.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
