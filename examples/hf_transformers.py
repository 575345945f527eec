"""Train a Hugging Face `transformers` model in the swarm: a small GPT-2 built from a config (no
download), on the built-in corpus (the Python standard library's source, as bytes), 3 local processes.

    pip install -e ".[hf]"                             # transformers, beside torch==2.13.0
    python examples/hf_transformers.py                 # 3 processes on 127.0.0.1; checks they agree

Any `transformers` model is an nn.Module: `swarm.join` takes it as it is.
"""

from __future__ import annotations

import argparse

import torch
from launch import example_main, listening, print_end, print_step
from torch import nn

import swarm
from swarm.model.data import eval_windows, sample_batch, stdlib_corpus

SEQ_LEN, BATCH = 64, 8


def worker(args: argparse.Namespace) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    corpus = stdlib_corpus(4_000_000)
    torch.manual_seed(0)  # every process starts from the same weights
    config = GPT2Config(vocab_size=256, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    model = GPT2LMHeadModel(config)
    held_out = eval_windows(corpus.eval, SEQ_LEN - 1, 16)
    data = torch.Generator().manual_seed(torch.seed())  # each process its own windows

    def evaluate(m: nn.Module) -> float:
        with torch.no_grad():
            return m(input_ids=held_out, labels=held_out).loss.item()

    with swarm.join(model, lambda params: torch.optim.AdamW(params, lr=2e-3), run_id="hf-gpt2",
                    initial_peers=args.initial_peers, inner_steps=args.inner_steps, tokens_per_step=BATCH * SEQ_LEN,
                    host_maddrs=["/ip4/127.0.0.1/tcp/0"], max_outer_steps=args.outer_steps,
                    evaluate=evaluate, on_event=print_step, matchmaking_time=1.0) as session:  # fmt: skip
        listening(session, args)
        while True:
            inputs, targets = sample_batch(corpus.train, BATCH, SEQ_LEN - 1, data)
            window = torch.cat([inputs, targets[:, -1:]], dim=1)  # the whole window: the model shifts the labels
            loss = model(input_ids=window, labels=window).loss
            loss.backward()
            if not session.step(loss):
                break
    print_end(session)


if __name__ == "__main__":
    example_main(__doc__, __file__, worker, outer_steps=5)
