"""State exchange through the CLI: newcomers fetch the swarm's state from several peers and agree with
them, and a node killed mid-checkpoint restarts from a whole one. Dying, lying and foreign
donors are tests/state/test_seeded.py (in one event loop)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.node.conftest import Swarm

pytestmark = pytest.mark.swarm
SHARDS = ("--shard-mb", "0.05")  # the debug model's 1 MB state in about 20 shards: several donors


@pytest.mark.timeout(300)
def test_a_newcomer_fetches_from_several_peers_and_then_agrees_with_them(swarm: Swarm) -> None:
    swarm.start_bootstrap()
    args = ("--run-id", "join", "--inner-steps", "8", "--matchmaking-time", "1.5", *SHARDS)
    old = ["a", "b", "c"]
    # the run ends at 10; the newcomer (joining at 2 or later: at 3, then 4 after a second fetch,
    # in a quiet run) leaves 4 steps after it joined, well before the others: a newcomer still a
    # step behind when they leave could fetch their last state from nobody. Its steps with the
    # others show it agrees as well as more of them would
    procs = [swarm.node(name, *args, "--max-outer-steps", "10") for name in old]
    swarm.wait_for(lambda: len(swarm.events("a", "outer_step")) >= 2, 150, "two outer steps of the first nodes")
    newcomer = swarm.node("d", *args, "--max-outer-steps", "10", "--leave-after-steps", "4")
    for name, proc in zip([*old, "d"], [*procs, newcomer], strict=True):
        assert proc.wait(200) == 0, swarm.stderr(name)
    fetch = swarm.events("d", "fetch")
    assert fetch and fetch[0]["peers"] >= 2 and fetch[0]["reason"] == "behind", fetch
    joined = swarm.events("d", "start")[0]["outer_step"]
    assert joined >= 2 and joined in [f["outer_step"] for f in fetch]  # it may fetch twice if peers move on meanwhile
    others = {e["outer_step"]: e["state_sha256"] for e in swarm.events("a", "outer_step")}
    mine = swarm.events("d", "outer_step")
    story = [(e["event"], e["outer_step"], e.get("group_size", e.get("reason"))) for e in swarm.events("d")
             if e["event"] in ("start", "outer_step", "fetch")]  # fmt: skip
    # +1: it came as the group was forming; +2: on steps of about a second the swarm can also take
    # a step while it catches up by an update, and its join with no inner steps then comes a moment
    # after that step's group formed (it fetches once more, then averages: seen 1 run in 3)
    assert mine and joined <= mine[0]["outer_step"] <= joined + 2, (story, swarm.stderr("d")[-4000:])
    for e in mine:  # bit-identical θ_outer from its first outer step on
        assert e["state_sha256"] == others[e["outer_step"]], (e["outer_step"], [x["group_size"] for x in mine])
    assert mine[0]["group_size"] == 4


@pytest.mark.timeout(300)
def test_sigkill_during_a_checkpoint_write_then_restart_from_a_whole_one(swarm: Swarm, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    # `small` (26M parameters, a 206 MB state): each write takes long enough to be caught in the middle;
    # no --identity: a node with a checkpoint directory keeps its key there, and its PeerID across restarts
    args = ("--run-id", "crash", "--model", "small", "--seq-len", "16", "--eval-windows", "1", "--inner-steps", "1",
            "--matchmaking-time", "0.1", "--checkpoint-dir", str(ckpt))  # fmt: skip
    proc = swarm.node("first", *args)
    deadline = time.monotonic() + 200
    while not (ckpt.is_dir() and (ckpt / "LATEST").exists() and list(ckpt.glob("step-*.tmp-*"))):
        assert proc.poll() is None and time.monotonic() < deadline, swarm.stderr("first")
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)  # a second checkpoint is being written right now
    proc.wait(30)
    assert list(ckpt.glob("step-*.tmp-*")), "the kill should have left a partial write behind"
    whole = (ckpt / "LATEST").read_text().strip()
    # one more step, then leave: the run itself has no end (a run setting its checkpoint keeps)
    restarted = swarm.node("second", *args, "--leave-after-steps", "1")
    assert restarted.wait(200) == 0, swarm.stderr("second")
    resume = swarm.events("second", "resume")
    assert resume and resume[0]["outer_step"] == int(whole.split("-")[1])
    assert f"resumed from the checkpoint of outer step {resume[0]['outer_step']}" in swarm.stderr("second")
    assert swarm.events("second", "outer_step")[0]["outer_step"] == resume[0]["outer_step"]
    assert not list(ckpt.glob("step-*.tmp-*"))  # the partial write was cleaned up
    assert (ckpt / "node.key").exists() and resume[0]["peer_id"] == swarm.events("first", "outer_step")[0]["peer_id"]
