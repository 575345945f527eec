"""swarm-sim: a local training swarm (issue #5)."""

from swarm.cli.pending import pending_command

main = pending_command("swarm-sim", "the local training swarm", 5)
