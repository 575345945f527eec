"""swarm.join: train your own PyTorch model in the swarm, from your own loop.

    import swarm
    model = MyModel()                                      # the same seed on every process
    with swarm.join(model, lambda params: torch.optim.AdamW(params, lr=1e-3), run_id="mine",
                    initial_peers=["/ip4/.../tcp/31400/p2p/Qm..."], inner_steps=20) as session:
        while True:
            loss = my_loss(model, next(batches))
            loss.backward()
            if not session.step(loss):                     # inner step; the outer step when H are done
                break                                      # the run is over (max_outer_steps) or stopped

What runs where: the swarm's node (DHT, matchmaking, all-reduce, state serving and fetching) is
the same SwarmNode as swarm-node's, on an event loop in a background thread; the caller's thread
runs forward, backward and `session.step`. Every H steps `step` blocks while the node averages the
pseudo-gradients with its group and applies the outer step to the model's parameters, or fetches
the swarm's state; it returns when the next inner step may begin (user_steps.py says why the two
never touch the parameters at once).

What the swarm shares: the trainable parameters (θ_outer) and the outer momentum. Buffers (such
as batch-norm statistics) and the inner optimizer's state stay local. Nodes agree on the model's
architecture (parameter names, shapes, dtypes), its initial weights, H, the outer optimizer, the
compression and `tokens_per_step` (the weight of one inner step in the average): a process that
differs is refused at start with a line naming both values.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from swarm.dht.config import DHTConfig
from swarm.dht.id_proof import proof_path_for
from swarm.model.diloco import OptimizerFactory
from swarm.model.run_settings import CUSTOM_MODEL
from swarm.node import Event, SwarmNode
from swarm.node.config import NodeConfig
from swarm.node.permits import SessionClosed
from swarm.p2p.config import P2PConfig
from swarm.p2p.identity import Identity
from swarm.utils import eventloop

logger = logging.getLogger(__name__)

__all__ = ["SessionClosed", "SwarmError", "SwarmSession", "join"]

# NodeConfig fields that belong to swarm-node's own data and loop, not to a caller's
_NOT_FOR_CALLERS = frozenset({"model", "data", "tokenizer", "seed", "batch_size", "seq_len", "lr", "warmup_steps",
                              "lr_schedule", "total_steps", "decay_fraction", "min_lr_ratio", "device",
                              "eval_windows"})  # fmt: skip
END_WAIT = 30.0  # seconds to wait for an ending node's thread before reporting how it ended
_NODE_OPTIONS = frozenset(f.name for f in dataclasses.fields(NodeConfig)) - _NOT_FOR_CALLERS


class SwarmError(RuntimeError):
    """The swarm session could not start or go on; the message says why."""


class SwarmSession:
    """A running swarm node around the caller's model: made by `join`, ended by `close` (or
    the `with` block). Owns the node's background thread and its event loop."""

    def __init__(self, node: SwarmNode) -> None:
        self._node, self._steps = node, node.inner  # the permits the caller's steps spend
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self.reason: str | None = None  # why the node ended: "finished", "stopped"
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name=f"swarm-node-{str(node.peer_id)[-6:]}", daemon=True)

    # --- what the caller reads ---------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return str(self._node.peer_id)

    @property
    def maddrs(self) -> list[str]:
        """Where other processes join this one (`initial_peers`); empty in client mode."""
        return list(self._node.maddrs)

    @property
    def outer_step(self) -> int:
        return self._node.diloco.outer_step

    @property
    def inner_step(self) -> int:
        """Inner steps done since the last outer step."""
        return self._node.diloco.inner_done

    def state_sha256(self) -> str:
        """The hash of the swarm state this process holds (θ_outer, momentum, step): equal on
        every member of the swarm after the same outer step."""
        return self._node.diloco.state_sha256()

    # --- the loop ----------------------------------------------------------------------------

    def step(self, loss: torch.Tensor | float | None = None) -> bool:
        """One inner step of the caller's model after its backward: gradient clipping, the inner
        optimizer's step, zero_grad. After H of them the outer step runs (blocking). True while
        the run goes on; False once it is over (max_outer_steps, or the session closed).
        `loss` is only reported (progress records, events). Raises SwarmError when the node
        failed, NonFiniteLossError (the step skipped, nothing changed) on a NaN/inf gradient."""
        self._raise_failure()
        try:
            self._steps.step(self._node.config.batch_size, loss=loss)
        except SessionClosed:
            self._thread.join(END_WAIT)
            self._raise_failure()
            return False
        return self._wait_for_permit()

    def close(self, timeout: float = 60.0) -> None:
        """Stop the node after its current round and wait for its thread (bounded). The caller's
        loop has stopped stepping: a group that counts on us averages what we trained so far."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._steps.finish()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the swarm node did not stop within %.0fs; leaving its thread", timeout)
        self._steps.close()

    def __enter__(self) -> SwarmSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- inside ------------------------------------------------------------------------------

    def _start(self, timeout: float) -> None:
        self._thread.start()
        try:
            # False: the run ended before our first inner step (we arrived as it finished): the
            # caller's first `step` says so
            self._wait_for_permit(timeout)
        except TimeoutError:
            self.close()
            raise SwarmError(f"the swarm node did not start training within {timeout:g}s") from None

    def _wait_for_permit(self, timeout: float | None = None) -> bool:
        """Wait, in slices so a dead node thread is noticed, for the next inner step."""
        waited = 0.0
        while True:
            try:
                open_ = self._steps.wait_for_permit(1.0)
            except TimeoutError:
                waited += 1.0
                if not self._thread.is_alive():
                    self._steps.close()
                    self._raise_failure()
                    return False
                if timeout is not None and waited >= timeout:
                    raise
                continue
            if not open_:  # closed: the node is ending; its failure, if any, is set as its thread ends
                self._thread.join(END_WAIT)
                self._raise_failure()
            return open_

    def _raise_failure(self) -> None:
        if self.error is not None:
            raise SwarmError(f"the swarm node failed: {self.error}") from self.error

    def _serve(self) -> None:
        try:
            self.reason = eventloop.run(self._main())
        except BaseException as e:  # the caller's thread reports it (step raises SwarmError)
            logger.error("the swarm node failed: %s", e)
            self.error = e
        finally:
            self._steps.close()

    async def _main(self) -> str:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        return await self._node.run(self._stop)


def join(
    model: nn.Module,
    inner_optimizer: OptimizerFactory | None = None,
    *,
    run_id: str = "swarm",
    initial_peers: Sequence[str] = (),
    inner_steps: int = 50,
    tokens_per_step: int = 1,
    host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",),
    announce_maddrs: Sequence[str] = (),
    identity_path: str | Path | None = None,
    evaluate: Callable[[nn.Module], float] | None = None,
    on_event: Callable[[Event], None] | None = None,
    start_timeout: float = 600.0,
    **options: Any,
) -> SwarmSession:
    """Join (or start) swarm run `run_id` with the caller's `model`; returns when the first inner
    step may run (after fetching the swarm's state where it is ahead).

    inner_optimizer: builds the inner optimizer from the list of trainable parameters (default:
        AdamW with swarm-node's schedule); a given one keeps its own learning rate.
    tokens_per_step: the weight of one inner step in the group's average (tokens or samples per
        batch; the same on every process).
    evaluate: `evaluate(model) -> float`, run after each outer step (as "eval_loss" in events).
    options: swarm-node's other settings by name: outer_lr, outer_momentum, compression,
        max_outer_steps, matchmaking_time, max_wait, part_timeout, checkpoint_dir, client_mode, ...
    Raises SwarmError (could not start), ValueError (a bad setting).
    """
    unknown = sorted(set(options) - _NODE_OPTIONS)
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)}: choose from {', '.join(sorted(_NODE_OPTIONS))}")
    config = NodeConfig(model=CUSTOM_MODEL, run_id=run_id, inner_steps=inner_steps, batch_size=tokens_per_step,
                        seq_len=1, **options)  # fmt: skip
    p2p_config = P2PConfig(host_maddrs=tuple(host_maddrs), announce_maddrs=tuple(announce_maddrs))
    identity, proof_path = None, None
    if identity_path is not None:
        identity_path = Path(identity_path)
        identity = Identity.load_or_create(identity_path)
        proof_path = proof_path_for(identity_path)
    node = SwarmNode(config, identity=identity, initial_peers=tuple(initial_peers), p2p_config=p2p_config,
                     on_event=on_event, model=model, inner_optimizer=inner_optimizer, evaluate=evaluate,
                     id_proof_path=proof_path, dht_config=DHTConfig())  # fmt: skip
    session = SwarmSession(node)
    session._start(start_timeout)
    return session
