"""A rank 0 made by hand, for tests/ranks/test_group.py: run as `python -m tests.ranks.fake_leader MODE`.

It makes the TCPStore on a free port of 127.0.0.1 and prints {"port": P}, then:
  mixed  joins as a CPU rank; a rank on another kind of device must make both refuse (exit 3)
  vanish says hello to a real follower, wraps the model, sends one PING and dies without a word
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch.distributed as dist

from swarm.model.data import load_data
from swarm.model.llama import build_model
from swarm.model.presets import preset
from swarm.node.config import NodeConfig
from swarm.ranks.commands import Command, Op
from swarm.ranks.follower import hello_settings
from swarm.ranks.group import RankGroup
from swarm.ranks.launch import LaunchError, RankLaunch

TIMEOUT = 30.0


def main(mode: str) -> int:
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=datetime.timedelta(seconds=TIMEOUT),
                          wait_for_workers=False)  # fmt: skip
    print(json.dumps({"port": store.port}), flush=True)
    launch = RankLaunch(rank=0, world_size=2, local_rank=0, spawn=1, backend="gloo", device="cpu")
    group = RankGroup.open(launch, timeout=TIMEOUT, store=store)
    config = NodeConfig(model="tiny", batch_size=2, seq_len=64)
    try:
        group.hello(hello_settings(config, b"\x00\x24" + b"p" * 36, threads=1, verbose=1))
    except LaunchError as e:
        print(f"rank 0: {e}", file=sys.stderr, flush=True)
        group.close()
        return 3
    data = load_data("stdlib")
    group.wrap(build_model(preset("tiny", vocab_size=data.vocab_size), config.seed))
    group.send(Command(Op.PING))
    os._exit(0)  # no STOP, no goodbye: as if killed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
