"""Multi-process rounds with a member SIGKILLed while it reduces its part, and with a member that
sends garbage: the survivors finish with bit-identical results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from swarm.averaging.messages import GroupInfo, MemberInfo
from swarm.p2p import PeerID
from swarm.utils import process_control

ROOT = Path(__file__).resolve().parents[2]  # where `python -m tests.averaging.member` imports from
ANSWER_TIMEOUT_S = 90.0
pytestmark = pytest.mark.swarm


@pytest.fixture
def spawn() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        process_control.kill(proc)


def start_members(procs: list[subprocess.Popen[str]], faults: list[str]) -> list[dict[str, str]]:
    for fault in faults:
        env = {**os.environ, "SWARM_TEST_FAULT": fault, "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "tests.averaging.member"]
        procs.append(process_control.start(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                           env=env, cwd=ROOT, new_session=False))  # fmt: skip
    return [process_control.read_json_line(p, ANSWER_TIMEOUT_S, what=f"member {i}") for i, p in enumerate(procs)]


def run_round(procs: list[subprocess.Popen[str]], hello: list[dict[str, str]], elements: int) -> list[dict | None]:
    members = tuple(
        MemberInfo(PeerID(bytes.fromhex(h["peer_id"])), (h["maddr"],), 1.0 + i, 100.0, False)
        for i, h in enumerate(hello)
    )
    group = GroupInfo.create("run", 0, members)
    packed = msgpack.packb(group.encode(), use_bin_type=True).hex()
    for proc in procs:
        proc.stdin.write(json.dumps({"group": packed, "elements": elements, "seed": 1}) + "\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
    answers: list[dict | None] = []
    for i, proc in enumerate(procs):
        try:
            answers.append(process_control.read_json_line(proc, ANSWER_TIMEOUT_S, what=f"member {i}"))
        except process_control.ChildExited:  # it died in the round
            answers.append(None)
    for proc in procs:
        if proc.poll() is None:
            proc.stdin.write("\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
    return answers


def test_a_member_killed_while_reducing_its_part_is_replaced(spawn: list[subprocess.Popen[str]]) -> None:
    hello = start_members(spawn, ["", "die-in-reduce", "", ""])
    answers = run_round(spawn, hello, 100_000)
    assert answers[1] is None and spawn[1].wait(10) == -9
    survivors = [answers[i] for i in (0, 2, 3)]
    assert all(a is not None and "sha256" in a for a in survivors), survivors
    assert len({a["sha256"] for a in survivors}) == 1  # type: ignore[index]
    # the dead member's part was reduced again without its contribution
    contributions = survivors[0]["contributions"]  # type: ignore[index]
    assert contributions["1"] == [0, 2, 3]
    assert all(set(survivors[0]["contributions"][p]) <= {0, 1, 2, 3} for p in contributions)  # type: ignore[index]


def test_a_member_sending_garbage_is_left_out(spawn: list[subprocess.Popen[str]]) -> None:
    hello = start_members(spawn, ["", "", "garbage"])
    answers = run_round(spawn, hello, 50_000)
    honest = [answers[0], answers[1]]
    assert all(a is not None and "sha256" in a for a in honest), answers
    assert honest[0]["sha256"] == honest[1]["sha256"]  # type: ignore[index]
    for part, included in honest[0]["contributions"].items():  # type: ignore[index]
        assert 2 not in included, (part, included)  # its own part too: its garbage average was refused
