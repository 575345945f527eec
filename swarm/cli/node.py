"""swarm-node: the DiLoCo training node (issue #5)."""

from swarm.cli.pending import pending_command

main = pending_command("swarm-node", "the DiLoCo training node", 5)
