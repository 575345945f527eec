"""An all-NAT swarm in the lab: `swarm-sim --nat cone:2,cone:2,symmetric:2` runs one public
bootstrap that relays and trains nothing, and six trainers in three home networks (two behind
cone NATs, two behind a symmetric one). Every trainer must be in every round, every round must
end in one state, and the loss must fall; the cone NATs' nodes say they are reached by punched
connections and own parts, the symmetric NAT's nodes say they are relayed and own none. Behind
three symmetric NATs nobody can punch: the relayed nodes own the parts, since nobody else can,
and the run averages through the relay (the forced-relay case).

Real processes in real namespaces (swarm-sim, swarm-dht serve, six swarm-node): the second tier
(`pytest -n 0 -m "swarm or not swarm" tests/netlab/test_nat_swarm.py`, as root). Whatever
happens, the simulator is stopped by its PID and every namespace it made is removed, with
whatever still runs in it; the test then checks that none is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from swarm.netlab.lab import namespaces, remove_leftovers
from swarm.netlab.plan import owner_pid
from swarm.utils import process_control
from swarm.utils.process_control import console_script
from tests.children import child_env
from tests.netlab.test_nat import nat_ready  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(420)]

OUTER_STEPS = 3
RUN_TIMEOUT_S = 300  # the simulator's own --timeout; a 2-core machine runs this in about a minute
GRACE_S = 30.0
WATCH_S = 0.2


def run_sim(run_dir: Path, homes: str, *extra: str, outer_steps: int = OUTER_STEPS,
            watch: Callable[[Path], None] | None = None) -> dict:  # fmt: skip
    """Run swarm-sim --nat (and `extra` flags) to its end; its metrics JSON. Stops it and removes
    its lab whatever happens. `watch(run_dir)` is called every WATCH_S while it runs."""
    # batches of 2 sequences, not swarm-sim's 8: what is tested is who reaches whom and what each
    # round holds, and training was most of the nodes' CPU (the loss still falls within 3 steps)
    argv = [console_script("swarm-sim"), "--nat", homes, "--outer-steps", str(outer_steps), "--inner-steps", "10",
            "--batch-size", "2", "--threads", "1", "--timeout", str(RUN_TIMEOUT_S), "--run-dir", str(run_dir), "-v",
            *extra]  # fmt: skip
    out = open(run_dir / "sim.out", "wb")  # noqa: SIM115 (closed below, after the child is gone)
    sim = process_control.start(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=child_env(OMP_NUM_THREADS="1"))  # fmt: skip
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S + 60
        while (code := sim.poll()) is None:
            assert time.monotonic() < deadline, "swarm-sim ran past its own --timeout"
            if watch is not None:
                watch(run_dir)
            time.sleep(WATCH_S)
    finally:
        process_control.stop_all([sim], GRACE_S, group=True)  # a simulator stopped early closes its lab
        out.close()
        remove_leftovers()  # a simulator that was killed left its namespaces (and its nodes in them)
        left = [ns for ns in namespaces() if owner_pid(ns) == sim.pid]
        assert not left, f"namespaces left behind: {left}"
    log = (run_dir / "sim.out").read_text(errors="replace")
    assert code == 0, f"swarm-sim exited with {code}:\n{log[-3000:]}"
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.mark.usefixtures("nat_ready")
@pytest.mark.parametrize(
    ("homes", "reaches"),
    [
        # nodes 0-3 sit behind the cone NATs, 4-5 behind the symmetric one (the order of --nat)
        ("cone:2,cone:2,symmetric:2", ["punched"] * 4 + ["relayed"] * 2),
        ("symmetric:2,symmetric:2,symmetric:2", ["relayed"] * 6),
    ],
    ids=["cone-cone-symmetric", "all-symmetric"],
)
def test_six_trainers_behind_three_nats_average_in_every_round_through_one_public_relay(
    tmp_path: Path, homes: str, reaches: list[str]
) -> None:
    # the debug model: who reaches whom and what each round holds do not depend on the model's size
    metrics = run_sim(tmp_path, homes, "--model", "debug")
    nodes = metrics["nodes"]
    assert len(nodes) == 6 and all(n["status"] == "done" for n in nodes), [n["status"] for n in nodes]
    assert [n["reach"] for n in nodes] == reaches
    for step in range(OUTER_STEPS):
        rows = [next(s for s in n["steps"] if s["outer_step"] == step) for n in nodes]
        assert [r["group_size"] for r in rows] == [6] * 6, f"outer step {step}: not every trainer averaged"
        assert len({r["group_id"] for r in rows}) == 1, f"outer step {step}: more than one group"
        assert len({r["state_sha256"] for r in rows}) == 1, f"outer step {step}: more than one state"
    first, last = (next(s for s in nodes[0]["steps"] if s["outer_step"] == k) for k in (0, OUTER_STEPS - 1))
    losses = [first["eval_loss"], last["eval_loss"]]
    assert losses[1] < losses[0], f"the eval loss did not fall: {losses}"


KILL_STEP = 1  # the relay dies while the round of this outer step runs
# what a member dying costs a round at most. Shorter than swarm-node's default of 60 s, which the
# killed round would wait out in full: the bound under test is the same at any part timeout, and
# 20 s still leaves a slow but live member on a loaded 2-core machine ample time for its part
PART_TIMEOUT_S = 20.0


class RelayKiller:
    """Kills the bootstrap, the run's first relay, once a node's round of KILL_STEP has begun
    (its `round` event): the relay dies while the round runs over it."""

    def __init__(self) -> None:
        self.killed_at: float | None = None

    def __call__(self, run_dir: Path) -> None:
        if self.killed_at is not None or not any(_round_began(p, KILL_STEP) for p in run_dir.glob("node*.jsonl")):
            return
        first = (run_dir / "bootstrap.out").read_text().splitlines()[0]
        os.kill(json.loads(first)["pid"], signal.SIGKILL)  # the swarm-dht serve swarm-sim started for us
        self.killed_at = time.monotonic()


def _round_began(events: Path, step: int) -> bool:
    for line in events.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line still being written
        if event.get("event") == "round" and event.get("outer_step") == step:
            return True
    return False


@pytest.mark.usefixtures("nat_ready")
def test_a_relay_that_dies_mid_round_costs_that_round_at_most_its_relayed_members(tmp_path: Path) -> None:
    """public:1,cone:2,symmetric:1: the bootstrap relays and holds the DHT with the public
    trainer, which relays too and lists itself in the DHT's relay records; every NATed node holds
    reservations on both. The bootstrap is SIGKILLed inside the round of outer step 1. What went
    through it then is the symmetric node's traffic to the cone owners (a relayed client): the
    round loses that member, as it would lose a member that died, within the part timeout, and
    nothing more: the three owners finish it and every later round with one state."""
    killer = RelayKiller()
    metrics = run_sim(tmp_path, "public:1,cone:2,symmetric:1", "--part-timeout", f"{PART_TIMEOUT_S:g}",
                      outer_steps=4, watch=killer)  # fmt: skip
    assert killer.killed_at is not None, "no round of outer step 1 was seen"
    nodes = metrics["nodes"]
    assert [n["reach"] for n in nodes] == ["direct", "punched", "punched", "relayed"]
    owners, client = nodes[:3], nodes[3]
    assert all(n["status"] == "done" for n in owners), [n["status"] for n in owners]
    assert client["status"] != "failed", client["status"]  # out of the round, as a member that died
    for step in range(4):
        rows = [next(s for s in n["steps"] if s["outer_step"] == step) for n in owners]
        assert len({r["state_sha256"] for r in rows}) == 1, f"outer step {step}: the owners disagree"
        assert min(r["group_size"] for r in rows) >= len(owners), f"outer step {step}: an owner was left out"
    events = [json.loads(line) for line in (tmp_path / "node0.jsonl").read_text().splitlines() if line.strip()]
    [round_s] = [e["round_s"] for e in events if e.get("event") == "outer_step" and e["outer_step"] == KILL_STEP]
    assert round_s <= PART_TIMEOUT_S + 15, f"the round the relay died in took {round_s:.0f}s"
