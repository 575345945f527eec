"""The launch decision, the command protocol and the batch split: pure, each a table of cases."""

from __future__ import annotations

from typing import Any

import pytest

from swarm.ranks.commands import Command, CommandError, Op, decode, encode
from swarm.ranks.group import describe
from swarm.ranks.launch import LaunchError, RankLaunch, mixed_devices, plan_launch
from swarm.ranks.step import rank_rows

TORCHRUN2 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
             "MASTER_PORT": "29500"}  # fmt: skip


def launch(nproc: int = 1, env: dict[str, str] | None = None, device: str = "auto", cuda: int = 0,
           batch: int = 8) -> RankLaunch:  # fmt: skip
    return plan_launch(nproc=nproc, env=env or {}, device=device, cuda_count=cuda, batch_size=batch)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # one rank: no process group, the device as given
        ({}, dict(rank=0, world_size=1, spawn=0, backend="", device="auto")),
        ({"device": "cuda:1", "cuda": 2}, dict(world_size=1, device="cuda:1")),
        # --nproc-per-node: rank 0 starts the others
        ({"nproc": 2}, dict(rank=0, world_size=2, spawn=1, backend="gloo", device="cpu", master_port=None)),
        ({"nproc": 2, "device": "cpu", "cuda": 8}, dict(backend="gloo", device="cpu")),
        ({"nproc": 4, "cuda": 8}, dict(world_size=4, spawn=3, backend="nccl", device="cuda:0")),
        ({"nproc": 2, "device": "cuda", "cuda": 2}, dict(backend="nccl", device="cuda:0")),
        # torchrun: this is RANK; torchrun's rendezvous address
        (
            {"env": TORCHRUN2},
            dict(rank=1, world_size=2, spawn=0, backend="gloo", master_addr="10.0.0.1", master_port=29500),
        ),
        ({"env": TORCHRUN2, "cuda": 2}, dict(rank=1, backend="nccl", device="cuda:1")),
        ({"env": TORCHRUN2, "nproc": 2}, dict(rank=1, world_size=2)),
        (
            {"env": {**TORCHRUN2, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}},
            dict(world_size=1, backend=""),
        ),
    ],
)
def test_plan_launch(kwargs: dict[str, Any], expected: dict[str, Any]) -> None:
    got = launch(**kwargs)
    assert {k: getattr(got, k) for k in expected} == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nproc": 0}, "--nproc-per-node must be >= 1, got 0"),
        ({"nproc": 4, "cuda": 2}, "4 ranks need 4 GPUs; this machine shows 2"),
        ({"nproc": 2, "device": "cuda"}, "2 ranks need 2 GPUs; this machine shows 0"),
        (
            {"nproc": 2, "device": "cuda:1", "cuda": 2},
            "--device cuda:1 names one device; with 2 ranks pass --device cuda",
        ),
        ({"nproc": 2, "device": "mps"}, "runs on cuda (NCCL) or cpu (gloo)"),
        ({"nproc": 3, "batch": 8}, "--batch-size 8 does not split over 3 ranks"),
        ({"env": TORCHRUN2, "nproc": 4}, "--nproc-per-node 4 under torchrun with WORLD_SIZE 2: leave it out"),
        ({"env": {**TORCHRUN2, "WORLD_SIZE": "4"}}, "torchrun spans 2 machines: one swarm node is one machine"),
        ({"env": {**TORCHRUN2, "RANK": "x"}}, "must be integers"),
        ({"env": {**TORCHRUN2, "RANK": "2"}}, "RANK 2 does not fit WORLD_SIZE 2"),
    ],
)
def test_plan_launch_refuses_with_one_line(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(LaunchError) as e:
        launch(**kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("kinds", "problem"),
    [
        (["cpu"], None),
        (["cuda", "cuda", "cuda"], None),
        (["cuda", "cpu"], "mixed device types (rank 0: cuda, rank 1: cpu)"),
        (["cpu", "cpu", "other"], "rank 2: other"),
    ],
)
def test_mixed_devices(kinds: list[str], problem: str | None) -> None:
    got = mixed_devices(kinds)
    assert got is None if problem is None else (got is not None and problem in got)


@pytest.mark.parametrize(
    "command",
    [Command(Op.STEP, 3, 7), Command(Op.SYNC, 12, 0), Command(Op.PING), Command(Op.STOP), Command(Op.STEP, 2**40, 0)],
)
def test_commands_round_trip(command: Command) -> None:
    assert decode(encode(command)) == command


@pytest.mark.parametrize(
    ("words", "message"),
    [
        ([1, 1, 0], "4 words, got 3"),
        ([2, 1, 0, 0], "command version 2"),
        ([1, 9, 0, 0], "unknown command op 9"),
        ([1, 1, -1, 0], "negative step"),
    ],
)
def test_bad_commands_are_refused(words: list[int], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        decode(words)


@pytest.mark.parametrize(
    ("batch", "world", "rank", "rows"),
    [(8, 1, 0, slice(0, 8)), (8, 2, 0, slice(0, 4)), (8, 2, 1, slice(4, 8)), (6, 3, 2, slice(4, 6))],
)
def test_rank_rows_split_the_node_batch(batch: int, world: int, rank: int, rows: slice) -> None:
    assert rank_rows(batch, world, rank) == rows


@pytest.mark.parametrize(("batch", "world", "rank"), [(8, 3, 0), (8, 2, 2), (8, 0, 0)])
def test_rank_rows_refuse_what_does_not_split(batch: int, world: int, rank: int) -> None:
    with pytest.raises(ValueError):
        rank_rows(batch, world, rank)


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (
            RuntimeError("[/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv"),
            "RuntimeError: Timed out waiting 10000ms for recv",
        ),
        (RuntimeError("Connection closed by peer\nmore"), "RuntimeError: Connection closed by peer"),
        (ValueError(""), "ValueError: "),
    ],
)
def test_describe_keeps_one_short_line(error: BaseException, line: str) -> None:
    assert describe(error) == line
