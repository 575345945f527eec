"""What a training node does at each outer step: pure functions of the facts, no I/O.

The node gathers the facts (its own step and pace, its peers' progress records, the time: view.py,
from the run's clock), asks these functions, and executes the plan (loop.py, step_end.py). No
function here reads a clock: the time comes in (Facts.now, `own_finish`), so a test sets it.
The rule they keep, one swarm and one state: a node never goes on with a state of its
own while live peers work on its outer step or a later one. It either averages with every ready
node of its step, or fetches the swarm's result; it applies its own pseudo-gradient only when no
live peer could give it one.

    plan_step(facts)            -> at the start of a step: fetch | train k | join the forming group
    plan_without_group(...)     -> matchmaking found no group: fetch | await the result | retry |
                                   apply our own Δ (not while peers behind would not follow it) |
                                   end the run (its last step was taken without us)
    recently_stale(facts)       -> the peers of our step whose records went stale only just
    expected_peers(facts, ...)  -> whom matchmaking waits for
    matchmaking_start(...)      -> when to start matchmaking while the last inner steps run
    swarm_together(facts, ...)  -> whether an overlapped node may train on while its group forms
    steps_for_slower(...)       -> how many more inner steps an overlapped node done with its H
                                   trains into the step's Δ while a slower peer finishes
    nodes_to_start_with(...)    -> how many more nodes a node of a new run waits for (--start-with)
    starting_together(facts)    -> the nodes at a new run's first step (0: it has begun)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from swarm.node.progress import PeerProgress
from swarm.p2p.peer_id import PeerID

FETCH = "fetch"  # the swarm's state is newer than ours, or not ours: fetch it first
TRAIN = "train"  # train `inner_steps` inner steps, then matchmake
JOIN_FORMING = "join_forming"  # the peers of our step are matchmaking: join now with weight 0
AWAIT_RESULT = "await_result"  # a group of our step formed without us: wait for its result, then fetch it
RETRY = "retry"  # no group yet, but live peers of our step will be ready: matchmake again
APPLY_OWN = "apply_own"  # no live peer at our step or beyond: our own Δ is the swarm's step
END = "end"  # the run's last step was taken without us and its result is gone: end without it
RECHECK = "recheck"  # the last step: matchmake once more to see whether the group that formed without us stands

# a record older than its freshness window, but not older than this many times it, is of a peer
# that may still be alive (plan_without_group waits for one at our step: recently_stale)
STALE_GRACE = 2.0


@dataclass(frozen=True, slots=True)
class Facts:
    """What a node knows when it decides."""

    step: int  # the outer step it works on (outer steps applied to the state it holds)
    inner_steps: int  # H
    own_sec: float  # its seconds per inner step (0.0: not timed yet)
    client: bool  # it accepts no inbound connections: it can neither lead nor serve
    peers: tuple[PeerProgress, ...]  # its peers' latest progress records
    now: float  # unix time
    fresh_for: float  # records older than this are of dead or stuck peers
    late: bool = False  # its first step after joining or fetching: its peers may have started before it
    watched_for: float = float("inf")  # seconds since it first read its peers' records
    sees_peers: bool = True  # its last read of the records got an answer (it is not cut off)
    own_record_age: float = 0.0  # seconds since its own record was last stored (inf: never)
    unknown: bool = False  # no peer can know of it yet (RunContext.unknown): none can be in the run
    margin: float = 0.3  # seconds it keeps for its announcement to reach the DHT
    # the members of the round that made the state it holds (lagging_mate)
    last_round: frozenset[PeerID] = frozenset()

    def live(self) -> list[PeerProgress]:
        """The peers still training: records fresh, and not their last one (they left)."""
        return [p for p in self.peers if p.is_live(self.now, self.fresh_for)]

    def summary(self) -> str:
        """The facts a decision to go on alone rests on, in one line for the log."""
        live = self.live()
        steps: dict[int, int] = {}
        for p in live:
            steps[p.step] = steps.get(p.step, 0) + 1
        stale = [p for p in self.peers if not p.left and self.now - p.time > self.fresh_for]
        oldest = max((self.now - p.time for p in stale), default=0.0)
        return (
            f"live records by step {dict(sorted(steps.items()))}, {len(stale)} stale, "
            f"{len(self.peers) - len(live) - len(stale)} left "
            f"(oldest {oldest:.1f}s, fresh for {self.fresh_for:.1f}s), watched {self.watched_for:.1f}s, "
            f"records read {'ok' if self.sees_peers else 'failed'}, ours stored {self.own_record_age:.1f}s ago"
        )


@dataclass(frozen=True, slots=True)
class StepPlan:
    action: str  # one of the constants above
    why: str
    inner_steps: int = 0  # TRAIN: how many


def swarm_is_ahead(f: Facts) -> bool:
    """At least as many live servers are at later steps as stand at ours (us included): the
    swarm moved on. Fewer (one peer claiming a later step while others train with us) is not
    the swarm's result: the same rule as trust.py's for the states advertised. Only a server's
    state can be fetched."""
    live = [p for p in f.live() if not p.client]
    ahead = sum(1 for p in live if p.step > f.step)
    return ahead > 0 and ahead >= 1 + sum(1 for p in live if p.step == f.step)


def lagging_mate(f: Facts, p: PeerProgress) -> bool:
    """A member of the round that made our state whose record still says that round's step (a
    store takes seconds under load): it trains our step, begun when we did. Read as one step
    behind, two nodes of a soak formed a group of two while 10 of their last round trained."""
    return p.step == f.step - 1 and p.peer_id in f.last_round


def plan_step(f: Facts) -> StepPlan:
    """At the start of outer step f.step (the node holds its state, no inner step done)."""
    live = f.live()
    if swarm_is_ahead(f):
        return StepPlan(FETCH, "peers are at a later outer step")
    same = [p for p in live if p.step == f.step]
    same_servers = [p for p in same if not p.client]
    done = [p for p in same_servers if p.inner >= p.inner_steps]
    training = len(same_servers) + sum(1 for p in live if lagging_mate(f, p) and not p.client)
    if 2 * len(done) > training:  # most of them: one record alone cannot stop our training
        return StepPlan(JOIN_FORMING, "the peers of our step are matchmaking")
    h = f.inner_steps
    started = [p for p in same if 0 < p.inner < p.inner_steps and not p.client]  # clients wait for servers
    if not f.late or not started:
        return StepPlan(TRAIN, "a whole step" if same else "no live peer at our step", h)
    sec = f.own_sec if f.own_sec > 0 else median_pace(started)
    if sec <= 0:
        return StepPlan(TRAIN, "no pace known yet", h)
    # trained on fewer tokens, weighted by them (hivemind lets late peers join with the samples they have)
    horizon = straggler_horizon(f, f.now + h * sec)
    left = max([p.finish_time() for p in started if p.finish_time() <= horizon], default=f.now) - f.now - f.margin
    steps = min(h, int(left / sec)) if left > 0 else 0
    if steps <= 0:
        return StepPlan(JOIN_FORMING, "the peers of our step finish before we could train")
    return StepPlan(TRAIN, "the peers started before us: finish with them", steps)


def plan_without_group(f: Facts, *, late: bool, other_state: bool, waited: float, max_wait: float,
                       ready_peers: int = 0, groupless_for: float = 0.0, last: bool = False,
                       late_confirmed: bool = False) -> StepPlan:  # fmt: skip
    """Matchmaking of f.step ended without a group. `late`: a group of our state formed without
    us; `other_state`: the swarm starts this step from another state; `waited`: seconds since
    the last matchmaking of this step ended without a group (`groupless_for`: the first);
    `ready_peers`: the other nodes of our state the last one found ready with us. A node never applies
    its own Δ while a group of its state formed without it (`late`: its result will come), nor
    before it has watched its peers' records for a whole freshness window (a peer that started
    with it may not have published yet), nor within max_wait of matchmaking with ready peers of
    its state (their records may just be stale: under load, 16 nodes on 2 cores each went on
    alone from stale records, 16 states at one step), nor while a peer of its step went stale
    only just (recently_stale: a live peer's records can be late on a busy machine). At the
    run's `last` step it never applies its own Δ, nor groups with other late ones, after the
    swarm took the step without it (a group of its state formed, or a record says a later step)
    and its result did not reach it in max_wait: those peers finished the run with the step's
    result and left, and our own Δ, or a group of the late ones, would be a second final state;
    it ends without the step (END). Before that it matchmakes once more (RECHECK), trusting the
    FORMED markers still: a group whose round failed withdrew its marker, and its members are
    matchmaking again (`late_confirmed`: that matchmaking found the marker still standing; then
    it waits max_wait more for the result: a round can outlast max_wait on a loaded machine)."""
    if other_state:
        return StepPlan(FETCH, "our state is not the swarm's")
    live = f.live()
    if swarm_is_ahead(f):
        return StepPlan(FETCH, "the step's result is out")
    # a client can only average with a server; a server with anyone (clients join it)
    same = [p for p in live if p.step == f.step and not (f.client and p.client)]
    if last and late and waited >= max_wait:
        if late_confirmed:  # and we waited max_wait more for its result
            return StepPlan(END, "the run's last step was taken without us and its result did not come: ending")
        return StepPlan(RECHECK, "the last step's result did not come: does its group still stand?")
    taken_without_us = any(p.step > f.step for p in f.peers)  # stale records too: they finished the run
    if late and waited >= max_wait and not any(p.step >= f.step and not p.client for p in live):
        late = False  # waited it out, and no server that could hold the result is left: it is lost
    if late or same:
        if late and waited < max_wait:
            return StepPlan(AWAIT_RESULT, "a group of our step formed without us")
        # peers that are done training wait for a group too: matchmaking again at once meets them
        return StepPlan(RETRY, "live peers of our step have no result yet: matchmake again")
    if ready_peers and groupless_for < max_wait:  # they announced with us: they are live, records or not
        return StepPlan(RETRY, f"{ready_peers} peer(s) of our state were ready with us: not going on alone")
    if f.watched_for < f.fresh_for and not f.unknown:  # a peer that just started may not have published yet
        return StepPlan(RETRY, "no live peer seen yet: waiting to hear from any that just started")
    if not f.sees_peers:  # not seeing anyone is not knowing that nobody is there
        return StepPlan(RETRY, "cannot read the peers' records: not going on alone")
    if f.own_record_age > f.fresh_for:
        # our own record is as old as a dead peer's: this machine stalls (16 nodes on a loaded
        # 2-core machine saw every record 11 s old, theirs and their own, and went on alone)
        return StepPlan(RETRY, "our own record is stale too: a stalled machine, not dead peers, may explain theirs")
    quiet = recently_stale(f)
    if quiet:
        # a live process whose records are late (its stores or its loop starved on a busy
        # machine) looks like a dead one for a while: one that was at our step and went quiet
        # only just is waited for, a freshness window at most (a peer dead for longer is gone)
        stale_for = max(f.now - p.time for p in quiet) - f.fresh_for
        return StepPlan(RETRY, f"{len(quiet)} peer(s) of our step stale for only {stale_for:.1f}s: waiting for them")
    if waited < max_wait and not f.client and behind_would_not_follow(f):
        return StepPlan(RETRY, "peers behind us would not follow a step we took alone: waiting for them")
    if last and taken_without_us:
        return StepPlan(END, "the run's last step was taken without us and its holders left: ending without it")
    return StepPlan(APPLY_OWN, "no live peer at our step: ours is the swarm's state")


ROUND_TIMEOUTS = 4  # a round's waits: a dead member costs about two part timeouts, its backup one more


def result_still_coming(waited: float, max_wait: float, part_timeout: float, owners_at_step: bool,
                        markers_stand: bool) -> bool:  # fmt: skip
    """Past max_wait (plan_without_group: RETRY), a late node waits on for the result of the group
    that formed without it while its marker owners' live records still say the step and their
    FORMED markers stand (its round has not landed, nor failed: a failed round withdraws its
    markers and its members matchmake again), ROUND_TIMEOUTS part timeouts at most: matchmaking
    again, the late ones of a soak at rounds of 60-130 s formed groups of their own, second
    results. Waiting on a leader that had swallowed their joins, paused, and whose group's round
    then failed for want of their parts, two late soak nodes sat out the whole 270 s while the
    leader, at the step, could not form a group without them. A live identity renewing markers
    of a group that never was holds a late node that long at most."""
    return owners_at_step and markers_stand and max_wait <= waited < max_wait + ROUND_TIMEOUTS * part_timeout


def recently_stale(f: Facts) -> list[PeerProgress]:
    """The peers whose last record said our outer step and went stale less than one freshness
    window ago (older than f.fresh_for, not older than twice it): the ones that may be alive and
    about to average our step, with records late (under load, a live peer's record was 4.0 s old
    against a freshness of 3.5 s, and its peer stepped alone: two states at one step). A client
    waits only for servers (it cannot average with a client). Past twice the window a peer is
    taken for dead: a node whose peers died goes on at most one window later than before."""
    return [p for p in f.peers if p.step == f.step and not (f.client and p.client) and not p.left
            and f.fresh_for < f.now - p.time <= STALE_GRACE * f.fresh_for]  # fmt: skip


def behind_would_not_follow(f: Facts) -> bool:
    """Live servers behind us that would not take our state were we to step alone: at some earlier
    step stand more of them than the servers beyond it (us included), so swarm_is_ahead is false
    from where they stand. Stepping alone would then leave two lineages (seen with 1-s steps: one
    node stepped alone while two fetched, and they trained on their own state ever after)."""
    servers = [p for p in f.live() if not p.client]
    for step in {p.step for p in servers if p.step < f.step}:
        same = sum(1 for p in servers if p.step == step)
        beyond = 1 + sum(1 for p in servers if p.step > step)  # us, and the servers between
        if beyond < same:
            return True
    return False


def straggler_horizon(f: Facts, own_finish: float) -> float:
    """The latest predicted finish worth waiting for, whatever max_wait allows: the median finish
    of our step (ours included) plus one step at our pace (the peers' median until we know
    ours), or plus the records' freshness window when that is longer (a prediction from a
    record is no finer than it). A
    peer predicted to finish later (stalled, very slow, or lying to hold every step) is not
    waited for, so one identity's records delay a step by at most that much."""
    same = [p for p in f.live() if p.step == f.step]
    finishes = sorted([own_finish, *(finish for _, finish in step_finishes(f, own_finish))])
    # our own pace when we know it (a record's pace is what a liar sets), else the peers' median
    pace = f.own_sec if f.own_sec > 0 else median_pace(same)
    median = finishes[(len(finishes) - 1) // 2]  # the lower median: a liar cannot raise it alone
    return max(own_finish, median + max(f.inner_steps * pace, f.fresh_for))


def expected_peers(f: Facts, own_finish: float, max_wait: float) -> frozenset[PeerID]:
    """The live peers of our step that should be ready by own_finish + max_wait and within the
    straggler horizon, and the live peers one step behind: matchmaking ends as soon as all of
    them have announced (the window bounds the wait for the rest). A peer one step behind
    missed our last group: it catches up from that step's update, in well under a second, and
    joins this step's group (plan_step: JOIN_FORMING). Not expected, it never did while the
    step's end overlapped the next step's training: the next group formed the moment the last
    round landed, before the late peer could hold its result, and it chased the others one
    step behind for a whole run."""
    bound = min(own_finish + max_wait, straggler_horizon(f, own_finish))
    return frozenset(
        p.peer_id for p in f.live() if (p.step == f.step and predicted_finish(f, p) <= bound) or p.step == f.step - 1
    )


def latest_finish(f: Facts, own_finish: float, max_wait: float) -> float:
    """When the slowest live peer of our step should finish (unix time), never later than
    own_finish + max_wait (a stalled or very slow peer does not hold the group) and never
    earlier than own_finish; peers beyond the straggler horizon are not counted at all."""
    horizon = straggler_horizon(f, own_finish)
    end = own_finish
    for _, finish in step_finishes(f, own_finish):
        if finish <= horizon:
            end = max(end, min(finish, own_finish + max_wait))
    return end


def step_finishes(f: Facts, own_finish: float) -> list[tuple[PeerProgress, float]]:
    """The live peers that train our step, each with when it should be done: the peers of our
    step (predicted_finish), and our round mates whose records lag (lagging_mate), begun when we
    began, at their own pace (ours when their record has none)."""
    began = own_finish - f.inner_steps * f.own_sec if f.own_sec > 0 else f.now  # untimed: we begin now
    found = []
    for p in f.live():
        if p.step == f.step:
            found.append((p, predicted_finish(f, p)))
        elif lagging_mate(f, p):
            found.append((p, began + f.inner_steps * (p.sec_per_step if p.sec_per_step > 0 else f.own_sec)))
    return found


def predicted_finish(f: Facts, p: PeerProgress) -> float:
    """When peer p should reach H inner steps: from its record's pace, or, before it has timed an
    inner step, at our own pace from its record's time. (Read as "now", an untimed peer was
    never waited for: at the start of a run, a process still warming up missed every group of
    a run of short steps.)"""
    if p.sec_per_step > 0 or p.inner >= p.inner_steps:
        return p.finish_time()
    return p.time + (p.inner_steps - p.inner) * f.own_sec


def matchmaking_start(f: Facts, own_finish: float, matchmaking_time: float, max_wait: float) -> float:
    """When to announce: matchmaking_time before the slowest live peer of our step should finish,
    so that the group forms while the last inner steps run."""
    return latest_finish(f, own_finish, max_wait) - matchmaking_time


def unkept_markers(
    late_by: frozenset[PeerID], members: frozenset[PeerID], live: frozenset[PeerID]
) -> frozenset[PeerID]:
    """The owners of FORMED markers that made us late at a step (`late_by`) whose markers are not
    to be believed again, once we took the step's result from a round of `members`: those not in
    that round and with no live progress record (`live`), so no training node at all. An identity
    that renews a marker of our state at every step kept a node that started after the others
    had waited out its marker late at each: the result of the group the others formed without it
    came, it fetched that, and never averaged again (36 steps of fetches in one CI run).
    A live node's marker is kept whatever round we took: a group of our state can form beside
    another at one step (a fork), and a node that ignores its former's markers later matchmakes
    when it is late, and may form a second group of one state at one step. Such a node's
    identity renewing markers it never keeps is bounded by max_wait only (step_end.py)."""
    return late_by - members - live


def peers_matchmaking(f: Facts, announced: Mapping[PeerID, bytes], state: bytes) -> int:
    """How many peers whose live records say our step are matchmaking it already with our state
    (`announced`: ready, or in a group of it, with the state each named). A node waiting for
    slower peers stops waiting when any is: their group forms now, whatever our records predict
    of the slower ones, and a node that waits on is left out of it (under load, views of who is
    slow differ: in a 60-minute soak six nodes, ready and up, waited 25 s for slower peers while
    eleven others formed the step's group, and fetched its result)."""
    return sum(1 for p in f.live() if p.step == f.step and announced.get(p.peer_id) == state)


def steps_for_slower(f: Facts, extra_done: int, max_wait: float) -> int:
    """Our H inner steps are done (--overlap-matchmaking) and the round cannot start before the
    slowest live peer of our step finishes (latest_finish: within the straggler horizon and
    max_wait). How many more inner steps of ours, into this step's Δ, end before that? A faster
    node trains them rather than start the next step early: every inner step it trains before
    the average lands is computed from a proxy of θ_outer (the next step's start), and a node
    that starts the next step a second before the slowest lands that average a second later
    into it (each step of such lag cost about 0.5% of eval loss in scripts/experiments/overlap_sweep.py).
    At most H more in all (DiLoCo.extra_room: `extra_done` so far), and none without our pace."""
    if f.own_sec <= 0 or extra_done >= f.inner_steps:
        return 0
    fit = int((latest_finish(f, f.now, max_wait) - f.now) / f.own_sec)
    return min(fit, f.inner_steps - extra_done)


def median_pace(peers: list[PeerProgress]) -> float:
    """The median seconds per inner step of the peers that have timed one (0.0: none has)."""
    positive = sorted(p.sec_per_step for p in peers if p.sec_per_step > 0)
    return positive[len(positive) // 2] if positive else 0.0


def borrowed_pace(peers: list[PeerProgress]) -> float:
    """The pace a node that has not timed a step yet publishes as its own: the lower median of
    its peers' timed paces, and nothing (0.0) from fewer than two of them. One peer's record
    must not set what honest nodes say of themselves (a liar claiming a slow pace would make
    every fresh node look slow, and the straggler horizon follow it)."""
    positive = sorted(p.sec_per_step for p in peers if p.sec_per_step > 0)
    return positive[(len(positive) - 1) // 2] if len(positive) >= 2 else 0.0


def servers_behind(f: Facts) -> bool:
    """Every live server works on an earlier outer step than ours, and none has finished the
    inner steps that would bring its next state to ours. False when no server is live."""
    servers = [p for p in f.live() if not p.client]
    return bool(servers) and all(p.step + (p.inner >= p.inner_steps) < f.step for p in servers)


def peers_still_behind(f: Facts) -> list[PeerProgress]:
    """The live peers (clients too) still working on a step before ours. A node that finished the
    run's last step stays while there are any (up to max_wait): they missed its group and can
    only catch up by fetching its state; had it left at once, they would step alone and fork."""
    return [p for p in f.live() if p.step < f.step]


def swarm_together(f: Facts, last_group: int) -> bool:
    """Our last group (its size: clients in it count too) held as many members as there are
    live servers we know of, us included: the swarm trains as one.
    Only then does an overlapped node train the next step while its group forms (loop.py).
    While nodes straggle in (a start, a missed group) it waits for its group instead: had the
    ones in groups trained on, they would step without the stragglers, whose catching up by
    one step at a time would never reach them (seen: two pairs chasing for a whole run)."""
    servers = sum(1 for p in f.live() if not p.client)  # peers: we are not among them
    return last_group >= 2 and last_group >= 1 + servers


def starting_together(f: Facts) -> int:
    """The nodes, us included, at a new run's first step: 0 once it has begun (we hold a later
    state, a peer is past step 0, or a live one is training: it started without us)."""
    live = f.live()
    if f.step > 0 or any(p.step > 0 or p.inner > 0 for p in live):
        return 0
    return 1 + len(live)


def nodes_to_start_with(f: Facts, start_with: int) -> int:
    """How many more nodes a node at a run's first step waits for before it trains
    (--start-with N: N nodes, itself included, start the run together). 0 once enough live
    ones are there, or when the run has begun: we join it as any newcomer does."""
    present = starting_together(f)
    return 0 if present == 0 else max(0, start_with - present)
