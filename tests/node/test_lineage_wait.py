"""How long a node waits for the larger lineage of a fork (grouping.ForkWatch.outvoted): while
a larger group formed beside one of its last rounds it does not matchmake with its own state,
for max_wait at most; then it forgets those rounds and goes on (fake FORMED markers of a larger
group that no state ever follows must not stop it for good). The averager's answer is given:
what it reads is tested in test_fork_healing.py and tests/averaging/test_ready.py."""

from __future__ import annotations

import asyncio

from swarm.node.grouping import ForkWatch
from swarm.p2p.identity import Identity
from swarm.p2p.peer_id import PeerID

# the members of the round before step 4's: whose FORMED markers of step 4 count
VOTERS = frozenset(Identity.from_seed(bytes([i]) * 32).peer_id for i in (1, 2))


class Answers:
    """An averager whose lineage check says what the test sets, and records what it was asked."""

    def __init__(self, outvoted: bool) -> None:
        self.outvoted_now, self.asked = outvoted, []

    async def outvoted(self, step: int, group_id: bytes, state: bytes, voters: frozenset[PeerID] | None) -> bool:
        self.asked.append((step, group_id, voters))
        return self.outvoted_now


def node(max_wait: float) -> ForkWatch:
    end = ForkWatch(max_wait)
    end.stepped(3, b"\x03" * 32, b"\x02" * 32, None)
    end.stepped(4, b"\x04" * 32, b"\x03" * 32, VOTERS)
    return end


async def test_an_outvoted_node_waits_at_most_max_wait_then_goes_on_with_its_state() -> None:
    end, averager = node(max_wait=0.3), Answers(outvoted=True)
    assert await end.outvoted(averager, 5)  # type: ignore[arg-type]
    assert averager.asked == [(4, b"\x04" * 32, VOTERS)]  # the latest round first; one outvoted is enough
    await asyncio.sleep(0.35)
    assert not await end.outvoted(averager, 5)  # type: ignore[arg-type]
    assert not end.rounds and end.outvoted_since is None
    assert not await end.outvoted(averager, 6)  # type: ignore[arg-type]  # those rounds are forgotten


async def test_only_rounds_before_this_step_are_checked_and_a_clean_check_resets_the_wait() -> None:
    end, averager = node(max_wait=60.0), Answers(outvoted=False)
    assert not await end.outvoted(averager, 4)  # type: ignore[arg-type]
    assert averager.asked == [(3, b"\x03" * 32, None)]  # step 4's round is this step's: not a past one
    averager.outvoted_now = True
    assert await end.outvoted(averager, 5)  # type: ignore[arg-type]
    since = end.outvoted_since
    averager.outvoted_now = False
    assert not await end.outvoted(averager, 5) and end.outvoted_since is None and since is not None  # type: ignore[arg-type]
    assert len(end.rounds) == 2  # nothing forgotten: the larger group is gone (its owners left)
