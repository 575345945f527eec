"""RankGroup: this process's membership of its node's torch.distributed group.

    group = RankGroup.open(launch, timeout=120.0, store=store)   # rendezvous; every wait bounded
    settings = group.hello(settings if group.leader else None)   # device kinds checked, rank 0's settings
    group.wrap(model)                                            # group.ddp; broadcasts rank 0's module
    group.send(Command(Op.STEP, ...)) / group.receive()          # commands.py
    group.broadcast_params(params)                               # after Op.SYNC
    group.close()

Every collective here and in DDP is bounded by `timeout` (init_process_group's, which gloo and
NCCL apply to each collective): a rank that died or hangs makes the others raise, never wait
forever. Rank 0 calls these from its training thread only, never from the event loop.
"""

from __future__ import annotations

import datetime
import gc
import inspect
import json
import logging
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from swarm.ranks.commands import COMMAND_WORDS, Command, decode, encode
from swarm.ranks.launch import LaunchError, RankLaunch, mixed_devices

logger = logging.getLogger(__name__)

__all__ = ["RankGroup", "RankGroupError", "describe"]

MAX_HELLO = 1 << 20  # bytes of rank 0's settings JSON
_KINDS = ("cpu", "cuda", "other")


class RankGroupError(RuntimeError):
    """The node's ranks cannot work together (a rank died, timed out or disagrees)."""


class RankGroup:
    """One process's rank in its node (see the module docstring); `comm` is where collective
    tensors live (the rank's GPU under NCCL, the CPU under gloo)."""

    def __init__(self, launch: RankLaunch, timeout: float) -> None:
        self.launch, self.timeout = launch, timeout
        self.rank, self.world_size = launch.rank, launch.world_size
        self.device = torch.device(launch.device)
        self.comm = self.device if launch.backend == "nccl" else torch.device("cpu")
        # the module every forward runs through: DDP (wrap) or the fully_shard model (shard.py);
        # held here alone, dropped by close()
        self.ddp: nn.Module | None = None

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def open(cls, launch: RankLaunch, *, timeout: float, store: dist.Store | None = None) -> RankGroup:
        """Join the node's process group: through `store` (spawn.py: rank 0 made it on a free port,
        the ranks it started dial it), else torchrun's rendezvous. Raises RankGroupError within
        `timeout`."""
        group = cls(launch, timeout)
        if launch.backend == "nccl":
            torch.cuda.set_device(group.device)
        # torchrun: env:// (MASTER_ADDR/PORT), which also joins the store torchrun's agent serves there
        kwargs: dict[str, Any] = {"store": store} if store is not None else {"init_method": "env://"}
        try:
            dist.init_process_group(launch.backend, rank=launch.rank, world_size=launch.world_size,
                                    timeout=datetime.timedelta(seconds=timeout), **kwargs)  # fmt: skip
        except (RuntimeError, ValueError, OSError) as e:  # DistStoreError is a RuntimeError
            raise RankGroupError(f"rank {launch.rank}: the node's ranks did not meet within {timeout:g}s "
                                 f"({describe(e)})") from None  # fmt: skip
        return group

    def close(self) -> None:
        if dist.is_initialized():
            # DDP's reducer (held in reference cycles) must go before its process group: destroyed
            # after it, at interpreter exit, it aborted the process (torch 2.13, under torchrun)
            self.ddp = None
            gc.collect()
            dist.destroy_process_group()

    # --- the hello ------------------------------------------------------------------------

    def hello(self, settings: dict[str, Any] | None) -> dict[str, Any]:
        """Check that every rank runs on one kind of device, then hand rank 0's `settings` (JSON
        values) to every rank; returns them. Raises LaunchError on mixed devices."""
        kind = torch.tensor([_KINDS.index(self.device.type) if self.device.type in _KINDS else 2], device=self.comm)
        kinds = [torch.zeros_like(kind) for _ in range(self.world_size)]
        dist.all_gather(kinds, kind)
        problem = mixed_devices([_KINDS[int(k.item())] for k in kinds])
        if problem is not None:
            raise LaunchError(problem)
        body = json.dumps(settings).encode() if self.leader else b""
        size = torch.tensor([len(body)], dtype=torch.int64, device=self.comm)
        dist.broadcast(size, 0)
        n = int(size.item())
        if not 0 < n <= MAX_HELLO:
            raise RankGroupError(f"rank 0's settings are {n} bytes (at most {MAX_HELLO})")
        buffer = (torch.frombuffer(bytearray(body), dtype=torch.uint8) if self.leader
                  else torch.empty(n, dtype=torch.uint8)).to(self.comm)  # fmt: skip
        dist.broadcast(buffer, 0)
        received = json.loads(bytes(buffer.cpu().tolist()))
        if not isinstance(received, dict):
            raise RankGroupError("rank 0's settings are not a JSON object")
        return received

    def wrap(self, model: nn.Module) -> nn.parallel.DistributedDataParallel:
        """DDP over the model (its constructor broadcasts rank 0's parameters), kept as `self.ddp`
        (callers do not keep it: close() must drop the last reference). Buffers are not broadcast
        each step: the model's are constants (rotary tables), built alike everywhere."""
        ids = [self.device.index] if self.device.type == "cuda" else None
        # torch 2.13 renamed broadcast_buffers (and warns); older ones know only the old name
        params = inspect.signature(nn.parallel.DistributedDataParallel).parameters
        no_buffer_sync = {"forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers": False}
        self.ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids, **no_buffer_sync)
        return self.ddp

    # --- commands and their payloads -------------------------------------------------------

    def send(self, command: Command) -> None:
        """Rank 0: broadcast one command."""
        dist.broadcast(torch.tensor(encode(command), dtype=torch.int64, device=self.comm), 0)

    def receive(self) -> Command:
        """Ranks 1..N-1: the next command (raises CommandError on a malformed one)."""
        words = torch.zeros(COMMAND_WORDS, dtype=torch.int64, device=self.comm)
        dist.broadcast(words, 0)
        return decode([int(w) for w in words.tolist()])

    @torch.no_grad()
    def broadcast_params(self, params: Sequence[torch.Tensor]) -> None:
        """Rank 0's values of `params` into every rank's, one broadcast per tensor (no copy of the
        whole model: a big model's ranks have no room for one)."""
        for p in params:
            if p.device == self.comm:
                dist.broadcast(p.data, 0)
            else:  # gloo with a GPU parameter never happens (gloo ranks run on the CPU); kept total
                staged = p.data.to(self.comm)
                dist.broadcast(staged, 0)
                p.data.copy_(staged)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean over the ranks of a scalar (the loss): the same bits on every rank."""
        total = value.detach().float().reshape(1).to(self.comm)
        dist.all_reduce(total)
        return (total / self.world_size).reshape(())


def describe(error: BaseException) -> str:
    """One short line for a collective's error: its type and first line, without the C++
    source location gloo puts in front ("[.../unbound_buffer.cc:78] Timed out ...")."""
    text = str(error).strip().splitlines()
    first = re.sub(r"^\[[^\]]*\]\s*", "", text[0]) if text else ""
    return f"{type(error).__name__}: {first}"[:300]
