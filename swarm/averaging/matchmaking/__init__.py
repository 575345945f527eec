"""Who averages at an outer step: matchmaking through the DHT (matchmaker.py; a member's side of
joining a leader in joining.py, what it keeps of a step and finds in step_state.py), the pure rules
of readiness (ready.py), the ready sets as this node may believe them (ready_board.py), and which
announced peers are alive (liveness.py)."""
