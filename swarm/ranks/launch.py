"""Where this process stands in its node: a pure decision over the flags and the environment.

    launch = plan_launch(nproc=2, env=os.environ, device="auto", cuda_count=0, batch_size=8)
    launch.rank, launch.world_size, launch.spawn, launch.backend, launch.device

Three ways to run a node (each tested by a table in tests/ranks/test_launch.py):
- one rank (the default): no process group at all, exactly the single-process node;
- `--nproc-per-node N`: this process is rank 0 and starts ranks 1..N-1 itself (spawn.py);
- under torchrun (RANK and WORLD_SIZE in the environment): torchrun started every rank, this is
  rank RANK. One swarm node is one machine: a torchrun over several machines is refused.

`--batch-size` stays the node's batch (a run setting every node shares, and what bounds a
node's weight): each of the N ranks trains batch/N of its rows, so it must divide.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LaunchError", "RankLaunch", "mixed_devices", "plan_launch"]

TORCHRUN_VARS = ("RANK", "WORLD_SIZE")


class LaunchError(ValueError):
    """The ranks cannot start as asked; the message is one line that says what to do."""


@dataclass(frozen=True, slots=True)
class RankLaunch:
    rank: int
    world_size: int
    local_rank: int
    spawn: int  # rank processes this one starts itself (N - 1 with --nproc-per-node, else 0)
    backend: str  # "nccl" on cuda, "gloo" on the CPU; "" with one rank (no process group)
    device: str  # this rank's torch device
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # torchrun's; None: rank 0 picks a free port (spawn)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def leader(self) -> bool:
        return self.rank == 0


def plan_launch(*, nproc: int, env: Mapping[str, str], device: str, cuda_count: int, batch_size: int) -> RankLaunch:
    """This process's place: from --nproc-per-node, torchrun's variables (if any), --device,
    the GPUs present and --batch-size. Raises LaunchError."""
    if nproc < 1:
        raise LaunchError(f"--nproc-per-node must be >= 1, got {nproc}")
    if all(name in env for name in TORCHRUN_VARS):
        rank, world, local, spawn = *_torchrun(env, nproc), 0
    else:
        rank, world, local, spawn = 0, nproc, 0, nproc - 1
    kind, index = _device_kind(device, cuda_count)
    if world == 1:
        return RankLaunch(rank=rank, world_size=1, local_rank=local, spawn=0, backend="", device=device)
    if index is not None:
        raise LaunchError(f"--device {device} names one device; with {world} ranks pass --device {kind} "
                          f"(rank k uses {kind}:k)")  # fmt: skip
    if kind == "cuda":
        if world > cuda_count:
            raise LaunchError(f"{world} ranks need {world} GPUs; this machine shows {cuda_count} "
                              f"(see CUDA_VISIBLE_DEVICES)")  # fmt: skip
        backend, rank_device = "nccl", f"cuda:{local}"
    elif kind == "cpu":
        backend, rank_device = "gloo", "cpu"
    else:
        raise LaunchError(f"--device {device}: a node of several ranks runs on cuda (NCCL) or cpu (gloo)")
    if batch_size % world:
        raise LaunchError(f"--batch-size {batch_size} does not split over {world} ranks: pass a multiple of "
                          f"{world} (it is the node's batch; each rank trains batch/{world} sequences)")  # fmt: skip
    port = int(env["MASTER_PORT"]) if spawn == 0 and "MASTER_PORT" in env else None
    addr = env.get("MASTER_ADDR", "127.0.0.1") if spawn == 0 else "127.0.0.1"
    return RankLaunch(rank=rank, world_size=world, local_rank=local, spawn=spawn, backend=backend,
                      device=rank_device, master_addr=addr, master_port=port)  # fmt: skip


def mixed_devices(kinds: list[str]) -> str | None:
    """One line when the ranks of a node run on different device types (each rank's kind, in
    rank order), else None: DDP needs one backend and one kind of device."""
    if len(set(kinds)) <= 1:
        return None
    shown = ", ".join(f"rank {r}: {k}" for r, k in enumerate(kinds))
    return f"the ranks of this node run on mixed device types ({shown}): give every rank the same kind"


def _torchrun(env: Mapping[str, str], nproc: int) -> tuple[int, int, int]:
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        raise LaunchError("torchrun's RANK, WORLD_SIZE, LOCAL_RANK must be integers") from None
    if not (world >= 1 and 0 <= rank < world and 0 <= local < world):
        raise LaunchError(f"torchrun's RANK {rank} does not fit WORLD_SIZE {world}")
    if local_world != world:
        raise LaunchError(f"torchrun spans {world // max(local_world, 1)} machines: one swarm node is one "
                          "machine (run torchrun --nnodes 1 on each; each machine joins the swarm)")  # fmt: skip
    if nproc not in (1, world):
        raise LaunchError(f"--nproc-per-node {nproc} under torchrun with WORLD_SIZE {world}: leave it out, "
                          "torchrun starts the ranks")  # fmt: skip
    return rank, world, local


def _device_kind(device: str, cuda_count: int) -> tuple[str, int | None]:
    """("cuda" | "cpu" | other, the index named or None); "auto": cuda where a GPU is present."""
    if device == "auto":
        return ("cuda" if cuda_count > 0 else "cpu"), None
    kind, _, index = device.partition(":")
    if index and not index.isdigit():
        raise LaunchError(f"--device {device}: not a torch device")
    return kind, int(index) if index else None
