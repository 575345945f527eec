"""SwarmNode: one training process of the swarm, wiring the layers (DESIGN.md "Training").

    node = SwarmNode(NodeConfig(run_id="demo", model="tiny"), identity=..., initial_peers=[...],
                     p2p_config=P2PConfig(host_maddrs=(...,)), on_event=print)
    reason = await node.run(stop_event)

A test may inject the data and the model (`data=`, `model=`) and run many nodes in one loop.

The node is made by composition: `run` builds the run's context (context.RunContext: the host's
services, the averager, state keeper, lineage and progress books, the stop event) and hands it,
with the node's StepFacts (the step's mutable facts, one writer per field), to the outer-step
loop (loop.OuterLoop), which reads one outer step top to bottom.

Events (`on_event`, called on the event loop; the CLI writes them as JSON lines): events.py.

Reachability: before joining the DHT a node with initial peers asks one of them to dial it back
(swarm/p2p/autonat.py). A node peers can reach relays for the others (unless `relay` is None). A
node nobody can dial is behind NAT: it starts its host again dialing from its listening port,
reserves a relayed address on one of its initial peers and punches holes to the peers that dial
it (reachability.py); it is then a full member whose members' entry says how it is reached (a
member reached only through the relay owns no part). Only a NATed node no relay takes runs in
client mode: it trains and contributes, but owns no part of an all-reduce and serves nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from swarm.averaging.averager import Averager
from swarm.data.claimer import ChunkClaimer, start_claiming
from swarm.data.cursor import ChunkCursor, cursor_for
from swarm.data.progress import node_progress
from swarm.dht.config import DHTConfig
from swarm.dht.node import DHTNode
from swarm.model.checkpoint import CheckpointError, RunInfo
from swarm.model.data import TokenData, eval_windows
from swarm.model.diloco import OptimizerFactory
from swarm.model.loss import eval_loss
from swarm.model.presets import preset
from swarm.model.state_hash import model_fingerprint
from swarm.node import starting
from swarm.node.config import NodeConfig
from swarm.node.context import RunContext, StepFacts
from swarm.node.errors import NodeError
from swarm.node.events import Event, EventSink
from swarm.node.inner_steps import InnerSteps
from swarm.node.loop import OuterLoop
from swarm.node.model_setup import build_node_model, load_node_data, node_diloco, node_error_feedback
from swarm.node.plan import swarm_is_ahead
from swarm.node.progress import ProgressBook, publish_delay
from swarm.node.reachability import NodeReach
from swarm.node.run_lookup import initial_peer_ids
from swarm.node.settings import (
    API_REMEDY,
    CLI_REMEDY,
    CUSTOM_MODEL,
    RunSettings,
    custom_settings,
    disagreement,
    run_end_to_adopt,
    run_settings,
    training_settings,
)
from swarm.node.training_thread import DataTrainingThread, TrainingThread, TrainingThreadFactory
from swarm.node.view import SwarmView
from swarm.p2p.autonat import check_reachability
from swarm.p2p.config import P2PConfig
from swarm.p2p.host import P2PHost
from swarm.p2p.identity import Identity
from swarm.p2p.reach import relayed_may_own
from swarm.p2p.relay import RelayConfig
from swarm.state.adoption import PENDING_S
from swarm.state.keeper import StateKeeper
from swarm.state.lineage_book import LineageBook
from swarm.utils.supervised import Supervised

logger = logging.getLogger(__name__)

__all__ = ["Event", "NodeError", "SwarmNode"]

START_FETCH_TRIES = 4  # fetches at start while the swarm is ahead and its state's judgement pending
TRAINING_THREAD_END_WAIT = 60.0  # seconds for the training thread to finish its inner step at exit


class SwarmNode:
    """One training process: owns its model (DiLoCo), its inner-step permits (and swarm-node's
    training thread), the step's mutable facts (StepFacts) and, while `run` runs, its host, DHT
    node, averager, state keeper and progress book.

    The orchestrator: `run` builds those into the run's context, resumes or fetches the swarm's
    state, hands the context to the outer-step loop (OuterLoop, loop.py) and closes them;
    meanwhile it publishes our progress record in the DHT."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        identity: Identity | None = None,
        initial_peers: tuple[str, ...] = (),
        p2p_config: P2PConfig | None = None,
        on_event: Callable[[Event], None] | None = None,
        data: TokenData | None = None,
        model: nn.Module | None = None,
        id_proof_path: Path | None = None,
        dht_config: DHTConfig | None = None,
        inner_optimizer: OptimizerFactory | None = None,
        evaluate: Callable[[nn.Module], float] | None = None,
        training_thread: TrainingThreadFactory = DataTrainingThread,
        relay: RelayConfig | None = RelayConfig(),  # noqa: B008 (frozen): relaying for others; None: off
    ) -> None:
        self.config = config
        self.id_proof_path = id_proof_path  # the DHT id's proof of work, kept next to the identity file
        self.dht_config = dht_config or DHTConfig()
        self.identity = identity or Identity.generate()
        self.peer_id = self.identity.peer_id
        self.initial_peers = initial_peers
        self.p2p_config = p2p_config or P2PConfig()
        self.events = EventSink(str(self.peer_id), on_event)
        self.client_mode = config.client_mode
        self.relay = relay
        self.reach: NodeReach | None = None  # while `run` runs: how peers reach us (reachability.py)
        self._training_thread: TrainingThread | None = None  # swarm-node's own (the caller's thread, in swarm.join)
        self._cursor: ChunkCursor | None = None  # prepared data: our position in the chunks we claim
        if config.model == CUSTOM_MODEL:  # swarm.join: the caller's model, optimizer and loop
            if model is None:
                raise NodeError("model 'custom' trains the caller's own model: hand it in (swarm.join)")
            self.diloco = node_diloco(model, config, inner_optimizer)
            architecture, initial = model_fingerprint(self.diloco)
            self._fingerprint: tuple[str, str] | None = (architecture, initial)
            model_config: dict[str, Any] = {"architecture": architecture, "parameters": self.diloco.parameter_count}
            data_name = "caller"
            self._evaluate = None if evaluate is None else functools.partial(evaluate, model)
        else:
            data = data if data is not None else load_node_data(config)
            preset_config = preset(config.model, vocab_size=data.vocab_size)
            model_config, data_name = dataclasses.asdict(preset_config), data.name
            if model is None:
                model = build_node_model(config, preset_config)
            # inner_optimizer: None (AdamW), or --shard's HeldOptimizer: the ranks step the shards
            self.diloco = node_diloco(model, config, inner_optimizer)
            self._fingerprint = None
            eval_set = eval_windows(data.eval, config.seq_len, config.eval_windows)
            self._evaluate = functools.partial(eval_loss, model, eval_set)
            # prepared data: disjoint chunks across the swarm (swarm/data/)
            self._cursor = cursor_for(data.train, seq_len=config.seq_len, name=data.name)
        self.inner = InnerSteps(self.diloco)  # inner steps run only while the node allows them
        if config.model != CUSTOM_MODEL:
            # DataTrainingThread; a node of several ranks: rank 0's LeaderTrainingThread (swarm/ranks/leader.py).
            # With prepared data, DataTrainingThread reads the chunks this node claimed
            chunks = {"cursor": self._cursor} if self._cursor is not None else {}
            self._training_thread = training_thread(self.inner, data, self.peer_id, batch_size=config.batch_size,
                                                    seq_len=config.seq_len, **chunks)  # fmt: skip
        self.run_info = RunInfo(run_id=config.run_id, model=config.model, model_config=model_config,
                                seed=config.seed, data=data_name, inner_steps=config.inner_steps)  # fmt: skip
        self.settings = self._settings_for(config)  # the run settings we train with; the manifest carries them
        self.maddrs: list[str] = []  # where peers reach us, once `run` has started the host
        # the step's mutable facts (context.py); a node that joined peers starts late
        self.facts = StepFacts(planned_at=-1 if initial_peers else 0)
        self._genesis_alone = False  # we began the run's genesis with no initial peers (RunContext.unknown)
        self.outer_loop: OuterLoop | None = None  # while `run` runs: its outer-step loop
        self._started = asyncio.Event()  # set once the node holds the run's state and serves it
        self._compression = config.compression_spec()
        self._block_size = config.averaging_config(self.client_mode).block_size
        self._feedback = node_error_feedback(config, self._compression.codec, self._block_size)

    def _settings_for(self, config: NodeConfig) -> RunSettings:
        """The run settings of `config` (with our model's fingerprint, for a caller's model), also
        written into the manifest of the states we make."""
        if self._fingerprint is not None:
            architecture, initial = self._fingerprint
            settings = custom_settings(config, architecture=architecture, initial_state=initial)
        else:
            settings = training_settings(config)
        self.run_info = dataclasses.replace(self.run_info, settings=settings.wire())
        return settings

    # --- lifecycle --------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> str:
        """Train until stop is set, the run's end or our own leave_after_steps; returns why it ended
        (OuterLoop.run: "finished", "left", "run ended", "stopped"). Raises
        NodeError (bad data, unreachable peers, divergence), DHTError or P2PError."""
        if self._training_thread is not None:
            self._training_thread.start()
        try:
            host, nated = await self._open_host()
            try:
                async with NodeReach(host, nated=nated, relays=self.initial_peers, relay=self.relay) as reach:
                    self.reach = reach
                    return await self._run_with(host, stop, reach)
            finally:
                await host.close()
        finally:
            self.inner.close()
            if self._cursor is not None:  # a training thread waiting for a chunk ends too
                self._cursor.close()
            if self._training_thread is not None:  # it ends after the inner step under way
                await asyncio.to_thread(self._training_thread.join, TRAINING_THREAD_END_WAIT)

    async def _open_host(self) -> tuple[P2PHost, bool]:
        """Our started host, and whether it is behind NAT. A NATed node's host is started again
        with P2PConfig.reuse_port, so that its NAT maps every dial as it maps the listening port
        (hole punching needs that mapping); a reachable node keeps ephemeral ports for its dials."""
        host = await P2PHost(self.identity, self.p2p_config).start()
        try:
            nated = bool(self.initial_peers) and not self.client_mode and not await self._check_reachability(host)
        except BaseException:
            await host.close()
            raise
        if not nated or self.p2p_config.reuse_port:
            return host, nated
        await host.close()
        return await P2PHost(self.identity, dataclasses.replace(self.p2p_config, reuse_port=True)).start(), True

    async def _run_with(self, host: P2PHost, stop: asyncio.Event, reach: NodeReach) -> str:
        # a NATed node asks the DHT but stores none of its records: they live on reachable nodes
        dht = DHTNode(host=host, initial_peers=self.initial_peers, config=self.dht_config,
                      client_mode=self.client_mode or reach.nated, id_proof_path=self.id_proof_path)  # fmt: skip
        await dht.start()
        reach.use_dht(dht)  # a relay lists itself there; a NATed node learns more relays there
        book = ProgressBook(dht, self.config.run_id, self.config.publish_interval)
        try:
            # behind NAT, the relays asked are the initial peers and those the DHT's records name:
            # initial peers that do not relay leave us a client only if the DHT names none either
            if not await reach.reserve():
                logger.warning("behind NAT with no relay: running in client mode (trains, serves nothing)")
                self.client_mode = True
            # refusals first: a node of other settings says so before it claims data, resumes or fetches
            await self._refuse_other_settings(book)
            config = self.config  # with the run's end, where we adopted it
            claimer = await self._claim_chunks(dht)
        except BaseException:
            await reach.detach_dht()
            await dht.close()
            raise
        self.maddrs = [] if self.client_mode else host.visible_maddrs
        self.events.emit("listening", maddrs=self.maddrs, run_id=config.run_id)
        averager = Averager(dht, host, config.run_id, config.averaging_config(self.client_mode, self.settings.digest),
                            reach=reach.reach, relayed_may_own=lambda: _relayed_may_own(book))  # fmt: skip
        lineage = LineageBook(host, dht, config.run_id, self.settings.digest, serve=not self.client_mode)
        keeper = StateKeeper(host, dht, self.run_info, in_trainer=self.inner.call, beside_trainer=self.inner.beside,
                             serve=not self.client_mode,
                             checkpoint_dir=Path(config.checkpoint_dir) if config.checkpoint_dir else None,
                             config=config.keeper_config(), on_fetch_progress=self.events.fetch_progress,
                             vouching=initial_peer_ids(self.initial_peers), lineage=lineage)  # fmt: skip
        ctx = RunContext(config=config, diloco=self.diloco, inner=self.inner, events=self.events, averager=averager,
                         keeper=keeper, book=book, lineage=lineage, stop=stop, client=self.client_mode,
                         maddrs=lambda: [] if self.client_mode else host.visible_maddrs, settings=self.settings,
                         evaluate=self._evaluate, feedback=self._feedback,
                         compression=self._compression, block_size=self._block_size, reach=reach.reach,
                         unknown=lambda: self._genesis_alone and not (dht.table or host.connected_peers()))  # fmt: skip
        loop = self.outer_loop = OuterLoop(ctx, self.facts)
        publisher: Supervised | None = None
        reason = "stopped"
        try:
            await self._start(loop)
            publisher = Supervised("progress records", lambda: self._publish_forever(loop.view, claimer)).start()
            started_with = await starting.wait_to_start(loop.view, self.config.start_with, stop)
            reason = await loop.run(started_with)
            # what our last round owes its group (a result half-written to its senders) goes out
            # before the host closes under it
            if owed := await averager.drain(config.part_timeout):
                logger.warning("leaving with %d averaging stream(s) still being served after %.0fs",
                               owed, config.part_timeout)  # fmt: skip
            return reason
        finally:
            if publisher is not None:
                if (error := await publisher.close()) is not None:
                    logger.warning("publishing our progress had failed %d time(s), last: %r", publisher.failures,
                                   error)  # fmt: skip
                await loop.view.leave()
            await keeper.close()
            await lineage.close()
            averager.close()
            if claimer is not None:  # releases our claims while the DHT is still up
                await claimer.close()
            await reach.detach_dht()
            await dht.close()
            self.events.emit("exit", outer_step=self.diloco.outer_step, reason=reason)

    async def _start(self, loop: OuterLoop) -> None:
        """Resume from our checkpoint or begin the run's genesis; with peers, check that their
        run settings are ours and fetch the swarm's state; then serve it, store our progress record
        and say so (`start`)."""
        ctx, config, diloco = loop.ctx, self.config, self.diloco
        if not await self._resume(ctx.keeper):  # the run's genesis: every node of the run builds this state
            self._genesis_alone = not self.initial_peers
            genesis = bytes.fromhex(await self.inner.call(diloco.state_sha256))
            ctx.lineage.start(diloco.outer_step, genesis, provisional=bool(self.initial_peers))
        if self.initial_peers:
            # a state whose newest round is still being endorsed is judged again PENDING_S later
            # (state/adoption.py): a newcomer waits that out while the swarm is ahead of it, so
            # that it starts (and says so) at the run's step, not at step 0 with a fetch to follow
            for _ in range(START_FETCH_TRIES):
                if await loop.ends.fetch(alone=False) or not swarm_is_ahead(loop.view.read()):
                    break
                await asyncio.sleep(PENDING_S)
        await loop.ends.rehash()
        self.maddrs = ctx.maddrs()
        # serve what we hold from the start, step 0 too: a client that trained alone ahead of
        # every server follows the servers' state (swarm/state/keeper.py)
        await ctx.keeper.publish(diloco, checkpoint=False)
        # our progress record, with our run settings, is in the DHT before we say we started: a
        # node that joins through us right after is refused on other settings only if it reads
        # them there (a store that fails is logged by the book; the publisher stores it again)
        await loop.view.publish()
        self.events.emit("start", maddrs=self.maddrs, run_id=config.run_id, outer_step=diloco.outer_step,
                         parameters=sum(p.numel() for p in diloco.params), client_mode=self.client_mode,
                         reach=self.reach.reach() if self.reach is not None else None,
                         model=config.model, device=str(diloco.device))  # fmt: skip
        self._started.set()

    async def _refuse_other_settings(self, book: ProgressBook) -> None:
        """NodeError naming both values when the run's records carry other run settings than ours
        (settings.disagreement). Read right after the DHT is joined, before anything slow. A
        node not given the run's end takes it from the run first (swarm-node has already, from
        its lookup; swarm.join and a node whose lookup went unanswered do it here)."""
        if not self.initial_peers:
            return
        await book.refresh()
        vouched = initial_peer_ids(self.initial_peers)
        end = run_end_to_adopt(self.settings, run_settings([(p.peer_id, p.settings) for p in book.peers], vouched))
        if end is not None:
            logger.info("run %r: adopting its end: %d outer steps (max_outer_steps)", self.config.run_id, end)
            self.config = dataclasses.replace(self.config, max_outer_steps=end)
            self.settings = self._settings_for(self.config)
        remedy = API_REMEDY if self.config.model == CUSTOM_MODEL else CLI_REMEDY
        problem = disagreement(self.settings, [(p.peer_id, p.settings) for p in book.peers], vouched, remedy)
        if problem is not None:
            raise NodeError(problem)

    async def _resume(self, keeper: StateKeeper) -> bool:
        """Resume from our last checkpoint; False when there is none."""
        try:
            step = await keeper.resume_local(self.diloco)
        except CheckpointError as e:
            raise NodeError(f"cannot resume from --checkpoint-dir: {e}") from None
        if step is None:
            return False
        self.events.emit("resume", outer_step=step, checkpoint_dir=self.config.checkpoint_dir)
        if self._feedback is not None:
            try:
                self._feedback.load_state_dict(await keeper.load_local(step))
            except ValueError as e:  # an optimisation lost, never a reason not to resume
                logger.warning("starting without the checkpoint's error-feedback residual: %s", e)
        return True

    async def _claim_chunks(self, dht: DHTNode) -> ChunkClaimer | None:
        """Prepared data: claim chunks in the DHT, from the position kept in --checkpoint-dir."""
        if self._cursor is None:
            return None
        return await start_claiming(dht, self.config.run_id, self._cursor, self.config.checkpoint_dir)

    async def _check_reachability(self, host: P2PHost) -> bool:
        """False when a helper could not dial us back (None, nobody answered, counts as reachable)."""
        result = await check_reachability(host, host.visible_maddrs, self.initial_peers[:3])
        if result.reachable is False:
            logger.warning(
                "peers cannot reach this node at %s (%s): behind NAT, it takes a relayed address and punches "
                "holes. To be reached directly, forward the port and pass --announce-maddrs /ip4/<public ip>/tcp/<p>",
                ", ".join(host.visible_maddrs),
                result.reason,
            )
        return result.reachable is not False

    # --- progress in the DHT ------------------------------------------------------------------

    async def _publish_forever(self, view: SwarmView, claimer: ChunkClaimer | None) -> None:
        clock = asyncio.get_running_loop().time
        began = clock()
        while True:
            await asyncio.sleep(publish_delay(began, clock(), self.config.publish_interval))
            began = clock()
            self.events.network(view.ctx.keeper)
            if claimer is not None:  # up to 1,000 peers' done bitmaps folded: off the event loop
                self.events.data((await asyncio.to_thread(node_progress, claimer)).wire())
            await view.publish()
            await view.ctx.book.refresh()

    async def wait_for_peers(self, nodes: int, timeout: float) -> int:
        """Wait until `nodes` nodes of the run, this one included, are live with our settings
        (their progress records fresh), publishing our own record meanwhile: a barrier for
        processes that should train together from their first step. Returns how many are live,
        fewer than `nodes` after `timeout` seconds (0: this node did not get the run's state by then)."""
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            await asyncio.wait_for(self._started.wait(), timeout)
        except asyncio.TimeoutError:
            return 0
        assert self.outer_loop is not None  # set before _started
        return await starting.wait_for_live(self.outer_loop.view, nodes, deadline)


def _relayed_may_own(book: ProgressBook) -> bool:
    """A relayed node owns parts only when no live peer of the run could (p2p/reach.py)."""
    now = time.time()
    return relayed_may_own((p.client, p.reach) for p in book.peers if p.is_live(now, book.fresh_for))
