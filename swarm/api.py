"""swarm.join: train your own PyTorch model in the swarm, from your own loop.

    import swarm
    model = MyModel()                                      # the same seed on every process
    session = swarm.join(model, lambda params: torch.optim.AdamW(params, lr=1e-3), run_id="mine",
                         initial_peers=sys.argv[1:], inner_steps=20)   # returns once it listens
    print(*session.maddrs)                                 # what the others pass as initial_peers
    session.wait_for_peers(3, timeout=600)                 # optional: start with 3 processes
    with session:
        while True:
            loss = my_loss(model, next(batches))
            loss.backward()
            if not session.step(loss):                     # inner step; the outer step when H are done
                break                                      # the run ended, this process left, or it stopped

`join` returns as soon as the node listens on a free port (or `host_maddrs`), has joined the DHT
and has checked that the run's settings are its own: `session.maddrs` is known at once. A session
that starts a run (no `initial_peers`) returns once it also holds its first state and its progress
record, with the run's settings, is in the DHT: a process that joins through it at once reads them
and is refused on others. The swarm's state arrives next; the first forward pass waits for it
(entering the `with` block, `wait_for_peers` or the first `step` do). Errors reach the caller as
SwarmError, one line that names the Python argument to change.

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
import concurrent.futures
import dataclasses
import logging
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from swarm.dht.config import DHTConfig
from swarm.dht.errors import DHTError
from swarm.dht.id_proof import proof_path_for
from swarm.model.diloco import OptimizerFactory
from swarm.node import Event, NodeError, SwarmNode
from swarm.node.config import NodeConfig
from swarm.node.inner_steps import SessionClosed
from swarm.node.settings import CUSTOM_MODEL
from swarm.p2p.config import P2PConfig
from swarm.p2p.errors import P2PError
from swarm.p2p.identity import Identity
from swarm.p2p.maddr import parse_address, parse_maddrs
from swarm.utils import eventloop

logger = logging.getLogger(__name__)

__all__ = ["SessionClosed", "SwarmError", "SwarmSession", "join"]

# NodeConfig fields that belong to swarm-node's own data and loop, not to a caller's
_NOT_FOR_CALLERS = frozenset({"model", "data", "tokenizer", "seed", "batch_size", "seq_len", "lr", "warmup_steps",
                              "lr_schedule", "total_steps", "decay_fraction", "min_lr_ratio", "device",
                              "eval_windows"})  # fmt: skip
END_WAIT = 30.0  # seconds to wait for an ending node's thread before reporting how it ended
SLICE_S = 1.0  # a wait on the node is cut in slices this long, so that a dead node thread is noticed
_NODE_OPTIONS = frozenset(f.name for f in dataclasses.fields(NodeConfig)) - _NOT_FOR_CALLERS
_ARGUMENTS = _NODE_OPTIONS | {"run_id", "initial_peers", "inner_steps", "host_maddrs", "announce_maddrs",
                              "identity_path"}  # fmt: skip
# failures a caller can cause or meet (a taken port, a refused setting, unreachable peers): told in
# one line; anything else is a bug, whose traceback is kept as the error's cause
_EXPLAINED = (NodeError, P2PError, DHTError, OSError, ValueError, TimeoutError)


class SwarmError(RuntimeError):
    """The swarm session could not start or go on; the message says why, in one line."""


def python_names(message: str) -> str:
    """A node's message as a caller of `join` reads it: each swarm-node flag that is an argument
    of `join` (`--host-maddrs`, `--inner-steps`) becomes that argument (`host_maddrs=`)."""

    def named(match: re.Match[str]) -> str:
        name = match.group(1).replace("-", "_")
        return f"{name}=" if name in _ARGUMENTS else match.group(0)

    return re.sub(r"--([a-z][a-z0-9-]*)", named, message)


def _explained(error: BaseException) -> SwarmError:
    """The SwarmError the caller sees for the node's failure."""
    text = python_names(" ".join(str(error).split()) or type(error).__name__)
    failure = SwarmError(text)
    if not isinstance(error, _EXPLAINED):
        failure.__cause__ = error
    failure.__suppress_context__ = True
    return failure


class SwarmSession:
    """A running swarm node around the caller's model: made by `join`, ended by `close` (or
    the `with` block). Owns the node's background thread and its event loop."""

    def __init__(self, node: SwarmNode, joined: threading.Event) -> None:
        self._node, self._steps = node, node.inner  # the permits the caller's steps spend
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._joined = joined  # set when join may return: the node listens (the run's first: it started)
        self._start_timeout = 600.0  # join's start_timeout: the longest wait for the first inner step
        self._holding = False  # the caller holds a permit (it waited for one; its next step spends it)
        self.reason: str | None = None  # why the node ended: "finished", "left", "run ended", "stopped"
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

    def wait_for_peers(self, nodes: int, timeout: float = 600.0) -> int:
        """Block until `nodes` processes of the run, this one included, hold the run's state and
        are live, and this one may train: the barrier for processes that should train together
        from their first step. Returns how many are live. Raises SwarmError after `timeout`
        seconds, or when the node failed."""
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        self._raise_failure()
        if self._loop is None or self._loop.is_closed():
            raise SwarmError(f"the swarm session has ended ({self.reason})")
        counted = asyncio.run_coroutine_threadsafe(self._node.wait_for_peers(nodes, timeout), self._loop)
        try:
            live = self._in_slices(lambda: counted.result(SLICE_S), timeout + 2 * SLICE_S)
        except (TimeoutError, concurrent.futures.TimeoutError):
            counted.cancel()
            live = 0
        if live < nodes:
            raise SwarmError(f"wait_for_peers({nodes}, timeout={timeout:g}): {live or 'no'} process(es) of run "
                             f"{self._node.config.run_id!r} live after {timeout:g}s")  # fmt: skip
        self._first_permit(timeout)
        return live

    def step(self, loss: torch.Tensor | float | None = None) -> bool:
        """One inner step of the caller's model after its backward: gradient clipping, the inner
        optimizer's step, zero_grad. After H of them the outer step runs (blocking). True while
        the run goes on; False once it is over for this process (`reason` says why: "finished",
        the run's end; "left", leave_after_steps; "run ended", it had ended before we arrived;
        "stopped", the session closed).
        `loss` is only reported (progress records, events). Raises SwarmError when the node
        failed, NonFiniteLossError (the step skipped, nothing changed) on a NaN/inf gradient."""
        self._raise_failure()
        if not self._holding and not self._first_permit(self._start_timeout):
            return False
        try:
            self._steps.step(self._node.config.batch_size, loss=loss)
        except SessionClosed:
            self._holding = False
            self._thread.join(END_WAIT)
            self._raise_failure()
            return False
        self._holding = False
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
        """The block's first forward pass runs on the run's state: wait for it here."""
        self._first_permit(self._start_timeout)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- inside ------------------------------------------------------------------------------

    def _start(self, timeout: float) -> None:
        """Start the node's thread; return once peers may join through it (its maddrs known; the run's
        first node: its state held and its record stored), before the swarm's state."""
        self._start_timeout = timeout
        self._thread.start()
        try:
            self._in_slices(self._wait_joined, timeout)
        except TimeoutError:
            self.close()
            raise SwarmError(f"the swarm node did not join the DHT within {timeout:g}s (start_timeout=)") from None
        except SwarmError:
            self.close()
            raise

    def _first_permit(self, timeout: float) -> bool:
        """Wait for the first inner step (the run's state is here); False: the run ended first."""
        if self._holding:
            return True
        try:
            return self._wait_for_permit(timeout)
        except TimeoutError:
            raise SwarmError(f"the swarm node did not start training within {timeout:g}s "
                             "(start_timeout=)") from None  # fmt: skip

    def _in_slices(self, wait: Callable[[], Any], timeout: float) -> Any:
        """wait() again while it raises TimeoutError (it waits one slice), until `timeout`; raises
        the node's failure as soon as its thread has ended."""
        waited = 0.0
        while True:
            try:
                return wait()
            except (TimeoutError, concurrent.futures.TimeoutError):
                waited += SLICE_S
                if not self._thread.is_alive():
                    self._thread.join()
                    self._raise_failure()
                    raise SwarmError(f"the swarm node ended ({self.reason})") from None
                if waited >= timeout:
                    raise

    def _wait_for_permit(self, timeout: float | None = None) -> bool:
        """Wait, in slices so a dead node thread is noticed, for the next inner step."""
        try:
            open_ = self._in_slices(lambda: self._steps.wait_for_permit(SLICE_S), timeout or float("inf"))
        except SwarmError as e:  # the thread ended: a failure, or the run's end
            self._steps.close()
            if self.error is not None:
                raise
            logger.debug("%s", e)
            return False
        if not open_:  # closed: the node is ending; its failure, if any, is set as its thread ends
            self._thread.join(END_WAIT)
            self._raise_failure()
        self._holding = open_
        return open_

    def _raise_failure(self) -> None:
        if self.error is not None:
            raise _explained(self.error)

    def _wait_joined(self) -> None:
        if not self._joined.wait(SLICE_S):
            raise TimeoutError

    def _serve(self) -> None:
        try:
            self.reason = eventloop.run(self._main())
        except BaseException as e:  # the caller's thread reports it (step raises SwarmError)
            logger.info("the swarm node failed: %s", e)
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
    """Join (or start) swarm run `run_id` with the caller's `model`; returns once the node listens
    (`session.maddrs`), has joined the DHT and found the run's settings its own (a run's first
    session: once its state and settings are published). The swarm's state is fetched next;
    entering the `with` block, `wait_for_peers` or the first `step` wait for it.

    initial_peers: multiaddrs of processes of the run (a list; none: start a new run).
    host_maddrs: where to listen; the default takes a free port on every interface.

    inner_optimizer: builds the inner optimizer from the list of trainable parameters (default:
        AdamW with swarm-node's schedule); a given one keeps its own learning rate.
    tokens_per_step: the weight of one inner step in the group's average (tokens or samples per
        batch; the same on every process).
    evaluate: `evaluate(model) -> float`, run after each outer step (as "eval_loss" in events).
    options: swarm-node's other settings by name: outer_lr, outer_momentum, compression,
        max_outer_steps (the run's length in outer steps of the swarm, a run setting: taken from the
        run when not given), leave_after_steps (this process's own stay: it leaves once the swarm
        has done that many outer steps since it joined), matchmaking_time, max_wait, part_timeout,
        checkpoint_dir, client_mode, ...
    Raises SwarmError (could not start, one line naming the argument to change), ValueError (a
    bad setting).
    """
    unknown = sorted(set(options) - _NODE_OPTIONS)
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)}: choose from {', '.join(sorted(_NODE_OPTIONS))}")
    config = NodeConfig(model=CUSTOM_MODEL, run_id=run_id, inner_steps=inner_steps, batch_size=tokens_per_step,
                        seq_len=1, **options)  # fmt: skip
    peers = _addresses("initial_peers", initial_peers, dial=True)
    try:
        p2p_config = P2PConfig(host_maddrs=_addresses("host_maddrs", host_maddrs),
                               announce_maddrs=_addresses("announce_maddrs", announce_maddrs))  # fmt: skip
    except ValueError as e:
        raise ValueError(python_names(str(e))) from None
    identity, proof_path = None, None
    if identity_path is not None:
        identity_path = Path(identity_path)
        try:
            identity = Identity.load_or_create(identity_path)
        except (P2PError, OSError) as e:
            raise SwarmError(f"identity_path={str(identity_path)!r}: {e}") from None
        proof_path = proof_path_for(identity_path)
    joined = threading.Event()
    # the run's first session waits for its own state (local: its genesis or checkpoint) and
    # record; a joining one does not wait for the fetch of the swarm's state, which may be long
    ready_on = "listening" if peers else "start"

    def events(event: Event) -> None:
        if event["event"] == ready_on:
            joined.set()
        if on_event is not None:
            on_event(event)

    node = SwarmNode(config, identity=identity, initial_peers=peers, p2p_config=p2p_config, on_event=events,
                     model=model, inner_optimizer=inner_optimizer, evaluate=evaluate, id_proof_path=proof_path,
                     dht_config=DHTConfig())  # fmt: skip
    session = SwarmSession(node, joined)
    session._start(start_timeout)
    return session


def _addresses(argument: str, values: Sequence[str], *, dial: bool = False) -> tuple[str, ...]:
    """A list of multiaddrs, checked: ValueError naming `argument` (a bare string is one common slip)."""
    if isinstance(values, str):
        raise ValueError(f"{argument}= takes a list of multiaddrs, not one string: [{values!r}]")
    texts = tuple(values)
    for text in texts:
        try:
            parse_address(text) if dial else parse_maddrs([text])
        except (ValueError, TypeError) as e:
            raise ValueError(f"{argument}=: {e}") from None
    return texts
