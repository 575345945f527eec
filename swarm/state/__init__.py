"""State exchange with peers (DESIGN.md "Training", invariants 5-7):

    protocol.py  the wire: `state.manifest` and `state.shard`, their arguments and replies
    holders.py   who holds which state: advertise in the DHT under `<run>/state`, read, choose
    server.py    StateServer: serves the last finished outer step's immutable snapshot
    fetcher.py   fetch_state: choose a state, get its manifest, load it once every shard verifies
    shard_fetch.py   ShardFetch: one manifest's shards from several peers in parallel, verified, resumable
    fetch_outcome.py what a fetch raises (FetchError, RefusedManifest) and reports (FetchProgress, FetchReport)
    keeper.py    StateKeeper: a training node's side of it all (resume, catch up, publish)
    config.py    their tunables: FetchConfig, KeeperConfig (one frozen config each, nested)

The state's format (manifest + safetensors shards) is swarm/model/checkpoint.py.
"""
