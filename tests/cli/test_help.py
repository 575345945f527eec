"""-h and --help on every command (swarm-node once refused -h)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from swarm.cli.data import main as data_main
from swarm.cli.dht import main as dht_main
from swarm.cli.export import main as export_main
from swarm.cli.node import main as node_main
from swarm.cli.sim import main as sim_main


@pytest.mark.parametrize(
    "command",
    [node_main, dht_main, sim_main, export_main, data_main],
    ids=["swarm-node", "swarm-dht", "swarm-sim", "swarm-export", "swarm-data"],
)
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_every_command_takes_h_and_help(command: object, flag: str) -> None:
    result = CliRunner().invoke(command, [flag])  # type: ignore[arg-type]
    assert result.exit_code == 0 and result.output.startswith("Usage:"), result.output
