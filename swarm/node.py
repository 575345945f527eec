"""SwarmNode: one training process of the swarm, wiring the layers (DESIGN.md "Training").

    node = SwarmNode(NodeConfig(run_id="demo", model="tiny"), identity=..., initial_peers=[...],
                     p2p_config=P2PConfig(host_maddrs=(...,)), on_event=print)
    reason = await node.run(stop_event)

What one outer step does:
1. Inner steps run in a worker thread (DESIGN invariant 6): the event loop keeps answering DHT,
   matchmaking and all-reduce calls while the node computes. Batches come from
   node_generator(PeerID, global inner step), so every node trains on its own windows.
2. While the inner steps run, the node publishes its progress under `<run>/nodes` and reads its
   peers' (swarm/progress.py). It starts matchmaking `matchmaking_time` before the slowest live
   peer of its step should finish (at most max_wait after itself), so the group forms while the
   last inner steps run and all members are ready together.
3. Δ = θ_outer - θ_inner is averaged with the group (int8 by default), weighted by tokens; the
   outer Nesterov step follows. A node with no group, or whose round failed, applies its own Δ.
4. Eval loss on the shared eval set, the hash of θ_outer, and one `outer_step` event.

Events (`on_event`, called on the event loop; the CLI writes them as JSON lines):
    {"event": "start", "peer_id", "maddrs", "run_id", "outer_step", "parameters", "client_mode", ...}
    {"event": "progress", "outer_step", "inner_step", "inner_steps", "train_loss", ...}
    {"event": "outer_step", "outer_step" (completed, from 0), "train_loss", "eval_loss",
     "state_sha256", "group_size", "bytes_sent", "bytes_received", "inner_s", "wall_s",
     "tokens", "tokens_per_s", "rss_bytes", ...}
    {"event": "exit", "outer_step", "reason"}
Every event also has "time" (unix) and "peer_id".

Reachability: before joining the DHT a node with initial peers asks one of them to dial it back
(swarm/p2p/autonat.py). A node nobody can reach runs in client mode: it trains and contributes,
but owns no part of an all-reduce and serves nothing, so it never stalls a group.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import resource
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from swarm.averaging.allreduce import AllReduceError
from swarm.averaging.averager import Averager, GroupReport
from swarm.averaging.messages import GroupInfo
from swarm.dht.config import DHTConfig
from swarm.dht.errors import DHTError
from swarm.dht.node import DHTNode
from swarm.dht.records import owner_subkey
from swarm.dht.run_keys import nodes_key
from swarm.model.checkpoint import CheckpointError, RunInfo
from swarm.model.data import TokenData, eval_windows, load_data, node_generator, sample_batch
from swarm.model.diloco import DiLoCo, NonFiniteLossError
from swarm.model.llama import build_model, count_parameters
from swarm.model.loss import eval_loss
from swarm.model.presets import preset
from swarm.node_config import NodeConfig
from swarm.p2p.autonat import check_reachability
from swarm.p2p.config import P2PConfig
from swarm.p2p.errors import P2PError
from swarm.p2p.host import P2PHost
from swarm.p2p.identity import Identity
from swarm.progress import (
    PeerProgress,
    decode_progress,
    latest_finish,
    median_pace,
    plan_late_round,
    servers_behind,
)
from swarm.state.fetcher import FetchError, FetchProgress
from swarm.state.keeper import StateKeeper

logger = logging.getLogger(__name__)

Event = dict[str, Any]
POLL_SECONDS = 0.2  # how often the loop looks at the trainer's progress
PROGRESS_EVENT_SECONDS = 2.0
FINAL_STRETCH = 3.0  # seconds before matchmaking in which peers' progress is read often
FINAL_REFRESH_SECONDS = 0.5
ANNOUNCE_MARGIN = 0.3  # seconds a late node keeps for its announcement to reach the DHT
CATCH_UP_ROUNDS = 6  # fetch attempts while peers' progress says they are ahead
CATCH_UP_PAUSE = 0.5  # seconds between them (their new state is being advertised)
LATE_GATHER = 0.3  # seconds a node joining an already gathering group waits before reading it


class NodeError(RuntimeError):
    """The node cannot start or go on; the message says why and what to do."""


@dataclass
class _Progress:
    """What the trainer thread reports; read by the loop under `lock`."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    inner_done: int = 0
    sec_per_step: float = 0.0  # moving average
    losses: list[float] = field(default_factory=list)  # this round's
    inner_s: float = 0.0  # all rounds


class SwarmNode:
    def __init__(
        self,
        config: NodeConfig,
        *,
        identity: Identity | None = None,
        initial_peers: tuple[str, ...] = (),
        p2p_config: P2PConfig | None = None,
        on_event: Callable[[Event], None] | None = None,
    ) -> None:
        self.config = config
        self.identity = identity or Identity.generate()
        self.peer_id = self.identity.peer_id
        self.initial_peers = initial_peers
        self.p2p_config = p2p_config or P2PConfig()
        self.on_event = on_event or (lambda event: None)
        self.client_mode = config.client_mode
        self.progress = _Progress()
        self._stop_training = threading.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="swarm-train")
        self._peers: list[PeerProgress] = []
        self._tokens = 0
        self._last_eval: float | None = None
        self._last_group = 0  # size of our last group; 0: no outer step done here yet
        self.maddrs: list[str] = []
        self._last_fetch_event = 0.0
        self.round_target = config.inner_steps  # inner steps this round: H, fewer to catch up with peers
        self._late = bool(initial_peers)  # the first round of a joining node, and the round after a fetch
        self.diloco: DiLoCo | None = None
        self.data: TokenData | None = None

    # --- lifecycle --------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> str:
        """Train until stop is set or max_outer_steps are done; returns why it ended. Raises
        NodeError (bad data, unreachable peers), DHTError or P2PError when it cannot start."""
        try:
            await self._in_thread(self._build)
            host = P2PHost(self.identity, self.p2p_config)
            await host.start()
            try:
                return await self._run_with(host, stop)
            finally:
                await host.close()
        finally:
            self._stop_training.set()
            self._executor.shutdown(wait=True)

    async def _run_with(self, host: P2PHost, stop: asyncio.Event) -> str:
        config, diloco = self.config, self.diloco
        assert diloco is not None
        if self.initial_peers and not self.client_mode:
            await self._check_reachability(host)
        dht = DHTNode(host=host, initial_peers=self.initial_peers, config=DHTConfig(), client_mode=self.client_mode)
        await dht.start()
        averager = Averager(dht, host, config.run_id, config.averaging_config(self.client_mode))
        keeper = StateKeeper(
            host,
            dht,
            self.run_info,
            in_trainer=self._in_thread,
            serve=not self.client_mode,
            checkpoint_dir=Path(config.checkpoint_dir) if config.checkpoint_dir else None,
            checkpoint_every=config.checkpoint_every,
            shard_bytes=config.shard_bytes,
            max_uploads=config.max_uploads,
            fetch_timeout=config.fetch_timeout,
            on_fetch_progress=self._on_fetch_progress,
        )
        publisher: asyncio.Future[None] | None = None
        reason = "stopped"
        try:
            await self._resume(keeper)
            if self.initial_peers:
                await self._catch_up(keeper, dht, alone=False)
            self.maddrs = [] if self.client_mode else host.visible_maddrs
            self._emit(
                "start",
                maddrs=self.maddrs,
                run_id=config.run_id,
                outer_step=diloco.outer_step,
                parameters=sum(p.numel() for p in diloco.params),
                client_mode=self.client_mode,
                model=config.model,
                device=str(diloco.device),
            )
            # serve what we hold from the start, step 0 too: a client that trained alone ahead of
            # every server follows the servers' state (swarm/state/keeper.py)
            await keeper.publish(diloco, checkpoint=False)
            publisher = asyncio.ensure_future(self._publish_forever(dht))
            reason = await self._train(dht, averager, keeper, stop)
            return reason
        finally:
            if publisher is not None:
                publisher.cancel()
                await asyncio.gather(publisher, return_exceptions=True)
            await keeper.close()
            averager.close()
            await dht.close()
            self._emit("exit", outer_step=diloco.outer_step, reason=reason)

    async def _resume(self, keeper: StateKeeper) -> None:
        try:
            step = await keeper.resume_local(self.diloco)  # type: ignore[arg-type]
        except CheckpointError as e:
            raise NodeError(f"cannot resume from --checkpoint-dir: {e}") from None
        if step is not None:
            self._emit("resume", outer_step=step, checkpoint_dir=self.config.checkpoint_dir)

    async def _catch_up(self, keeper: StateKeeper, dht: DHTNode, *, alone: bool) -> None:
        """Fetch the swarm's state when we are behind (see swarm/state/keeper.py). Peers that
        just finished a step advertise its state a moment later: while their progress records
        say they are ahead, wait for it (bounded) and fetch again."""
        diloco = self.diloco
        assert diloco is not None
        for _ in range(CATCH_UP_ROUNDS):
            await self._fetch_if_needed(keeper, alone)
            alone = False
            await self._refresh_peers(dht)
            now = time.time()
            servers = [p for p in self._peers if not p.client]  # only a server's newer state can be fetched
            if not any(now - p.time <= self._fresh_for and p.step > diloco.outer_step for p in servers):
                return
            await asyncio.sleep(CATCH_UP_PAUSE)

    async def _fetch_if_needed(self, keeper: StateKeeper, alone: bool) -> None:
        diloco = self.diloco
        assert diloco is not None
        try:
            behind = servers_behind(self._peers, diloco.outer_step, time.time(), self._fresh_for)
            fetched = await keeper.catch_up(diloco, alone_last_step=alone, servers_behind=behind)
        except CheckpointError as e:  # IncompatibleState: the run's state is not for this node
            raise NodeError(f"cannot use the run's state: {e}") from None
        except FetchError as e:
            logger.warning("could not fetch the swarm's state: %s: training on from our own", e)
            return
        if fetched is not None:
            self._late = True  # the peers are already training on this state
            why, report = fetched
            self._emit(
                "fetch",
                outer_step=diloco.outer_step,
                reason=why,
                bytes=report.fetched_bytes,
                seconds=round(report.elapsed_s, 3),
                peers=len(report.bytes_by_peer),
                corrupt_peers=report.corrupt_peers,
                state_sha256=await self._in_thread(diloco.outer_sha256),
                MBps=round(report.fetched_bytes / 1e6 / report.elapsed_s, 1) if report.elapsed_s > 0 else None,
            )

    def _on_fetch_progress(self, progress: FetchProgress) -> None:
        now = time.monotonic()
        if now - self._last_fetch_event < 1.0 and progress.done_bytes < progress.total_bytes:
            return
        self._last_fetch_event = now
        self._emit(
            "fetch_progress",
            outer_step=progress.step,
            done_bytes=progress.done_bytes,
            total_bytes=progress.total_bytes,
            MBps=round(progress.rate_MBps, 1),
            peers=progress.peers,
        )

    def _build(self) -> None:
        config = self.config
        try:
            self.data = load_data(config.data, tokenizer=config.tokenizer)
        except ValueError as e:
            raise NodeError(str(e)) from None
        device = config.torch_device()
        if device.type == "cuda" and not torch.cuda.is_available():
            raise NodeError(f"--device {config.device}: no CUDA device here")
        model_config = preset(config.model, vocab_size=self.data.vocab_size)
        logger.info("model %s: %d parameters on %s", config.model, count_parameters(model_config), device)
        model = build_model(model_config, config.seed, device=device)
        self.diloco = DiLoCo(model, config.diloco_config())
        self.run_info = RunInfo(
            run_id=config.run_id,
            model=config.model,
            model_config=dataclasses.asdict(model_config),
            seed=config.seed,
            data=self.data.name,
            inner_steps=config.inner_steps,
        )
        self.eval_set = eval_windows(self.data.eval, config.seq_len, config.eval_windows)

    async def _check_reachability(self, host: P2PHost) -> None:
        result = await check_reachability(host, host.visible_maddrs, self.initial_peers[:3])
        if result.reachable is False:
            logger.warning(
                "peers cannot reach this node at %s (%s): running in client mode (trains, serves nothing). "
                "To serve, forward the port and pass --announce-maddrs /ip4/<public ip>/tcp/<port>",
                ", ".join(host.visible_maddrs),
                result.reason,
            )
            self.client_mode = True

    # --- the training loop ------------------------------------------------------------------

    async def _train(self, dht: DHTNode, averager: Averager, keeper: StateKeeper, stop: asyncio.Event) -> str:
        diloco, config = self.diloco, self.config
        assert diloco is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while config.max_outer_steps is None or diloco.outer_step < config.max_outer_steps:
                if stop.is_set():
                    return "stopped"
                if self._last_group > 0:  # after our first step here: fell behind? missed a group?
                    await self._catch_up(keeper, dht, alone=self._last_group == 1)
                    if config.max_outer_steps is not None and diloco.outer_step >= config.max_outer_steps:
                        break
                step = diloco.outer_step
                await self._refresh_peers(dht)
                target = self._plan_round(step) if self._late else config.inner_steps
                self._late = False
                if target is None:  # the peers' group is forming: join it as it is, or take its result
                    if not await self._join_forming_group(averager, keeper, step, started):
                        await self._wait_for_next_state(keeper, dht, step)
                    continue
                self.round_target = target
                weight = float(self.round_target * config.batch_size * config.seq_len)  # tokens this round
                with self.progress.lock:
                    self.progress.inner_done, self.progress.losses = diloco.inner_done, []
                await self._publish(dht)
                training = loop.run_in_executor(self._executor, self._inner_steps)
                group_task = await self._train_until_ready(training, stopping, dht, step, weight, averager)
                if stop.is_set():
                    self._stop_training.set()
                    await asyncio.gather(training, return_exceptions=True)
                    if group_task is not None:
                        group_task.cancel()
                        await asyncio.gather(group_task, return_exceptions=True)
                    return "stopped"
                self._raise_training_error(training.result())
                await self._publish(dht)
                if group_task is None:  # nobody told us to start yet: wait for slower peers, bounded
                    await self._wait_for_peers(dht, step, stopping)
                    group_task = asyncio.ensure_future(averager.form_group(weight, step))
                report = await self._average_and_apply(averager, group_task)
                await self._after_outer_step(step, report, loop.time() - started)
                await keeper.publish(diloco)
            return "finished"
        finally:
            stopping.cancel()

    async def _train_until_ready(
        self,
        training: asyncio.Future[Any],
        stopping: asyncio.Future[Any],
        dht: DHTNode,
        step: int,
        weight: float,
        averager: Averager,
    ) -> asyncio.Future[tuple[GroupInfo | None, float]] | None:
        """Wait for the inner steps; start matchmaking early once the group should be ready
        within matchmaking_time (see the module docstring). Returns the matchmaking task."""
        group_task = None
        last_event = last_refresh = 0.0
        timed = False
        while not training.done() and not stopping.done():
            await asyncio.wait({training, stopping}, timeout=POLL_SECONDS, return_when=asyncio.FIRST_COMPLETED)
            now = time.time()
            if not timed and self.progress.inner_done > 0:  # peers learn our pace at once, not at the next tick
                timed = True
                await self._publish(dht)
            final_stretch = self._seconds_left() <= self.config.matchmaking_time + FINAL_STRETCH
            if group_task is None and final_stretch and now - last_refresh >= FINAL_REFRESH_SECONDS:
                last_refresh = now  # read peers' progress often now: a late peer's record must not be missed
                await self._refresh_peers(dht)
            if group_task is None and self._time_to_announce(step, now):
                group_task = asyncio.ensure_future(averager.form_group(weight, step))
            if now - last_event >= PROGRESS_EVENT_SECONDS:
                last_event = now
                self._emit_progress(step)
        return group_task

    def _plan_round(self, step: int) -> int | None:
        """Inner steps for a node that joined or fetched while its peers were training
        (swarm/progress.py: plan_late_round); None: too late for this step's group."""
        h = self.config.inner_steps
        target = plan_late_round(self._peers, step, time.time(), self._fresh_for, h,
                                 self.progress.sec_per_step, ANNOUNCE_MARGIN)  # fmt: skip
        if target is not None and target < h:
            logger.info("step %d: peers started before us: %d of %d inner steps, to finish with them", step, target, h)
        return target

    async def _join_forming_group(self, averager: Averager, keeper: StateKeeper, step: int, started: float) -> bool:
        """The peers of `step` are already matchmaking: announce at once with no inner steps of
        ours (weight 0), as a client member, gather only briefly, and take the group's average
        as our outer step; only while all of them fit in one group, so that we change neither
        their split nor their leader.
        Without this, a node whose peers gather for most of each step (short rounds) would chase
        them forever: fetch, find their next group forming, wait, fetch again. False when the
        group formed without us."""
        diloco = self.diloco
        assert diloco is not None
        now = time.time()
        gathering = [p for p in self._peers if p.step == step and now - p.time <= self._fresh_for]
        if len(gathering) + 1 > self.config.target_group_size:
            return False  # we would change how they split into groups, and so their groups themselves
        self.round_target = 0
        with self.progress.lock:
            self.progress.inner_done, self.progress.losses = diloco.inner_done, []
        try:  # as a client member: whoever they picked to lead stays their leader
            group, matchmaking_s = await averager.form_group(0.0, step, gather=LATE_GATHER, as_client=True)
        except (P2PError, DHTError, TimeoutError) as e:
            logger.info("step %d: could not join the peers' forming group: %s", step, e)
            return False
        if group is None:
            return False
        logger.info("step %d: joined the peers' group as it formed, with no inner steps of ours", step)
        formed: asyncio.Future[tuple[GroupInfo | None, float]] = asyncio.get_running_loop().create_future()
        formed.set_result((group, matchmaking_s))
        report = await self._average_and_apply(averager, formed)
        await self._after_outer_step(step, report, asyncio.get_running_loop().time() - started)
        await keeper.publish(diloco)
        return True

    async def _wait_for_next_state(self, keeper: StateKeeper, dht: DHTNode, step: int) -> None:
        """Wait (bounded by max_wait) for the peers to finish `step`, then fetch its result."""
        diloco = self.diloco
        assert diloco is not None
        logger.info("step %d: the peers' group is already forming; waiting for its result", step)
        deadline = time.monotonic() + max(self.config.max_wait, 1.0)
        while diloco.outer_step == step and time.monotonic() < deadline:
            await asyncio.sleep(CATCH_UP_PAUSE)
            await self._catch_up(keeper, dht, alone=False)
            now = time.time()
            if not any(p.step >= step and now - p.time <= self._fresh_for for p in self._peers):
                return  # they are gone (killed, left): nothing will come, train on our own

    def _seconds_left(self) -> float:
        """Our own estimate of the time to finish this round's inner steps (inf: no timing yet)."""
        with self.progress.lock:
            left = self.round_target - self.progress.inner_done
            sec = self.progress.sec_per_step
        return left * sec if sec > 0 else math.inf

    def _time_to_announce(self, step: int, now: float) -> bool:
        with self.progress.lock:
            left = self.round_target - self.progress.inner_done
            sec = self.progress.sec_per_step
        if sec <= 0:
            return False  # no timing yet
        own_finish = now + left * sec
        end = latest_finish(self._peers, step, now, self._fresh_for, own_finish, self.config.max_wait)
        if end - now > self.config.matchmaking_time:
            return False
        logger.info("step %d: matchmaking now; we finish in %.1fs, the last peer in %.1fs (%d peers known)",
                    step, own_finish - now, end - now, len(self._peers))  # fmt: skip
        return True

    async def _wait_for_peers(self, dht: DHTNode, step: int, stopping: asyncio.Future[Any]) -> None:
        now = time.time()
        await self._refresh_peers(dht)
        end = latest_finish(self._peers, step, now, self._fresh_for, now, self.config.max_wait)
        delay = end - now - self.config.matchmaking_time
        if delay > 0:
            logger.info("waiting %.1fs for slower peers of step %d", delay, step)
            await asyncio.wait({stopping}, timeout=delay)

    async def _average_and_apply(
        self, averager: Averager, group_task: asyncio.Future[tuple[GroupInfo | None, float]]
    ) -> GroupReport:
        diloco = self.diloco
        assert diloco is not None
        deltas = await self._in_thread(diloco.pseudo_gradients)
        try:
            group, matchmaking_s = await group_task
        except (P2PError, DHTError, TimeoutError) as e:
            logger.warning("matchmaking failed: %s: applying our own pseudo-gradient", e)
            group, matchmaking_s = None, 0.0
        try:
            averaged, report = await averager.run_round(group, deltas, matchmaking_s)
        except AllReduceError as e:
            logger.warning("all-reduce of step %d failed: %s: applying our own pseudo-gradient", diloco.outer_step, e)
            averaged, report = deltas, GroupReport(None)
        await self._in_thread(diloco.apply_outer, averaged)
        return report

    async def _after_outer_step(self, step: int, report: GroupReport, wall_s: float) -> None:
        diloco, config = self.diloco, self.config
        assert diloco is not None
        last = config.max_outer_steps is not None and diloco.outer_step >= config.max_outer_steps
        evaluate = last or diloco.outer_step % config.eval_every == 0
        if evaluate:
            self._last_eval = await self._in_thread(eval_loss, diloco.model, self.eval_set)
        sha = await self._in_thread(diloco.outer_sha256)
        with self.progress.lock:
            losses, inner_s = list(self.progress.losses), self.progress.inner_s
        self._tokens += self.round_target * config.batch_size * config.seq_len
        self._last_group = len(report.members) if report.group_id is not None else 1
        self._emit(
            "outer_step",
            outer_step=step,
            train_loss=sum(losses) / len(losses) if losses else None,
            eval_loss=self._last_eval if evaluate else None,
            state_sha256=sha,
            group_size=self._last_group,
            group_id=report.group_id,
            bytes_sent=report.bytes_sent,
            bytes_received=report.bytes_received,
            matchmaking_s=round(report.matchmaking_s, 4),
            inner_s=round(inner_s, 4),
            wall_s=round(wall_s, 4),
            tokens=self._tokens,
            tokens_per_s=round(self._tokens / wall_s, 1) if wall_s > 0 else 0.0,
            rss_bytes=resident_bytes(),
        )

    # --- the trainer thread -----------------------------------------------------------------

    def _inner_steps(self) -> BaseException | None:
        """Runs in the worker thread: inner steps until H are done or the node stops."""
        diloco, config, data, progress = self.diloco, self.config, self.data, self.progress
        assert diloco is not None and data is not None
        peer = self.peer_id.to_bytes()
        while diloco.inner_done < self.round_target and not self._stop_training.is_set():
            generator = node_generator(peer, diloco.global_inner_step)
            inputs, targets = sample_batch(data.train, config.batch_size, config.seq_len, generator)
            began = time.perf_counter()
            try:
                stats = diloco.inner_step(inputs, targets)
            except NonFiniteLossError as e:
                return NodeError(f"training diverged ({e}): lower --lr or --outer-lr")
            took = time.perf_counter() - began
            with progress.lock:
                progress.inner_done = diloco.inner_done
                progress.losses.append(stats.loss)
                progress.inner_s += took
                progress.sec_per_step = took if progress.sec_per_step == 0 else 0.8 * progress.sec_per_step + 0.2 * took
        return None

    def _raise_training_error(self, error: BaseException | None) -> None:
        if error is not None:
            raise error

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # --- progress in the DHT ------------------------------------------------------------------

    @property
    def _fresh_for(self) -> float:
        return 3 * self.config.publish_interval + 2.0

    async def _publish_forever(self, dht: DHTNode) -> None:
        while True:
            await asyncio.sleep(self.config.publish_interval)
            await self._publish(dht)
            await self._refresh_peers(dht)

    async def _publish(self, dht: DHTNode) -> None:
        diloco = self.diloco
        assert diloco is not None
        with self.progress.lock:
            inner, sec = self.progress.inner_done, self.progress.sec_per_step
            losses = self.progress.losses[-10:]
        now = time.time()
        if sec <= 0:  # no step timed yet (a newcomer): assume the peers' pace until we know ours
            sec = median_pace(self._peers)
        value = {
            "maddrs": self.maddrs,
            "client": self.client_mode,
            "step": diloco.outer_step,
            "inner": inner,
            "H": max(1, self.round_target),  # 0 while it joins a forming group; records need H >= 1
            "sec_per_step": round(sec, 6),
            "time": round(now, 3),
            "train_loss": round(sum(losses) / len(losses), 4) if losses else None,
            "eval_loss": round(self._last_eval, 4) if self._last_eval is not None else None,
            "tokens_per_s": round(self.config.batch_size * self.config.seq_len / sec, 1) if sec > 0 else None,
            "group_size": self._last_group,
        }
        expiration = now + 4 * self.config.publish_interval + 10
        try:
            await dht.store(nodes_key(self.config.run_id), value, expiration, owner_subkey(self.peer_id))
        except (P2PError, DHTError, TimeoutError) as e:
            logger.info("could not publish progress: %s", e)

    async def _refresh_peers(self, dht: DHTNode) -> None:
        try:
            found = await dht.get(nodes_key(self.config.run_id), latest=True)
        except (P2PError, DHTError, TimeoutError) as e:
            logger.info("could not read peers' progress: %s", e)
            return
        if found is None:  # nothing found this time: keep what we knew (freshness ages it out)
            return
        peers = []
        if isinstance(found.value, dict):
            for subkey, entry in found.value.items():
                progress = decode_progress(subkey, getattr(entry, "value", None))
                if progress is not None and progress.peer_id != self.peer_id:
                    peers.append(progress)
        self._peers = peers

    # --- events ---------------------------------------------------------------------------------

    def _emit_progress(self, step: int) -> None:
        with self.progress.lock:
            inner, losses = self.progress.inner_done, self.progress.losses[-10:]
        self._emit(
            "progress",
            outer_step=step,
            inner_step=inner,
            inner_steps=self.config.inner_steps,
            train_loss=sum(losses) / len(losses) if losses else None,
        )

    def _emit(self, kind: str, **fields: Any) -> None:
        event = {"event": kind, "time": round(time.time(), 3), "peer_id": str(self.peer_id), **fields}
        try:
            self.on_event(event)
        except Exception:  # a display bug must not stop training
            logger.exception("event handler failed on %s", kind)


def resident_bytes() -> int:
    """This process's resident memory now (Linux /proc), else its peak (getrusage)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
