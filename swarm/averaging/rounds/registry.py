"""RoundRegistry: routes the avg.* streams a host receives to the round of their group.

Every stream method a round may serve is named here, with the round's method that serves it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from swarm.averaging.config import AveragingConfig
from swarm.p2p.errors import BadRequest
from swarm.p2p.handlers import CallContext
from swarm.p2p.host import P2PHost
from swarm.p2p.stream import Stream

PART, FETCH = "avg.part", "avg.fetch"  # the flat round's (rounds/flat.py)
ROW, COL, DOWN = "avg.row", "avg.col", "avg.down"  # the grid round's (rounds/grid.py)
RECEIPT = "avg.receipt"  # the owner audit's, of either round (audit/flat.py, audit/grid.py)
# Every stream method a round may serve, and the round's method serving it: the flat round
# serves the first two, rounds/grid.py's grid round the next three, an audited round of either
# kind the receipt (audit/); a round asked for a method it does not serve answers BadRequest.
SERVED = {PART: "serve_part", FETCH: "serve_fetch", ROW: "serve_row", COL: "serve_col", DOWN: "serve_down",
          RECEIPT: "serve_receipt"}  # fmt: skip
MAX_PENDING_GROUPS = 64
MAX_EXPECTED_GROUPS = 8  # groups we formed and have not begun the round of yet


class RoundRegistry:
    """Routes the avg.* streams (SERVED) to their round (one registry per host). A finished
    round lingers for part_timeout so that survivors can still fetch what it holds.

    Owns the handlers of every SERVED method on the host and the rounds by group id. A round
    joins with add() as it starts and calls finished() when it ends; a stream for a group not
    here yet waits for it up to request_timeout (its sender may be a moment ahead of us), for
    at most MAX_PENDING_GROUPS unknown groups at once. A group we formed (expect()) is waited
    for longer: our round starts only once our own inner steps end, while a member that was
    waiting in matchmaking sends at once."""

    def __init__(self, host: P2PHost, config: AveragingConfig) -> None:
        self.host, self.config = host, config
        self.rounds: dict[bytes, Any] = {}  # an AllReduceRound or a hierarchical GridRound
        self._arrived: dict[bytes, asyncio.Event] = {}
        self._expected: dict[bytes, float] = {}  # group id -> seconds its streams wait for our round (expect)
        self._timers: dict[bytes, asyncio.TimerHandle] = {}
        self._calls = 0  # streams being served now (`drain`)
        self._idle = asyncio.Event()
        self._idle.set()
        for method, serve in SERVED.items():
            host.add_stream_handler(method, self._route(method, serve))

    def close(self) -> None:
        for method in SERVED:
            self.host.remove_handler(method)
        for timer in self._timers.values():
            timer.cancel()

    async def drain(self, timeout: float) -> int:
        """Wait until no stream is being served (at most `timeout`); returns how many still are.
        A node that stops after its round must not close its host under its own answers: a
        backup's result half-written to its senders made them take the part to the next backup,
        which reduced it again, and the stopped node left holding another state than its group."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return self._calls

    def expect(self, group_id: bytes, wait_s: float) -> None:
        """We are in this group (matchmaking returned it) and will begin its round once our inner
        steps end: streams for it wait up to `wait_s` (the group's part timeout, which bounds the
        senders' own wait for our answer). With request_timeout alone, the member that had waited
        in matchmaking sent its slices at once to members still in their last inner steps on a
        busy machine (3-8 s behind it); they refused them ("no such group here"), it took every
        other owner for dead, reduced their parts alone and ended the round with another result
        than its group's."""
        self._expected[group_id] = wait_s
        self._arrived.setdefault(group_id, asyncio.Event())
        while len(self._expected) > MAX_EXPECTED_GROUPS:  # formed and never begun (a replan): the oldest go
            self.abandon(next(iter(self._expected)))

    def abandon(self, group_id: bytes) -> None:
        """We will not begin the round of a group we expected: its waiting streams are refused now."""
        if self._expected.pop(group_id, None) is None or group_id in self.rounds:
            return
        if (event := self._arrived.pop(group_id, None)) is not None:
            event.set()

    def add(self, round_: Any) -> None:
        group_id = round_.group.group_id
        self.rounds[group_id] = round_
        self._expected.pop(group_id, None)
        self._arrived.setdefault(group_id, asyncio.Event()).set()

    def finished(self, round_: Any) -> None:
        """Keep only what a finished round may still serve (its encoded averages), for a while."""
        round_.release()
        group_id = round_.group.group_id
        loop = asyncio.get_running_loop()
        self._timers[group_id] = loop.call_later(self.config.part_timeout, self._forget, group_id)

    def forget_finished(self) -> None:
        """Drop every finished round now (a caller that knows all members are done with them)."""
        for group_id in [g for g, r in self.rounds.items() if r.finished]:
            self._timers.pop(group_id).cancel()
            self._forget(group_id)

    def _forget(self, group_id: bytes) -> None:
        self.rounds.pop(group_id, None)
        self._expected.pop(group_id, None)
        self._arrived.pop(group_id, None)
        self._timers.pop(group_id, None)

    async def _find(self, args: Any) -> Any:
        if not isinstance(args, dict) or not isinstance(args.get("g"), bytes):
            raise BadRequest("needs a group id")
        group_id = args["g"]
        expected = group_id in self._expected
        if group_id not in self.rounds and (expected or len(self._arrived) < MAX_PENDING_GROUPS):
            event = self._arrived.setdefault(group_id, asyncio.Event())  # the caller may be a moment ahead
            wait_s = self._expected[group_id] if expected else self.config.request_timeout
            try:
                await asyncio.wait_for(event.wait(), wait_s)
            except asyncio.TimeoutError:
                if group_id not in self.rounds and group_id not in self._expected:
                    self._arrived.pop(group_id, None)
        round_ = self.rounds.get(group_id)
        if round_ is None:
            raise BadRequest("no such group here")
        return round_

    def _route(self, method: str, serve: str) -> Any:
        async def handler(ctx: CallContext, args: Any, stream: Stream) -> None:
            self._calls += 1
            self._idle.clear()
            try:
                serving = getattr(await self._find(args), serve, None)
                if serving is None:
                    raise BadRequest(f"{method}: this group's round does not serve it")
                await serving(ctx, args, stream)
            finally:
                self._calls -= 1
                if not self._calls:
                    self._idle.set()

        return handler
