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


def test_a_checkpoint_dir_that_cannot_be_a_folder_is_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Its default identity file lives there: a file in the folder's place is said in one line."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = CliRunner().invoke(main, ["--checkpoint-dir", str(blocker / "ckpt"), "--host-maddrs",
                                       "/ip4/127.0.0.1/tcp/0"], prog_name="swarm-node")  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.exit_code != 0 and "Traceback" not in result.stderr
    assert len(lines) == 1 and "cannot create --checkpoint-dir" in lines[0], result.stderr
