"""Watching a swarm: a node's Prometheus metrics (metrics.py, fed by its events), a small
read-only HTTP server (http.py), and a run's live dashboard from the DHT (runview.py, the pure
view; dashboard.py, its poller and page; dashboard.html). serve.py puts them on a node's
`--metrics-port`; `swarm-dht inspect --serve` and `swarm-sim --dashboard` serve the dashboard.

Sits above the node (it reads progress records and state holders) and below the CLI.
"""
