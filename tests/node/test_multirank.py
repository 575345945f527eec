"""Nodes of several ranks in real processes on 127.0.0.1: `swarm-node --nproc-per-node 2`
on the CPU with gloo. Each node starts its rank 1 itself; every process is stopped by PID at
the end (the Swarm fixture stops the nodes; a node stops its ranks, and they die with it)."""

from __future__ import annotations

import os
import re
import shutil
import signal
from collections import defaultdict
from pathlib import Path

import pytest

from swarm.cli.options import load_identity
from swarm.utils import process_control
from swarm.utils.process_control import console_script
from tests.children import exited
from tests.node.conftest import ENV, FAST, LOOPBACK, Swarm

pytestmark = pytest.mark.swarm

TWO_RANKS = ("--nproc-per-node", "2", "-vv")  # -vv: each rank logs the hash of its θ after each sync
THETA = re.compile(r"rank (\d+): θ sha256 ([0-9a-f]{64}) at outer step (\d+)")


def _thetas(swarm: Swarm, name: str) -> dict[int, dict[int, str]]:
    """{DiLoCo outer step: {rank: sha256 of its θ}} from the node's log (rank 1 writes to it too)."""
    found: dict[int, dict[int, str]] = defaultdict(dict)
    for rank, sha, step in THETA.findall(swarm.stderr(name)):
        found[int(step)][int(rank)] = sha
    return found


def _rank_pids(swarm: Swarm, name: str) -> list[int]:
    match = re.search(r"ranks 1\.\. run as pids \[([\d, ]+)\]", swarm.stderr(name))
    return [int(p) for p in match.group(1).split(",")] if match else []


@pytest.mark.timeout(240)
def test_two_nodes_of_two_ranks_train_together_and_every_rank_holds_theta_outer(swarm: Swarm) -> None:
    swarm.start_bootstrap()
    # three outer steps: every rank's θ after each, and the loss falls; a fourth trained 4 more
    # inner steps on 4 ranks and waited out one more matchmaking window, to show nothing new (the
    # test and every child: 17.9 CPU-s with four steps, 16.0 and 14.7 with three)
    args = ("--run-id", "ranks", "--inner-steps", "4", "--max-outer-steps", "3", "--matchmaking-time", "2",
            *TWO_RANKS)  # fmt: skip
    procs = {name: swarm.node(name, *args) for name in ("a", "b")}
    for name, proc in procs.items():
        assert swarm.exit_code(name, proc, 200) == 0, swarm.stderr(name)[-4000:]
    events = {name: {e["outer_step"]: e for e in swarm.events(name, "outer_step")} for name in procs}
    assert sorted(events["a"]) == sorted(events["b"]) == [0, 1, 2]
    for step in range(3):  # the nodes agree on the swarm's state
        assert events["a"][step]["state_sha256"] == events["b"][step]["state_sha256"], step
    assert events["a"][2]["group_size"] == 2
    assert events["a"][2]["eval_loss"] < events["a"][0]["eval_loss"]
    thetas = {name: _thetas(swarm, name) for name in procs}
    for step in range(1, 4):  # after outer step s-1 (event s-1) every rank of every node holds one θ
        held = {(name, rank): sha for name in procs for rank, sha in thetas[name][step].items()}
        assert len(held) == 4 and len(set(held.values())) == 1, f"outer step {step}: {held}"
    for name in procs:
        assert "rank 1: rank 0 says stop" in swarm.stderr(name)
        assert all(exited(pid) for pid in _rank_pids(swarm, name))


@pytest.mark.timeout(240)
def test_a_rank_killed_mid_step_ends_its_node_cleanly_and_the_other_node_carries_on(swarm: Swarm) -> None:
    swarm.start_bootstrap()
    args = ("--run-id", "rankdeath", "--inner-steps", "30", "--matchmaking-time", "2", "--part-timeout", "10")
    victim_node = swarm.node("a", *args, "--max-outer-steps", "50", *TWO_RANKS)
    other = swarm.node("b", *args, "--max-outer-steps", "50", "--leave-after-steps", "3")
    swarm.wait_for(lambda: len(swarm.events("a", "progress")) >= 1, 150, "node a to train")
    pids = _rank_pids(swarm, "a")
    assert len(pids) == 1, swarm.stderr("a")[-3000:]
    assert _is_follower_forked_beside(pids[0], victim_node.pid)  # node a's rank 1: the kill hits nobody else
    os.kill(pids[0], signal.SIGKILL)
    code = swarm.exit_code("a", victim_node, 90)
    err = swarm.stderr("a")
    assert code == 1, err[-3000:]
    assert f"swarm-node: error: rank 1 of this node (pid {pids[0]}) exited: killed by signal 9: this node leaves " \
           "the swarm" in err, err[-3000:]  # fmt: skip
    assert "Traceback" not in err
    assert swarm.events("a", "exit")  # it left the swarm as a node does
    assert swarm.exit_code("b", other, 200) == 0, swarm.stderr("b")[-3000:]
    assert [e["outer_step"] for e in swarm.events("b", "outer_step")] == [0, 1, 2]


@pytest.mark.timeout(240)
def test_two_ranks_match_one_rank_of_the_same_batch_and_a_restart_resumes(swarm: Swarm, tmp_path: Path) -> None:
    """The node's batch is split over the ranks: a 2-rank node (DDP, or FSDP2 with --shard) trains
    what a 1-rank node of the same PeerID and --batch-size does, to fp tolerance. Its checkpoint
    is written once (rank 0), and a restart resumes from it with both ranks."""
    common = ("--inner-steps", "4", "--matchmaking-time", "0.5", "--batch-size", "4")
    # one PeerID for all three (the same batches), each in a key file of its own: a running node
    # holds its key file locked, so that two nodes never share one by mistake
    load_identity(tmp_path / "key")
    for name in ("one", "two", "sharded"):
        shutil.copy2(tmp_path / "key", tmp_path / f"key-{name}")
    ckpt = tmp_path / "ckpt"
    one = swarm.node("one", "--run-id", "one", "--max-outer-steps", "2", "--identity", str(tmp_path / "key-one"),
                     *common)  # fmt: skip
    # run "two" has no end (a run setting its checkpoint keeps): its node leaves after 2 steps, and
    # comes back for a third
    two = swarm.node("two", "--run-id", "two", "--leave-after-steps", "2", "--checkpoint-dir", str(ckpt), "--identity",
                     str(tmp_path / "key-two"), *common, *TWO_RANKS)  # fmt: skip
    sharded = swarm.node("sharded", "--run-id", "sharded", "--max-outer-steps", "2", "--shard", "--identity",
                         str(tmp_path / "key-sharded"), *common, *TWO_RANKS)  # fmt: skip
    for name, proc in (("one", one), ("two", two), ("sharded", sharded)):
        assert swarm.exit_code(name, proc, 200) == 0, swarm.stderr(name)[-3000:]
    steps = {name: swarm.events(name, "outer_step") for name in ("one", "two", "sharded")}
    assert len(steps["one"]) == len(steps["two"]) == len(steps["sharded"]) == 2
    for a, b, c in zip(steps["one"], steps["two"], steps["sharded"], strict=True):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], abs=2e-3) == pytest.approx(c["eval_loss"], abs=2e-3)
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=2e-3)
        assert b["train_loss"] == pytest.approx(c["train_loss"], abs=2e-3)
    again = swarm.node("again", "--run-id", "two", "--leave-after-steps", "1", "--checkpoint-dir", str(ckpt),
                       "--identity", str(tmp_path / "key-two"), *common, *TWO_RANKS)  # fmt: skip
    assert swarm.exit_code("again", again, 200) == 0, swarm.stderr("again")[-3000:]
    assert swarm.events("again", "resume")[0]["outer_step"] == 2
    assert [e["outer_step"] for e in swarm.events("again", "outer_step")] == [2]
    # rank 1 starts from the resumed θ too: rank 0 broadcast it before the first inner step
    assert _thetas(swarm, "again")[2] == {0: _thetas(swarm, "two")[2][0], 1: _thetas(swarm, "two")[2][0]}


@pytest.mark.timeout(150)
def test_a_hung_rank_ends_its_node_after_the_rank_timeout(swarm: Swarm) -> None:
    proc = swarm.node("hung", "--run-id", "rankhang", "--inner-steps", "50", "--matchmaking-time", "0.5",
                      "--rank-timeout", "10", *TWO_RANKS)  # fmt: skip
    swarm.wait_for(lambda: len(swarm.events("hung", "progress")) >= 1, 90, "inner steps")
    pids = _rank_pids(swarm, "hung")
    assert len(pids) == 1 and _is_follower_forked_beside(pids[0], proc.pid)
    os.kill(pids[0], signal.SIGSTOP)  # alive, silent: only a timeout can tell
    try:
        assert swarm.exit_code("hung", proc, 90) == 1, swarm.stderr("hung")[-3000:]
    finally:
        if not exited(pids[0]):  # the node SIGKILLs it on its way out; never leave it stopped
            os.kill(pids[0], signal.SIGCONT)
    err = swarm.stderr("hung")
    assert "swarm-node: error: a rank of this node failed or timed out (" in err and "Traceback" not in err, err[-3000:]
    assert exited(pids[0])


@pytest.mark.timeout(120)
def test_sigterm_leaves_cleanly_and_every_rank_exits(swarm: Swarm) -> None:
    proc = swarm.node("solo", "--run-id", "rankterm", "--inner-steps", "50", "--matchmaking-time", "0.5", *TWO_RANKS)
    swarm.wait_for(lambda: len(swarm.events("solo", "progress")) >= 1, 90, "inner steps")
    pids = _rank_pids(swarm, "solo")
    proc.send_signal(signal.SIGTERM)
    assert swarm.exit_code("solo", proc, 60) == 0, swarm.stderr("solo")[-3000:]
    assert "rank 1: rank 0 says stop" in swarm.stderr("solo")
    assert pids and all(exited(pid) for pid in pids)


@pytest.mark.timeout(180)
def test_under_torchrun_every_rank_is_started_by_torchrun_and_the_node_trains(swarm: Swarm) -> None:
    out = open(swarm.workdir / "tr.out", "w")  # noqa: SIM115 (the child holds it)
    err = open(swarm.workdir / "tr.err", "w")  # noqa: SIM115
    command = [console_script("torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "swarm.cli.node",
               "--host-maddrs", LOOPBACK, *FAST, "--run-id", "torchrun", "--inner-steps", "2", "--max-outer-steps",
               "2", "--matchmaking-time", "0.5", "--metrics-file", str(swarm.metrics_path("tr")), "-vv"]  # fmt: skip
    proc = process_control.start(command, stdout=out, stderr=err, text=True, env=ENV)
    swarm.procs.append(proc)
    assert swarm.exit_code("tr", proc, 150) == 0, swarm.stderr("tr")[-3000:]
    assert [e["outer_step"] for e in swarm.events("tr", "outer_step")] == [0, 1]
    thetas = _thetas(swarm, "tr")
    assert all(len(thetas[step]) == 2 and len(set(thetas[step].values())) == 1 for step in (1, 2)), thetas
    assert "terminate called" not in swarm.stderr("tr")


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _is_follower_forked_beside(pid: int, node_pid: int) -> bool:
    """`pid` runs swarm.ranks.follower and was forked, at rank 0's request, by the preloaded
    server that forked rank 0 (it has not imported torch again), not exec'd by rank 0."""
    follower = b"swarm.ranks.follower" in Path(f"/proc/{pid}/cmdline").read_bytes()
    return follower and _parent(pid) == _parent(node_pid)
