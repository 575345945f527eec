"""swarm.join: the caller's own (non-Llama) model and loop, nodes on 127.0.0.1 in one process
(each session runs its node on its own event loop thread; each caller loop runs in a thread)."""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import swarm
from swarm.api import SwarmError, SwarmSession
from swarm.dht import DHTNode
from swarm.model.diloco import NonFiniteLossError
from swarm.node.progress import ProgressBook
from swarm.p2p import P2PConfig

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
QUICK = {"matchmaking_time": 1.0, "publish_interval": 0.5, "max_wait": 10.0, "part_timeout": 10.0}
WEIGHTS = torch.linspace(-1.0, 1.0, 8)


async def run_records(run_id: str, initial_peers: list[str]) -> dict[str, Any]:
    """The run's progress records as a newcomer reads them right after joining the DHT: peer -> settings."""
    dht = await DHTNode(initial_peers=initial_peers, p2p_config=P2PConfig(host_maddrs=tuple(LOCAL))).start()
    try:
        book = ProgressBook(dht, run_id, publish_interval=1.0)
        await book.refresh()
        return {str(p.peer_id): p.settings for p in book.peers}
    finally:
        await dht.close()


def make_model(seed: int = 0, width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))


def batch(generator: torch.Generator, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(size, 8, generator=generator)
    return x, torch.tanh(0.3 * (x @ WEIGHTS)).unsqueeze(1)


HELD_OUT = batch(torch.Generator().manual_seed(999), 256)


def evaluate(model: nn.Module) -> float:
    with torch.no_grad():
        return nn.functional.mse_loss(model(HELD_OUT[0]), HELD_OUT[1]).item()


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


@pytest.fixture
def sessions() -> Iterator[list[SwarmSession]]:
    made: list[SwarmSession] = []
    yield made
    for session in made:
        session.close()


def train(session: SwarmSession, model: nn.Module, seed: int, result: dict[int, Any]) -> None:
    generator = torch.Generator().manual_seed(seed)
    try:
        while True:
            x, y = batch(generator)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if not session.step(loss):
                break
        result[seed] = (session.outer_step, session.state_sha256())
    except BaseException as e:  # the test thread reports it
        result[seed] = e


@pytest.mark.swarm
@pytest.mark.timeout(180)
def test_three_sessions_train_a_custom_model_agree_bit_for_bit_and_the_loss_falls(
    sessions: list[SwarmSession],
) -> None:
    events: list[dict[str, Any]] = []
    options = dict(run_id="api", inner_steps=10, tokens_per_step=32, host_maddrs=LOCAL, max_outer_steps=4,
                   evaluate=evaluate, on_event=events.append, **QUICK)  # fmt: skip
    models = [make_model() for _ in range(3)]
    first = swarm.join(models[0], adam, **options)
    sessions.append(first)
    joining: list[SwarmSession | BaseException] = [RuntimeError("not joined")] * 2

    def join(i: int) -> None:
        try:
            joining[i] = swarm.join(models[i + 1], adam, initial_peers=first.maddrs, **options)
        except BaseException as e:
            joining[i] = e

    threads = [threading.Thread(target=join, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    result: dict[int, Any] = {}
    trainers = [threading.Thread(target=train, args=(first, models[0], 0, result))]
    trainers[0].start()
    for t in threads:
        t.join(120)
    for i, s in enumerate(joining):
        assert isinstance(s, SwarmSession), s
        sessions.append(s)
        trainers.append(threading.Thread(target=train, args=(s, models[i + 1], i + 1, result)))
        trainers[-1].start()
    for t in trainers:
        t.join(150)
    assert all(not isinstance(r, BaseException) for r in result.values()), result
    assert {r[0] for r in result.values()} == {4} and len({r[1] for r in result.values()}) == 1, result
    # the parameters themselves, bit for bit
    pairs = [zip(models[0].parameters(), m.parameters(), strict=True) for m in models[1:]]
    assert all(torch.equal(a, b) for pair in pairs for a, b in pair)
    steps = [e for e in events if e["event"] == "outer_step"]
    assert max(e["group_size"] for e in steps) == 3  # they averaged, all three
    evals = [e["eval_loss"] for e in steps if e["peer_id"] == first.peer_id]
    # against the untrained model, not the first outer step: outer momentum makes the steps' losses
    # non-monotone (0.013, 0.023, 0.030, 0.017 in one loaded run whose first step trained longer)
    assert evals[-1] < 0.25 * evaluate(make_model()), evals


@pytest.mark.timeout(120)
def test_a_session_of_another_architecture_is_refused_naming_both(sessions: list[SwarmSession]) -> None:
    options = dict(run_id="arch", inner_steps=1000, host_maddrs=LOCAL, **QUICK)
    events: list[str] = []
    first = swarm.join(make_model(), adam, on_event=lambda e: events.append(e["event"]), **options)
    sessions.append(first)
    # the run's first session returns once it started, its record (and so its settings) in the
    # DHT: a process joining at once reads them. One that returned on listening had stored none
    # yet, and on a loaded machine a joiner of another model was let in.
    assert "start" in events, events
    assert first.peer_id in asyncio.run(run_records("arch", first.maddrs))
    with pytest.raises(SwarmError, match=r"architecture '[0-9a-f]+' \(this node: '[0-9a-f]+'\)"):
        swarm.join(make_model(width=16), adam, initial_peers=first.maddrs, **options)
    with pytest.raises(SwarmError, match=r"initial_state"):  # same shapes, other weights: seed your init
        swarm.join(make_model(seed=1), adam, initial_peers=first.maddrs, **options)


def test_options_are_checked_before_anything_starts() -> None:
    with pytest.raises(ValueError, match=r"unknown option\(s\) lr: choose from .*outer_lr"):
        swarm.join(make_model(), adam, lr=0.1)
    with pytest.raises(ValueError, match="inner_steps must be >= 1"):
        swarm.join(make_model(), adam, inner_steps=0)
    with pytest.raises(TypeError, match=r"must return a torch\.optim\.Optimizer"):
        swarm.join(make_model(), lambda params: None, host_maddrs=LOCAL)  # type: ignore[arg-type,return-value]


@pytest.mark.timeout(120)
def test_the_run_ends_step_says_so_and_a_nan_step_changes_nothing(sessions: list[SwarmSession]) -> None:
    model = make_model()
    session = swarm.join(model, adam, run_id="alone", inner_steps=3, host_maddrs=LOCAL, max_outer_steps=2, **QUICK)
    sessions.append(session)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.full((2, 8), math.nan)).sum()
    loss.backward()
    with pytest.raises(NonFiniteLossError):
        session.step(loss)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)) and session.inner_step == 0
    generator = torch.Generator().manual_seed(0)
    steps = 0
    while True:  # alone: it applies its own pseudo-gradient every 3 steps, and ends after 2 outer steps
        x, y = batch(generator)
        nn.functional.mse_loss(model(x), y).backward()
        steps += 1
        if not session.step():
            break
    assert steps == 6 and session.outer_step == 2 and session.reason == "finished"
    assert session.step() is False  # over: it stays over
    session.close()
    assert session.step() is False


@pytest.mark.swarm
@pytest.mark.timeout(150)
def test_closing_mid_step_returns_promptly_though_the_group_is_forming(sessions: list[SwarmSession]) -> None:
    """The caller stops stepping and closes while its group forms: the node averages what it
    trained and ends; close does not wait for inner steps that will never come."""
    options = dict(run_id="closing", inner_steps=20, tokens_per_step=32, host_maddrs=LOCAL, max_outer_steps=6, **QUICK)
    models = [make_model(), make_model()]
    first = swarm.join(models[0], adam, **options)
    second = swarm.join(models[1], adam, initial_peers=first.maddrs, **options)
    sessions.extend([first, second])
    result: dict[int, Any] = {}
    steady = threading.Thread(target=train, args=(first, models[0], 0, result))
    steady.start()
    generator = torch.Generator().manual_seed(1)
    while second.outer_step < 2 or second.inner_step < 19:  # into step 2, the group forming
        x, y = batch(generator)
        nn.functional.mse_loss(models[1](x), y).backward()
        assert second.step()
    began = time.monotonic()
    second.close()
    assert time.monotonic() - began < 20 and second.reason == "stopped"
    steady.join(120)
    assert not isinstance(result.get(0), BaseException) and result[0][0] == 6  # the other trained on


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_join_returns_listening_before_any_wait_and_wait_for_peers_is_the_barrier(
    sessions: list[SwarmSession],
) -> None:
    """start_with=2 once blocked inside join, so the first process never printed its address."""
    options = dict(run_id="barrier", inner_steps=5, host_maddrs=LOCAL, start_with=2, **QUICK)
    began = time.monotonic()
    first = swarm.join(make_model(), adam, **options)
    sessions.append(first)
    assert first.maddrs and first.maddrs[0].startswith("/ip4/127.0.0.1/tcp/") and time.monotonic() - began < 30
    with pytest.raises(SwarmError, match=r"wait_for_peers\(2, timeout=1\): 1 process\(es\) of run 'barrier' live"):
        first.wait_for_peers(2, timeout=1)
    second = swarm.join(make_model(), adam, initial_peers=first.maddrs, **options)
    sessions.append(second)
    counted: dict[str, int] = {}
    waiting = threading.Thread(target=lambda: counted.update(first=first.wait_for_peers(2, timeout=60)))
    waiting.start()
    assert second.wait_for_peers(2, timeout=60) == 2
    waiting.join(70)
    assert counted == {"first": 2}


@pytest.mark.timeout(60)
def test_a_taken_port_is_one_line_naming_the_python_argument(sessions: list[SwarmSession]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SwarmError) as refused:
            swarm.join(make_model(), adam, run_id="taken", host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"], **QUICK)
    message = str(refused.value)
    assert f"port {port} of 127.0.0.1 is in use" in message and "host_maddrs=" in message, message
    assert "--" not in message and "\n" not in message, message
    assert refused.value.__cause__ is None and refused.value.__suppress_context__  # no chained traceback wall
    with pytest.raises(ValueError, match=r"initial_peers= takes a list of multiaddrs, not one string"):
        swarm.join(make_model(), adam, initial_peers="/ip4/127.0.0.1/tcp/1/p2p/x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^host_maddrs=: "):
        swarm.join(make_model(), adam, host_maddrs=["/ip4/999.0.0.1/tcp/0"])
