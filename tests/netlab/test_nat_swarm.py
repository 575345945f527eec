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
import subprocess
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


def run_sim(run_dir: Path, homes: str) -> dict:
    """Run swarm-sim --nat to its end; its metrics JSON. Stops it and removes its lab whatever happens."""
    argv = [console_script("swarm-sim"), "--nat", homes, "--outer-steps", str(OUTER_STEPS), "--inner-steps", "10",
            "--threads", "1", "--timeout", str(RUN_TIMEOUT_S), "--run-dir", str(run_dir), "-v"]  # fmt: skip
    out = open(run_dir / "sim.out", "wb")  # noqa: SIM115 (closed below, after the child is gone)
    sim = process_control.start(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=child_env(OMP_NUM_THREADS="1"))  # fmt: skip
    try:
        code = sim.wait(RUN_TIMEOUT_S + 60)
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
    metrics = run_sim(tmp_path, homes)
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
