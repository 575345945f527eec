"""The soak's churn schedule: what happens to the swarm when, a pure function of a seed and the
run's length (the same seed and length give the same schedule; the victims are chosen when each
event comes, among the nodes alive then).

Kinds of churn:
    kill        SIGKILL a random running node; it restarts from its checkpoint (same identity)
                `restart_after` seconds later
    kill_round  SIGKILL a node while it is inside an all-reduce (its "round" event came, its
                outer_step event did not); restarts as `kill`
    kill_fetch  SIGKILL a node while a peer fetches the swarm's state (the fetcher when its
                fetch is seen under way, else a node that serves it while a (re)started node
                has not started yet); restarts as `kill`
    term        SIGTERM a random running node (it checkpoints and leaves); restarts as `kill`
    join        start a newcomer (a new identity) that stays; while the swarm has its starting
                number of nodes or more, a random up node leaves for good first (SIGTERM: it
                checkpoints and goes, never back), as volunteers come and go: without it the
                swarm grew by every join (8 to 24 nodes in an hour) and the machine's load with it
    pause       SIGSTOP a random running node for `seconds` (longer than a round), then SIGCONT
    load        start busy processes (one per CPU) beside the swarm for `seconds`

An aimed kill waits for its moment (a round, a fetch), up to the harness's AIM_S; the events
after it then run as late as it did (`schedule_lag`), keeping their spacing. Fired as soon as it
went, the ones queued behind it came in one burst inside the round it waited for: in a 60-minute
soak whose rounds had grown long, four kills and a SIGTERM landed in one second, three of them
on the four members of one round.

Events come WARMUP_S after the start (the swarm forms and measures its rounds first) and stop
END_MARGIN_S before the end (the last restarts come back and catch up before the checks), about
every GAP_S seconds; the kinds come in shuffled decks, so every kind occurs in a long enough run
and kills inside rounds are the most common. One `load` burst covers the middle fifth of the run.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Collection

KILL, KILL_ROUND, KILL_FETCH, TERM, JOIN, PAUSE, LOAD = (
    "kill", "kill_round", "kill_fetch", "term", "join", "pause", "load",
)  # fmt: skip
KINDS = (KILL, KILL_ROUND, KILL_FETCH, TERM, JOIN, PAUSE, LOAD)
RESTARTED = (KILL, KILL_ROUND, KILL_FETCH, TERM)  # the victim comes back from its checkpoint
LEAVE = "leave"  # not scheduled: the node a join replaces (the harness notes it beside the join)
DECK = (KILL, KILL_ROUND, KILL_ROUND, KILL_FETCH, TERM, JOIN, PAUSE)
WARMUP_S = 60.0
END_MARGIN_S = 45.0
GAP_S = 30.0  # mean seconds between churn events (each gap is drawn in [0.5, 1.5] x this)
RESTART_AFTER_S = (5.0, 15.0)
PAUSE_S = (10.0, 20.0)  # longer than a round of the soak's swarm and than the part timeout's floor


@dataclasses.dataclass(frozen=True, slots=True)
class Churn:
    at_s: float  # seconds after the swarm's start
    kind: str  # one of KINDS
    seconds: float = 0.0  # pause and load: how long; restarted kinds: the wait before the restart

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown churn kind {self.kind!r}")
        if self.at_s < 0 or self.seconds < 0:
            raise ValueError("churn times are >= 0")


def kinds_problem(kinds: Collection[str]) -> str | None:
    """Why `kinds` is not a set of churn kinds (None: it is)."""
    if unknown := set(kinds) - set(KINDS):
        return f"unknown churn kinds {', '.join(sorted(unknown))}; known: {', '.join(KINDS)}"
    return None


def churn_schedule(
    seed: int, run_s: float, *, gap_s: float = GAP_S, kinds: Collection[str] = KINDS
) -> tuple[Churn, ...]:
    """The churn of a run of `run_s` seconds, in time order, of the `kinds` given (a soak that
    only pauses nodes, say, to reproduce what a pause does). Empty when the run is too short to
    leave any time between the warm-up and the end margin."""
    if not gap_s > 0:
        raise ValueError("gap_s must be positive")
    if (problem := kinds_problem(kinds)) is not None:
        raise ValueError(problem)
    rng = random.Random(seed)
    end = run_s - END_MARGIN_S
    events: list[Churn] = []
    if LOAD in kinds and end - WARMUP_S >= gap_s:  # one burst of CPU load over the middle fifth of the run
        events.append(Churn(round(0.4 * run_s, 3), LOAD, round(0.2 * run_s, 3)))
    dealt = [kind for kind in DECK if kind in kinds]
    deck: list[str] = []
    at = WARMUP_S + rng.uniform(0.0, 0.5 * gap_s)
    while dealt and at < end:
        if not deck:
            deck = list(dealt)
            rng.shuffle(deck)
        kind = deck.pop()
        seconds = rng.uniform(*PAUSE_S) if kind == PAUSE else rng.uniform(*RESTART_AFTER_S) if kind in RESTARTED else 0
        events.append(Churn(round(at, 3), kind, round(seconds, 3)))
        at += rng.uniform(0.5 * gap_s, 1.5 * gap_s)
    return tuple(sorted(events, key=lambda e: e.at_s))


def schedule_lag(lag: float, due_s: float, fired_s: float) -> float:
    """How late the schedule runs (seconds) once an event of `due_s` (its at_s) fired `fired_s`
    seconds after the start, when it already ran `lag` late: the events after it keep their
    spacing from it. Pure."""
    return max(lag, fired_s - due_s)
