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


@pytest.mark.parametrize(
    ("flags", "toml", "options"),
    [
        (["--overlap-matchmaking"], "overlap-matchmaking = true\n", {"overlap_matchmaking": True}),
        (["--error-feedback", "0.5", "--fragments", "2"], "error-feedback = 0.5\nfragments = 2\n",
         {"error_feedback": 0.5, "fragments": 2}),
    ],
)  # fmt: skip
def test_a_cross_field_rule_refuses_the_same_way_from_flags_toml_and_swarm_join(
    flags: list[str], toml: str, options: dict, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """The rules between settings live in NodeConfig, which flags, --config and swarm.join all build."""
    import torch

    import swarm

    def refusal(args: list[str]) -> str:
        result = CliRunner().invoke(main, [*args, "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], prog_name="swarm-node")
        assert result.exit_code == 2 and "Traceback" not in result.stderr, result.stderr
        line = result.stderr.strip().splitlines()[-1]
        return line.removeprefix("swarm-node: error: ").removesuffix(" (see 'swarm-node --help')")

    path = tmp_path / "node.toml"
    path.write_text(toml)
    with pytest.raises(ValueError) as caught:
        swarm.join(torch.nn.Linear(2, 2), host_maddrs=["/ip4/127.0.0.1/tcp/0"], **options)
    assert refusal(flags) == refusal(["--config", str(path)]) == str(caught.value)
