"""Who averages at an outer step: matchmaking through the DHT (matchmaker.py), the pure rules of
readiness (ready.py), the ready sets as this node may believe them (ready_board.py), and which
announced peers are alive (liveness.py)."""
