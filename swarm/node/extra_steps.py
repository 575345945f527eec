"""Inner steps past H: what a node does, instead of waiting, while its step cannot end yet.

Two waits are turned into training (loop.py decides when):
- train_until_landed: the step's H inner steps are done before the round in flight (--overlap)
  landed. A node faster than the slowest of its group would wait here at every step.
- train_on_for_slower: with --overlap-matchmaking, our H inner steps are done while the slowest
  peer of our step should still be training (plan.steps_for_slower). The round cannot start
  sooner, and a next step begun early would only train more inner steps from the proxy before
  the average lands.

Either way the extra steps go into this step's Δ, weighted as its H steps (no member may
announce more: AveragingConfig.max_weight), and the records still say H (peers would not
believe more). Each draws its own data windows and keeps the step's last learning rate
(DiLoCo.extra_room), at most H more in a step.
"""

from __future__ import annotations

import asyncio

from swarm.node.context import RunContext
from swarm.node.plan import steps_for_slower
from swarm.node.view import SwarmView


async def train_until_landed(ctx: RunContext, after: asyncio.Future[bool], stopping: asyncio.Future[bool]) -> None:
    """One inner step at a time until the round in flight (`after`) lands or `stopping` ends;
    then returns once one of them has."""
    while not after.done() and not stopping.done() and ctx.diloco.extra_room < ctx.config.inner_steps:
        await extra_inner_steps(ctx, 1, after, stopping)
    await asyncio.wait({after, stopping}, return_when=asyncio.FIRST_COMPLETED)


async def train_on_for_slower(ctx: RunContext, view: SwarmView, stopping: asyncio.Future[bool]) -> None:
    """The inner steps that end before the slowest peer of our step should finish, in one grant
    (no gap between them); then the records, read meanwhile, are asked again."""
    while not stopping.done():
        more = steps_for_slower(view.read(), ctx.diloco.extra_room, ctx.config.max_wait)
        if more <= 0:
            return
        reading = asyncio.ensure_future(ctx.book.refresh())  # the records, while the steps train
        try:
            await extra_inner_steps(ctx, more, stopping)
        finally:
            await reading


async def extra_inner_steps(ctx: RunContext, count: int, *until: asyncio.Future[bool]) -> None:
    """`count` inner steps past H. When one of `until` ends first, the permits left are taken
    back, between steps (where a landing goes): a caller's loop may not be stepping (swarm.join)."""
    ctx.diloco.extra_room += count  # before the permits: the trainer checks it in its step
    steps = asyncio.ensure_future(ctx.inner.train(ctx.diloco.inner_done + count))
    await asyncio.wait({steps, *until}, return_when=asyncio.FIRST_COMPLETED)
    if not steps.done():
        await ctx.inner.revoke()
    await steps
