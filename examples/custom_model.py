"""Train your own model in the swarm: a small MLP on synthetic regression data, 3 local processes.

    python examples/custom_model.py                   # 3 processes on 127.0.0.1; checks they agree
    python examples/custom_model.py --worker --initial-peers /ip4/.../p2p/...   # one more process

The part that is the swarm is `worker` (a dozen lines): build the model (the same seed on every
process), `swarm.join` it with an optimizer factory, and call `session.step()` after each backward.
"""

from __future__ import annotations

import argparse

import torch
from launch import example_main, listening, print_end, print_step
from torch import nn

import swarm

TRUE_WEIGHTS = torch.linspace(-1.0, 1.0, 16)


def batch(generator: torch.Generator, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(size, 16, generator=generator)
    return x, torch.tanh(0.25 * (x @ TRUE_WEIGHTS)).unsqueeze(1)


def worker(args: argparse.Namespace) -> None:
    torch.manual_seed(0)  # every process starts from the same weights
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    held_out = batch(torch.Generator().manual_seed(12345), 512)
    data = torch.Generator().manual_seed(torch.seed())  # each process its own samples

    def evaluate(m: nn.Module) -> float:
        with torch.no_grad():
            return nn.functional.mse_loss(m(held_out[0]), held_out[1]).item()

    with swarm.join(model, lambda params: torch.optim.AdamW(params, lr=3e-3), run_id="custom-mlp",
                    initial_peers=args.initial_peers, inner_steps=args.inner_steps, tokens_per_step=64,
                    host_maddrs=["/ip4/127.0.0.1/tcp/0"], max_outer_steps=args.outer_steps,
                    evaluate=evaluate, on_event=print_step, matchmaking_time=1.0) as session:  # fmt: skip
        listening(session, args)
        while True:
            x, y = batch(data)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if not session.step(loss):
                break
    print_end(session)


if __name__ == "__main__":
    example_main(__doc__, __file__, worker, outer_steps=6)
