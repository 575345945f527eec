"""Issue 6 through the CLI: newcomers fetch the swarm's state from several peers, survive dying
and lying donors, refuse foreign states, and restart from whole local checkpoints."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.node.conftest import FAST_SETTINGS, Swarm

pytestmark = pytest.mark.swarm
SHARDS = ("--shard-mb", "0.5")  # the tiny model's 10 MB state in about 21 shards: several donors


@pytest.mark.timeout(300)
@pytest.mark.xfail(
    strict=False,
    reason="known regression (README, known gaps): with steps of ~1 s, a newcomer can stay a step "
    "behind, fetching every step instead of averaging; it passes about half the time",
)
def test_a_newcomer_fetches_from_several_peers_and_then_agrees_with_them(swarm: Swarm) -> None:
    swarm.start_bootstrap()
    args = ("--run-id", "join", "--inner-steps", "8", "--matchmaking-time", "1.5", *SHARDS)
    old = ["a", "b", "c"]
    # the first nodes outlast the newcomer by two steps: a newcomer still a step behind when they
    # leave could fetch their last state from nobody
    procs = [swarm.node(name, *args, "--max-outer-steps", "14") for name in old]
    swarm.wait_for(lambda: len(swarm.events("a", "outer_step")) >= 2, 150, "two outer steps of the first nodes")
    newcomer = swarm.node("d", *args, "--max-outer-steps", "12")
    for name, proc in zip([*old, "d"], [*procs, newcomer], strict=True):
        assert proc.wait(200) == 0, swarm.stderr(name)
    fetch = swarm.events("d", "fetch")
    assert fetch and fetch[0]["peers"] >= 2 and fetch[0]["reason"] == "behind", fetch
    joined = swarm.events("d", "start")[0]["outer_step"]
    assert joined >= 2 and joined in [f["outer_step"] for f in fetch]  # it may fetch twice if peers move on meanwhile
    others = {e["outer_step"]: e["state_sha256"] for e in swarm.events("a", "outer_step")}
    mine = swarm.events("d", "outer_step")
    assert mine and mine[0]["outer_step"] in (joined, joined + 1)  # +1: it came as the group was forming
    for e in mine:  # bit-identical θ_outer from its first outer step on
        assert e["state_sha256"] == others[e["outer_step"]], (e["outer_step"], [x["group_size"] for x in mine])
    assert mine[0]["group_size"] == 4


def _seeders(swarm: Swarm, *extra: tuple[str, ...]) -> list[tuple[subprocess.Popen[str], dict]]:
    base = (
        "--run-id",
        "seeded",
        "--step",
        "5",
        "--shard-bytes",
        str(256 << 10),
        "--node-settings",
        "--inner-steps",
        "2",
        *FAST_SETTINGS,
    )  # the newcomers' settings (_newcomer)
    return [swarm.seeder(f"seeder{i}", *base, *more) for i, more in enumerate(extra)]


def _newcomer(swarm: Swarm, name: str = "new", *args: str) -> subprocess.Popen[str]:
    return swarm.node(name, "--run-id", "seeded", "--inner-steps", "2", "--max-outer-steps", "6",
                      "--matchmaking-time", "0.3", *args)  # fmt: skip


@pytest.mark.timeout(180)
def test_a_donor_killed_mid_fetch_does_not_stop_it(swarm: Swarm) -> None:
    swarm.start_bootstrap()
    seeders = _seeders(swarm, ("--upload-delay", "0.5"), (), ())
    slow, info = seeders[0]
    newcomer = _newcomer(swarm)
    swarm.wait_for(lambda: bool(swarm.events("new", "fetch_progress")) or newcomer.poll() is not None, 120, "a fetch")
    slow.kill()  # mid-fetch: its first shard takes seconds to arrive
    assert newcomer.wait(120) == 0, swarm.stderr("new")
    fetch = swarm.events("new", "fetch")[0]
    assert fetch["outer_step"] == 5 and fetch["state_sha256"] == info["state_sha256"]
    assert fetch["peers"] == 2  # the two live donors sent everything


@pytest.mark.timeout(180)
def test_a_corrupt_donor_is_detected_and_its_bytes_never_loaded(swarm: Swarm) -> None:
    swarm.start_bootstrap()
    seeders = _seeders(swarm, ("--corrupt",), (), ())
    bad_id, good = seeders[0][1]["peer_id"], seeders[1][1]
    assert seeders[0][1]["manifest"] == good["manifest"]  # it advertises the right state, sends wrong bytes
    newcomer = _newcomer(swarm)
    assert newcomer.wait(120) == 0, swarm.stderr("new")
    fetch = swarm.events("new", "fetch")[0]
    assert fetch["corrupt_peers"] == [bad_id]
    assert fetch["state_sha256"] == good["state_sha256"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("claim", "needle"), [(("--claim-run", "someone-else"), "run"), ((), "model")])
def test_a_state_of_another_run_or_model_is_refused_and_the_node_stays_up(swarm: Swarm, claim, needle: str) -> None:
    """Anyone can advertise a state under our run's key: one of another run or model is refused
    with a line that says why, and never stops the node (issue 12: no remote kill switch)."""
    swarm.start_bootstrap()
    _seeders(swarm, claim)
    model = ("--model", "small", "--seq-len", "64") if needle == "model" else ()
    newcomer = _newcomer(swarm, "new", *model)
    swarm.wait_for(lambda: "refusing state" in swarm.stderr("new") or newcomer.poll() is not None, 120, "a refusal")
    assert newcomer.poll() is None, swarm.stderr("new")
    refusal = next(line for line in swarm.stderr("new").splitlines() if "refusing state" in line)
    assert needle in refusal and "not adopted" in refusal, refusal
    assert not swarm.events("new", "fetch")
    newcomer.send_signal(signal.SIGINT)
    assert newcomer.wait(60) == 0, swarm.stderr("new")
    assert "Traceback" not in swarm.stderr("new")


@pytest.mark.timeout(300)
def test_sigkill_during_a_checkpoint_write_then_restart_from_a_whole_one(swarm: Swarm, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    identity = tmp_path / "node.key"
    # `small` (26M parameters, a 206 MB state): each write takes long enough to be caught in the middle
    args = ("--run-id", "crash", "--model", "small", "--seq-len", "16", "--eval-windows", "1", "--inner-steps", "1",
            "--matchmaking-time", "0.1", "--checkpoint-dir", str(ckpt), "--identity", str(identity))  # fmt: skip
    proc = swarm.node("first", *args)
    deadline = time.monotonic() + 200
    while not (ckpt.is_dir() and (ckpt / "LATEST").exists() and list(ckpt.glob("step-*.tmp-*"))):
        assert proc.poll() is None and time.monotonic() < deadline, swarm.stderr("first")
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)  # a second checkpoint is being written right now
    proc.wait(30)
    assert list(ckpt.glob("step-*.tmp-*")), "the kill should have left a partial write behind"
    whole = (ckpt / "LATEST").read_text().strip()
    restarted = swarm.node("second", *args, "--max-outer-steps", str(int(whole.split("-")[1]) + 1))
    assert restarted.wait(200) == 0, swarm.stderr("second")
    resume = swarm.events("second", "resume")
    assert resume and resume[0]["outer_step"] == int(whole.split("-")[1])
    assert f"resumed from the checkpoint of outer step {resume[0]['outer_step']}" in swarm.stderr("second")
    assert swarm.events("second", "outer_step")[0]["outer_step"] == resume[0]["outer_step"]
    assert not list(ckpt.glob("step-*.tmp-*"))  # the partial write was cleaned up
