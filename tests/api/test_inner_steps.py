"""InnerSteps (the permits between a node and its caller's loop) and DiLoCo with a caller's optimizer."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch
from torch import nn

from swarm.model.diloco import DiLoCo, DiLoCoConfig
from swarm.node.inner_steps import InnerSteps, SessionClosed


def wrapped(inner_steps: int = 3) -> DiLoCo:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return DiLoCo(model, DiLoCoConfig(inner_steps=inner_steps), inner_optimizer=lambda p: torch.optim.SGD(p, lr=0.5))


def backward(diloco: DiLoCo) -> torch.Tensor:
    loss = diloco.model(torch.ones(2, 4)).pow(2).mean()
    loss.backward()
    return loss


def test_a_callers_optimizer_keeps_its_rate_and_its_steps_count_tokens() -> None:
    diloco = wrapped()
    stats = diloco.step_after_backward(7, loss=backward(diloco))
    assert stats.lr == 0.5 and diloco.inner_optimizer.param_groups[0]["lr"] == 0.5  # no schedule of ours
    assert diloco.inner_done == 1 and diloco.tokens_since_outer == 7 and stats.loss > 0
    assert all(p.grad is None for p in diloco.params)  # zero_grad done
    assert diloco.pseudo_gradients()[0].abs().sum() > 0


async def test_the_caller_steps_only_with_a_permit_and_the_node_waits_for_its_steps() -> None:
    diloco = wrapped()
    steps = InnerSteps(diloco)
    with pytest.raises(RuntimeError, match="no inner step is open"):
        steps.step(1)
    with pytest.raises(TimeoutError):
        steps.wait_for_permit(0.05)
    spent: list[int] = []

    def caller() -> None:
        while steps.wait_for_permit(5.0):
            backward(diloco)
            steps.step(4)
            spent.append(diloco.inner_done)
            if diloco.inner_done == 3:
                return

    thread = threading.Thread(target=caller)
    thread.start()
    await asyncio.wait_for(steps.train(2), 5.0)  # returns once the caller spent both permits
    assert diloco.inner_done == 2 and steps.snapshot().inner_done == 2 and steps.snapshot().target == 2
    await asyncio.sleep(0.1)
    assert diloco.inner_done == 2  # no third step without a permit
    await asyncio.wait_for(steps.train(3), 5.0)
    thread.join(5.0)
    assert spent == [1, 2, 3] and len(steps.snapshot().losses) == 3 and steps.snapshot().sec_per_step > 0
    steps.close()


async def test_closing_releases_the_caller_and_the_node() -> None:
    diloco = wrapped()
    steps = InnerSteps(diloco)
    waiting = asyncio.ensure_future(steps.train(3))
    await asyncio.sleep(0.05)
    assert steps.wait_for_permit(1.0) is True
    steps.close()
    await asyncio.wait_for(waiting, 5.0)  # the node is not left waiting for steps that never come
    assert steps.wait_for_permit(1.0) is False
    backward(diloco)
    with pytest.raises(SessionClosed):
        steps.step(1)
    assert await asyncio.wait_for(steps.train(3), 1.0) is None and diloco.inner_done == 0


async def test_swarm_nodes_own_loop_steps_with_permits_and_a_divergence_fails_the_node() -> None:
    from swarm.model.data import stdlib_corpus
    from swarm.node.errors import NodeError
    from swarm.node.training_thread import DataTrainingThread
    from swarm.p2p.identity import Identity

    data = stdlib_corpus(100_000)
    torch.manual_seed(0)
    nan_after = {"steps": 2}

    def loss_fn(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = model(inputs).float().pow(2).mean()
        nan_after["steps"] -= 1
        return loss if nan_after["steps"] >= 0 else loss * math.nan

    diloco = DiLoCo(nn.Embedding(256, 4), DiLoCoConfig(inner_steps=5), loss_fn=loss_fn)
    steps = InnerSteps(diloco)
    loop = DataTrainingThread(steps, data, Identity.generate().peer_id, batch_size=2, seq_len=8)
    loop.start()
    await asyncio.wait_for(steps.train(2), 10.0)  # two good steps, then it waits for a permit
    assert diloco.inner_done == 2 and steps.snapshot().inner_done == 2
    with pytest.raises(NodeError, match=r"training diverged \(loss nan.*lower --lr or --outer-lr"):
        await asyncio.wait_for(steps.train(5), 10.0)
    assert diloco.inner_done == 2  # the bad step changed nothing
    steps.close()
    await asyncio.to_thread(loop.join, 10.0)


async def test_the_nodes_work_on_the_model_waits_for_the_callers_step_and_holds_the_next() -> None:
    """call() runs between inner steps: never while the caller holds a permit, and the caller
    gets none while the node's work runs (an overlapped node lands a round so)."""
    diloco = wrapped(inner_steps=50)
    steps = InnerSteps(diloco)
    in_step, release = threading.Event(), threading.Event()
    log: list[str] = []

    def caller() -> None:
        while steps.wait_for_permit(5.0):
            log.append("step begins")
            in_step.set()
            release.wait(5.0)
            backward(diloco)
            log.append("step ends")
            steps.step(1)

    thread = threading.Thread(target=caller)
    thread.start()
    training = asyncio.ensure_future(steps.train(4))
    assert await asyncio.to_thread(in_step.wait, 5.0)

    def node_work() -> int:
        log.append("node")
        threading.Event().wait(0.2)  # the caller must not begin another step meanwhile
        log.append("node done")
        release.clear()  # the caller's next step (if it begins before the revoke) waits for us
        return diloco.inner_done

    work = asyncio.ensure_future(steps.call(node_work))
    await asyncio.sleep(0.2)
    assert not work.done() and "node" not in log  # the caller's step is under way
    release.set()
    assert await asyncio.wait_for(work, 5.0) == 1
    assert log[:4] == ["step begins", "step ends", "node", "node done"]
    revoking = asyncio.ensure_future(steps.revoke())  # the permits left are taken back: train returns
    await asyncio.sleep(0.1)
    release.set()
    await asyncio.wait_for(revoking, 5.0)
    await asyncio.wait_for(training, 5.0)
    assert diloco.inner_done <= 2  # of 4 permits: at most the step under way when the revoke came
    steps.finish()
    thread.join(5.0)
    steps.close()


async def test_a_caller_that_left_holding_a_permit_does_not_hang_the_node_once_the_session_ends() -> None:
    """A caller's loop that raised between wait_for_permit and step (its own bug) leaves a permit
    held: the node's work waits for it while the session runs, and runs once it has ended."""
    diloco = wrapped()
    steps = InnerSteps(diloco)
    training = asyncio.ensure_future(steps.train(2))
    assert await asyncio.to_thread(steps.wait_for_permit, 5.0)  # and then never steps
    work = asyncio.ensure_future(steps.call(lambda: "ran"))
    await asyncio.sleep(0.1)
    assert not work.done()
    steps.finish()
    assert await asyncio.wait_for(work, 5.0) == "ran"
    await asyncio.wait_for(training, 5.0)
    steps.close()
