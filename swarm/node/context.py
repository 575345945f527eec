"""What one run of a node hands its outer-step loop: the services (RunContext, fixed for the run)
and the step's mutable facts (StepFacts, one writer per field).

SwarmNode (node.py) builds the RunContext once in its run method, after its host, DHT node,
averager, lineage book, state keeper and progress book exist, and keeps one StepFacts for its
life; the loop (loop.py) and the step's end (step_end.py) read both. A field of StepFacts is
written by the one method its comment names, so what changes it can be read in one place.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarm.p2p.reach import DIRECT

if TYPE_CHECKING:
    from swarm.averaging.averager import Averager
    from swarm.model.compression_spec import CompressionSpec
    from swarm.model.diloco import DiLoCo
    from swarm.model.error_feedback import ErrorFeedback
    from swarm.node.config import NodeConfig
    from swarm.node.events import EventSink
    from swarm.node.inner_steps import InnerSteps
    from swarm.node.progress import ProgressBook
    from swarm.node.settings import RunSettings
    from swarm.state.keeper import StateKeeper
    from swarm.state.lineage_book import LineageBook


@dataclass(frozen=True, slots=True)
class RunContext:
    """The node's parts and services for one run; none of them is replaced while it runs."""

    config: NodeConfig
    diloco: DiLoCo  # the model, its outer optimizer and its inner steps' bookkeeping
    inner: InnerSteps  # the inner-step permits and the model's worker thread
    events: EventSink
    averager: Averager  # matchmaking and the all-reduce
    keeper: StateKeeper  # serves, fetches and checkpoints the state
    book: ProgressBook  # the run's progress records in the DHT
    lineage: LineageBook  # the receipts of the rounds that made our state
    stop: asyncio.Event  # set by whoever runs the node: finish the round under way, then end
    client: bool  # client mode, as the reachability check left it: trains, serves nothing
    # where peers reach us now (none in client mode; a NATed node's relays change): our progress record says them
    maddrs: Callable[[], list[str]]
    settings: RunSettings  # the run settings we train with (settings.py), with their digest
    evaluate: Callable[[], float] | None  # the eval loss of the model as it is; None: the caller's model
    feedback: ErrorFeedback | None  # --error-feedback: the codec's residual (model/error_feedback.py)
    compression: CompressionSpec  # --compression CODEC[:DENSITY] (model/compression.py)
    block_size: int
    # unix time, read wherever the loop builds the facts it plans from (plan.py reads no clock)
    clock: Callable[[], float] = time.time
    # how peers reach us now: direct, punched or relayed (reachability.py); our record says it
    reach: Callable[[], str] = lambda: DIRECT
    # no peer can know of us yet: we began the run's genesis with no initial peers and nobody has
    # reached us since (none in our DHT table, none connected). A node that joins the run dials us
    # first, so no peer can be training it unseen (plan_without_group does not wait to hear from one)
    unknown: Callable[[], bool] = lambda: False


@dataclass(slots=True)
class StepFacts:
    """What the node's outer steps have left behind so far. Each field has one writer, named
    on it; everyone else only reads."""

    # writer: OuterLoop._plan_and_train, as it plans a step: `fetches` at that moment. A node that
    # joined peers starts at -1: its first step is late even when it had nothing to fetch
    planned_at: int
    # writer: StepEnd.fetch: fetches of the swarm's state so far (the one at the start included)
    fetches: int = 0
    # writer: StepEnd.rehash: the hash of the state we hold, which we announce in matchmaking
    state_sha: bytes = b""
    # writer: StepEnd.in_sync: (the swarm's step, unix time we knew it), after a fetch or a step
    # with a group; the base of the plausible-step horizon. None until then: a node that just
    # started does not know how far the run had come before it (a newcomer must still fetch step 500)
    known_at: tuple[int, float] | None = None
    # writer: StepEnd.stepped: size of our last group (1: we stepped alone); 0: no step done here yet
    last_group: int = 0
    tokens: int = 0  # writer: StepEnd.stepped: tokens of the inner steps of our outer steps
    last_eval: float | None = None  # writer: StepEnd.stepped: the last eval loss
    eval_s: float = 0.0  # writer: StepEnd.stepped: seconds spent in evals, all steps
    # writer: StepEnd.finish: the run's last step was taken without us and its result is gone (plan.END)
    run_over: bool = False
    # writer: Landing (step_end.py), the one step ending in the background (--overlap): (step,
    # inner steps, target) of that step while its group is not formed, which our record says
    # meanwhile instead of the next step's figures; None otherwise
    unmatched: tuple[int, int, int] | None = None
    began: float = 0.0  # writer: OuterLoop.run: the event loop's time when training began
    # writer: OuterLoop.run, once: the outer steps done at which we stop (the run's end, or our own
    # --leave-after-steps from the step we joined at: settings.stop_step); None: until stopped
    stop_at: int | None = None

    def last_step(self, step: int) -> bool:
        """Is `step` (0-based) our last: the run's, or the last before we leave?"""
        return self.stop_at is not None and step + 1 >= self.stop_at

    @property
    def late(self) -> bool:
        """The first step after joining or fetching: the peers may have started it before us."""
        return self.planned_at < self.fetches
