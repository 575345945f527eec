"""swarm-node's flags for a node of several ranks: bad ones give one line, before any rank starts."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from swarm.cli.node import main

TORCHRUN_TWO_MACHINES = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # fmt: skip
GPUS = torch.cuda.device_count()


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--nproc-per-node", "0"], {}, "--nproc-per-node"),
        (["--nproc-per-node", "3"], {}, "--batch-size 8 does not split over 3 ranks"),
        (["--nproc-per-node", "2", "--device", "cuda:1"], {}, "--device cuda:1 names one device"),
        (
            ["--nproc-per-node", str(GPUS + 2), "--device", "cuda", "--batch-size", str(GPUS + 2)],
            {},
            f"{GPUS + 2} ranks need {GPUS + 2} GPUs; this machine shows {GPUS}",
        ),
        ([], TORCHRUN_TWO_MACHINES, "one swarm node is one machine"),
        (["--shard"], {}, "--shard shards the model over several ranks: add --nproc-per-node N"),
        (["--nproc-per-node", "2", "--fragments", "2"], {}, "--fragments is not yet supported with --nproc-per-node"),
        (["--nproc-per-node", "2", "--compile"], {}, "--compile is not yet supported with --nproc-per-node"),
    ],
)
def test_bad_rank_flags_give_one_line(args: list[str], env: dict[str, str], expected: str) -> None:
    result = CliRunner().invoke(main, [*args, "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], prog_name="swarm-node",
                                env=env)  # fmt: skip
    assert result.exit_code != 0 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and lines[0].startswith("swarm-node"), result.stderr
