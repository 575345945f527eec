"""swarm-node's flags that only make sense together: one line that says why, no traceback."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from swarm.cli.node import main
from swarm.node.config import NodeConfig


def test_overlap_matchmaking_without_overlap_is_refused_in_one_line() -> None:
    result = CliRunner().invoke(main, ["--overlap-matchmaking", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
                                prog_name="swarm-node")  # fmt: skip
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "overlap_matchmaking" in lines[0] and "eager or delayed" in lines[0], result.stderr


@pytest.mark.parametrize("mode", ["eager", "delayed"])
def test_overlap_matchmaking_goes_with_either_overlap(mode: str) -> None:
    assert NodeConfig(overlap=mode, overlap_matchmaking=True).overlap_matchmaking
