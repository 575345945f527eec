"""StateKeeper: a training node's side of the swarm state (DESIGN invariants 5-7).

    keeper = StateKeeper(host, dht, run_info, in_trainer=..., serve=True, checkpoint_dir=None,
                         config=KeeperConfig(shard_bytes=64 << 20, fetch=FetchConfig(timeout=120.0)))
    await keeper.resume_local(diloco)          # from --checkpoint-dir, after a crash
    await keeper.catch_up(diloco, ...)         # fetch from peers when they are ahead
    await keeper.publish(diloco)               # after each outer step: serve, advertise, checkpoint

After an outer step the state is copied once, in the trainer's thread (the only moment training
waits); serializing, hashing, serving and the checkpoint write happen from that copy in other
threads while the next inner steps run. A node fetches instead of training on (only a state
that trust.py lets it adopt: a reachable step, backed by at least as many peers as stand at
its own step, with a manifest that fits the model) when
- it starts and the run already has a newer state than its own (a newcomer, or a restart), or
- peers advertise a newer outer step than its own (it was slow or partitioned), or
- it averaged alone last step while two or more peers of that step agree on another state
  (it missed its group: it adopts the group's state instead of drifting on its own); a client
  follows even one peer, since a state that nobody can fetch from it can never be the swarm's;
- matchmaking found that most nodes of its step start from another state (an old checkpoint,
  a fork): it takes theirs before it contributes;
- it is a client that trained alone ahead of every server (it started before them): its steps
  can never be served, so it takes the servers' state, even an older one, and trains with them.
A state that its holders did not deliver (all unreachable or gone: a killed peer's advertisement
outlives it) is not chosen from them again for a while (refusals.py), so the node takes the best
state the live peers hold instead of retrying dead addresses.
A node exactly one step behind first takes the step's update from the new state's holders and
computes that state itself, verified against its manifest (update_fetch.py; KeeperConfig.by_update);
after a round, `record_update` keeps the group's average so that this node serves it too.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from swarm.dht.node import DHTNode
from swarm.model.checkpoint import KINDS, Manifest, RunInfo, Snapshot, copy_state, make_snapshot
from swarm.model.checkpoint_dir import CheckpointDir
from swarm.model.diloco import DiLoCo
from swarm.model.state_hash import state_sha256
from swarm.p2p.host import P2PHost
from swarm.p2p.peer_id import PeerID
from swarm.state import trust
from swarm.state.adoption import Adoption, Linked
from swarm.state.config import KeeperConfig
from swarm.state.fetcher import (
    FetchError,
    FetchProgress,
    FetchReport,
    RefusedManifest,
    fetch_manifest,
    fetch_state,
    remove_fetch_dir,
)
from swarm.state.holders import Holder, advertise, find_holders, settled_holders
from swarm.state.lineage_book import LineageBook, encode_receipts
from swarm.state.receipts import Receipt
from swarm.state.refusals import Refusals
from swarm.state.server import StateServer, StepUpdate
from swarm.state.trust import Known, choose_trusted, fetch_reason, manifest_problem
from swarm.state.update import encode_update
from swarm.state.update_fetch import by_update
from swarm.utils.log_once import OncePerPeer
from swarm.utils.supervised import Supervised

logger = logging.getLogger(__name__)

# why a node fetched a state that trust.py's rule 5 named: its lineage outweighs ours (lineage.py)
LARGER_LINEAGE = "a larger lineage"

InTrainer = Callable[..., Awaitable[Any]]
# at most one fork check (trust.py rule 5: a lineage fetched and its signatures checked) this
# often: a round mate that advertises a new made-up state at every renewal dodges the per-state
# memory of refusals, and would otherwise cost a lineage check at every look at the holders
FORK_CHECK_S = 2.0


def tensor_sizes(diloco: DiLoCo) -> dict[str, int]:
    """Each tensor of the state as a manifest names it, with its raw byte size."""
    state = diloco.state_dict()
    return {f"{kind}/{name}": t.numel() * t.element_size() for kind in KINDS for name, t in state[kind].items()}


class StateKeeper:
    """A training node's side of the swarm state: owns its StateServer (unless a client), its
    advertisement in the DHT (refreshed under supervision), its local checkpoints and the
    current snapshot. `resume_local` once at start, `catch_up` whenever the node may be behind,
    `publish` after each outer step, `close` at exit (module docstring)."""

    def __init__(
        self,
        host: P2PHost,
        dht: DHTNode,
        run: RunInfo,
        *,
        in_trainer: InTrainer,
        serve: bool,
        checkpoint_dir: Path | None,
        config: KeeperConfig,
        on_fetch_progress: Callable[[FetchProgress], None] | None = None,
        vouching: frozenset[PeerID] = frozenset(),
        beside_trainer: InTrainer | None = None,
        lineage: LineageBook,
    ) -> None:
        self.host, self.dht, self.run, self.config = host, dht, run, config
        self.lineage = lineage  # our lineage: which states we may adopt (lineage.py, adoption.py)
        self.adoption = Adoption(lineage, vouching=vouching, client=not serve)
        # in_trainer: work that writes the model (a loaded state), between the caller's inner
        # steps; beside_trainer: work that only reads the outer state (the copy to publish), in the
        # same thread while the inner steps go on (an overlapped node trains meanwhile)
        self.in_trainer = in_trainer
        self.beside_trainer = beside_trainer or in_trainer
        self.server = StateServer(host, run.run_id, max_uploads=config.max_uploads) if serve else None
        self.checkpoints = CheckpointDir(checkpoint_dir) if checkpoint_dir is not None else None
        self.on_fetch_progress = on_fetch_progress
        self.vouching = vouching  # the node's --initial-peers: their states are preferred (trust.py)
        self._refusals = Refusals()  # refused manifests and their peers, holders that did not deliver
        self.holder_steps: tuple[int, ...] = ()  # the steps of the states the holders advertised at our last look
        self._distrusted = OncePerPeer(logger)
        self._fork_checked_at = -math.inf  # the last fork check (monotonic; FORK_CHECK_S)
        self.current: Snapshot | None = None
        self.advertised = False  # the last advertisement of `current` was stored by some DHT node
        self._publishing: asyncio.Task[None] | None = None
        self._recording: asyncio.Future[None] | None = None  # the last step's update, being encoded
        self._refresher: Supervised | None = None

    async def close(self) -> None:
        for task in (self._recording, self._publishing):
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
        if self._refresher is not None and (error := await self._refresher.close()) is not None:
            logger.warning("the state advertisement had failed %d time(s), last: %r", self._refresher.failures, error)
        if self.server is not None:
            self.server.close()

    # --- getting a state -------------------------------------------------------------------------

    async def resume_local(self, diloco: DiLoCo) -> int | None:
        """Load the newest whole local checkpoint; returns its step, or None when there is none.
        Raises CheckpointError (IncompatibleState) for a checkpoint of another run or model."""
        if self.checkpoints is None:
            return None
        found = await asyncio.to_thread(self.checkpoints.load_latest, self.run)
        if found is None:
            return None
        manifest, state = found
        sha = bytes.fromhex(await asyncio.to_thread(state_sha256, state))
        data = await asyncio.to_thread(self.checkpoints.load_lineage, manifest.step)
        # decoding a long run's receipts is work for a thread; nothing else uses the book yet
        if data is None or not await asyncio.to_thread(self.lineage.restore, data, manifest.step, sha):
            self.lineage.start(manifest.step, sha)
            logger.info("the checkpoint of outer step %d has no lineage that leads to it: our lineage starts there",
                        manifest.step)  # fmt: skip
        await self.in_trainer(diloco.load_state_dict, state)
        logger.info("resumed from the checkpoint of outer step %d in %s", manifest.step, self.checkpoints.path)
        return manifest.step

    async def catch_up(
        self,
        diloco: DiLoCo,
        *,
        alone_last_step: bool,
        servers_behind: bool = False,
        other_state: bool = False,
        horizon: int | None = None,
        missed: bool = False,
    ) -> tuple[str, FetchReport] | None:
        """Fetch and load the swarm's state when this node should (see the module docstring),
        choosing only among the states it may trust (trust.py; `horizon`: the highest step the
        run can have reached, None: unknown; `missed`: a group of our state formed at our step
        without us, trust.Known.missed). Returns (why, report) after a fetch, None when the
        node's own state is right. Raises FetchError or IncompatibleState when a needed fetch
        fails."""
        skipped = self._refusals.manifests | self.adoption.unlinked()
        read = await self._holders()
        self.holder_steps = tuple(h.step for h in read)
        self.adoption.advertised(read)
        holders = [h for h in read if h.manifest not in skipped]
        earned = self.lineage.lineage.round_mates(trust.EARNED_ROUNDS) - {self.host.peer_id}
        own_sha = self.current.manifest.sha256 if self.current is not None else None
        own = self.lineage.lineage
        last_round = frozenset(own.links[-1].members) if own.links and own.step == diloco.outer_step else frozenset()
        known = Known(diloco.outer_step, horizon, self.vouching, missed, earned, own_sha, last_round,
                      self.adoption.ancestors(diloco.outer_step))  # fmt: skip
        verdict = choose_trusted(holders, known)
        for peer, reason in verdict.refused:
            kind = "unreachable" if "reachable" in reason else "backing"
            self._distrusted.log(peer, kind, "not adopting the state it advertises: %s", reason)
        why = None
        if verdict.choice is not None:
            step, sha, agreeing = verdict.choice
            why = fetch_reason(step, sha, len(agreeing), diloco.outer_step, own_sha,
                               alone_last_step=alone_last_step, client=self.server is None,
                               servers_behind=servers_behind, other_state=other_state)  # fmt: skip
        if why is None:  # our own state is right, unless a lineage that outweighs ours forked from it
            if verdict.fork is None or verdict.fork[1] in self.adoption.not_forks():
                return None
            if time.monotonic() - self._fork_checked_at < FORK_CHECK_S:
                return None
            self._fork_checked_at = time.monotonic()
            step, sha, agreeing = verdict.fork
            why = LARGER_LINEAGE
        try:
            linked = await self.adoption.linked(agreeing, step, sha, fork_only=why == LARGER_LINEAGE)
        except FetchError as e:
            self._refusals.not_delivered(e.failed, sha)
            raise
        if linked is None:
            return None
        if why == LARGER_LINEAGE:
            back = diloco.outer_step - step
            lost = f", {back} step(s) behind ours: the steps we took apart are lost" if back > 0 else ""
            logger.warning("our state is a fork's smaller lineage: taking state %s of outer step %d from %d "
                           "holder(s)%s", sha[:12], step, len(agreeing), lost)  # fmt: skip
        # an update is of the holders' parent state, which a fork's other side does not share with us
        if step == diloco.outer_step + 1 and self.config.by_update and why != LARGER_LINEAGE:
            # an update comes from one holder: no wait for more donors to spread it over (below)
            report = await self._by_update(diloco, sha, agreeing, why, linked)
            if report is not None:
                return why, report
        settled = await settled_holders(holders, step, self._holders)  # spread the fetch over all donors
        chosen = [h for h in settled if h.step == step and h.manifest == sha] or agreeing  # only the chosen state
        donors = [h for h in chosen if self._refusals.delivered(h, sha)] or chosen  # not an update's liars
        dest = self.checkpoints.path if self.checkpoints is not None else None  # resumable only with a checkpoint dir
        try:
            manifest, state, report = await fetch_state(
                self.host,
                self.run.run_id,
                donors,
                expect=self.run,
                dest=dest,
                config=self.config.fetch,
                on_progress=self.on_fetch_progress,
                find_holders=self._holders,
                expect_tensors=await self.in_trainer(tensor_sizes, diloco),
            )
            await self.adoption.check_leads_to(state, sha, linked[0])
            try:
                await self.in_trainer(diloco.load_state_dict, state)
            except ValueError as e:  # hashes right, but NaN or misshapen tensors: never ours
                raise RefusedManifest(sha, f"its tensors are unusable: {e}") from None
        except RefusedManifest as e:  # never chosen again; its holders are named once
            self._refusals.refuse(e.sha, (h.peer_id for h in donors if h.manifest == e.sha))
            for holder in donors:
                self._distrusted.log(holder.peer_id, "manifest", "refusing the state it advertises: %s", e)
            raise
        except FetchError as e:
            self._refusals.not_delivered(e.failed, sha)
            raise
        self.lineage.adopt(*linked)
        if why == LARGER_LINEAGE:
            self.adoption.left_lineage()
        if dest is not None:
            await asyncio.to_thread(remove_fetch_dir, dest, manifest)
        logger.info("fetched the state of outer step %d (%s): %.1f MB from %d peers in %.2fs", manifest.step, why,
                    report.total_bytes / 1e6, len(report.bytes_by_peer), report.elapsed_s)  # fmt: skip
        await self.publish(diloco, checkpoint=True)
        return why, report

    async def _by_update(self, diloco: DiLoCo, sha: str, donors: list[Holder], why: str,
                         linked: Linked) -> FetchReport | None:  # fmt: skip
        """Take state `sha` (our step + 1) from our state and the step's update (update_fetch.py);
        None when no donor's update led to it (the caller fetches the whole state)."""
        started = time.perf_counter()
        base = await self.beside_trainer(diloco.state_sha256)
        try:
            manifest = await fetch_manifest(self.host, self.run.run_id, donors, sha, self.run,
                                            self.config.update_timeout)  # fmt: skip
        except FetchError as e:  # the whole fetch asks again, and refuses or names them
            logger.info("no manifest of state %s for an update: %s", sha[:12], e)
            return None
        if manifest_problem(manifest, await self.in_trainer(tensor_sizes, diloco)) is not None:
            return None  # the whole fetch refuses it and its holders
        shapes = await self.in_trainer(diloco.round_shapes)
        caught, failed = await by_update(
            self.host, self.run.run_id, donors, manifest, base=base, numel=sum(s.numel() for s in shapes),
            shapes=shapes, stepped=lambda averaged: self.beside_trainer(diloco.stepped_state, averaged),
            timeout=self.config.update_timeout)  # fmt: skip
        self._refusals.not_delivered(failed, sha)
        if caught is None:
            return None
        await self.adoption.check_leads_to(caught.state, sha, linked[0])
        await self.in_trainer(diloco.load_state_dict, caught.state)
        self.lineage.adopt(*linked)
        if self.server is not None:  # we hold the step's update now too: a node behind us can take it
            self.server.publish_update(StepUpdate(manifest.step - 1, base, caught.body))
        nbytes = len(caught.body)
        report = FetchReport(manifest.step, sha, manifest.total_bytes, fetched_bytes=nbytes,
                             elapsed_s=time.perf_counter() - started, bytes_by_peer={str(caught.peer): nbytes},
                             by_update=True)  # fmt: skip
        logger.info("caught up to outer step %d (%s) by its update: %.2f MB from %s in %.2fs, instead of the "
                    "%.1f MB state", manifest.step, why, nbytes / 1e6, caught.peer, report.elapsed_s,
                    manifest.total_bytes / 1e6)  # fmt: skip
        await self.publish(diloco, checkpoint=True, made=caught.snapshot if manifest.run == self.run else None)
        return report

    def record_update(self, step: int, base: str, averaged: list[torch.Tensor], codec: str, block_size: int) -> None:
        """Serve the update outer step `step` applied to our state `base` (state_sha256 hex): the
        group's average `averaged` (tensors no one writes again), encoded in a thread meanwhile;
        the next publication (the state it made) waits for it, so it is served no later."""
        if self.server is None or not self.config.by_update:
            return
        self._recording = asyncio.ensure_future(self._record(self.server, step, base, averaged, codec, block_size))

    async def _record(self, server: StateServer, step: int, base: str, averaged: list[torch.Tensor], codec: str,
                      block_size: int) -> None:  # fmt: skip
        try:
            body = await asyncio.to_thread(encode_update, averaged, codec, block_size)
        except Exception:  # a node that cannot serve its update still trains: the late fetch the state
            logger.exception("could not keep the update of outer step %d", step)
            return
        server.publish_update(StepUpdate(step, base, body))

    async def _holders(self) -> list[Holder]:
        """The run's state records, less ours, those of refused peers, and states their holder
        did not deliver to us lately (refusals.py)."""
        return self._refusals.keep(await find_holders(self.dht, self.run.run_id), self.host.peer_id)

    # --- holding a state --------------------------------------------------------------------------

    async def publish(
        self,
        diloco: DiLoCo,
        *,
        checkpoint: bool | None = None,
        local: Callable[[], dict[str, torch.Tensor]] | None = None,
        made: Snapshot | None = None,
    ) -> None:
        """Copy the state now (in the trainer's thread); serve, advertise and checkpoint it in
        the background. A previous publication still under way is finished first. `local`: this
        node's own tensors to checkpoint beside the state (never served), read in the trainer's
        thread too (load_local gives them back). `made`: the state's snapshot, already made."""
        if self._publishing is not None:
            await asyncio.gather(self._publishing, return_exceptions=True)
        copied = None if made is not None else await self.beside_trainer(lambda: copy_state(diloco.state_dict()))
        if checkpoint is None:
            checkpoint = diloco.outer_step % self.config.checkpoint_every == 0
        own = await self.beside_trainer(local) if local is not None and checkpoint and self.checkpoints else None
        receipts = list(self.lineage.receipts) if checkpoint and self.checkpoints else None
        self._publishing = asyncio.ensure_future(self._publish(copied if made is None else made, checkpoint, own,
                                                               receipts))  # fmt: skip

    async def load_local(self, step: int) -> dict[str, torch.Tensor]:
        """The node's own tensors checkpointed with the state of `step` ({}: none)."""
        if self.checkpoints is None:
            return {}
        return await asyncio.to_thread(self.checkpoints.load_local, step)

    async def _publish(self, copied: dict[str, Any] | Snapshot, checkpoint: bool,
                       local: dict[str, torch.Tensor] | None, receipts: list[Receipt] | None) -> None:  # fmt: skip
        try:
            snapshot = copied if isinstance(copied, Snapshot) else await asyncio.to_thread(
                make_snapshot, copied, self.run, self.config.shard_bytes)  # fmt: skip
            del copied
            self.current = snapshot
            self.adoption.ours(snapshot.manifest.step, snapshot.manifest.sha256)
            if self._recording is not None:  # the update that made this state: served before it is advertised
                await self._recording
            if self.server is not None:
                self.server.publish(snapshot)
                await self._advertise(snapshot.manifest)
                if self._refresher is None:
                    self._refresher = Supervised("state advertisement", self._refresh_forever).start()
            if checkpoint and self.checkpoints is not None:
                started = time.perf_counter()
                lineage = None if receipts is None else await asyncio.to_thread(encode_receipts, receipts)
                where = await asyncio.to_thread(self.checkpoints.write, snapshot, local, lineage)
                logger.info("checkpoint of outer step %d written to %s in %.2fs", snapshot.manifest.step, where,
                            time.perf_counter() - started)  # fmt: skip
        except OSError as e:  # a full disk must not stop training: say so, try again next step
            logger.error("could not write the checkpoint: %s", e)
        except Exception:
            logger.exception("could not publish the state")

    async def _advertise(self, manifest: Manifest) -> bool:
        """Advertise the state we serve; False when it is stored nowhere (store_or_warn warned):
        peers cannot fetch from us until the refresh, advertise_ttl / 3 later, succeeds."""
        maddrs, ttl = self.host.visible_maddrs, self.config.advertise_ttl
        refresh = ttl / 3
        ok = await advertise(self.dht, self.run.run_id, manifest, maddrs, time.time() + ttl, within=refresh)
        if not ok:  # store_or_warn said why, at WARNING: this line says what it costs
            logger.info("the state of outer step %d is not advertised: peers cannot fetch it from us; trying again "
                        "in %.0fs", manifest.step, refresh)  # fmt: skip
        self.advertised = ok
        return ok

    async def _refresh_forever(self) -> None:
        """Keep the advertisement alive between outer steps (it expires soon after we stop)."""
        while True:
            await asyncio.sleep(self.config.advertise_ttl / 3)
            if self.current is not None:
                await self._advertise(self.current.manifest)
