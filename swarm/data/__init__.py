"""Prepared data across the swarm: the dataset cut into chunks (chunks.py), the claims nodes make
on them in the DHT (claims.py, choice.py, claimer.py) and a node's position in them (cursor.py)."""
