"""swarm-dht: DHT node and inspection tool (issue #3)."""

from swarm.cli.pending import pending_command

main = pending_command("swarm-dht", "the Kademlia DHT and its CLI", 3)
