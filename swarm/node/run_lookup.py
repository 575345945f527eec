"""What a joining node learns of its run before it builds anything: the run's settings.

    lookup = await look_up_run(run_id, initial_peers, p2p_config, dht_config, vouched)
    warning = unknown_run_warning(run_id, lookup)      # a mistyped --run-id: the runs this DHT has
    adopted = adoptable_settings(theirs=lookup.settings, given={"lr"}, ours=training_settings(config))

swarm-node calls this when it has --initial-peers: a short-lived client-mode DHT node (with the
node's identity; it stores nothing) reads the run's progress records, and every setting the
user did not give (model, H, batch, schedule, ...) takes the run's value, so that a volunteer
joins with `--run-id` and `--initial-peers` alone. A setting given on the command line or in the
config file is never overridden: when it contradicts the run, the node refuses to start, naming
both values (SwarmNode, settings.disagreement). Whose settings are the run's is
settings.run_settings's rule (the initial peers' first, else most records').
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarm.dht.config import DHTConfig
from swarm.dht.errors import DHTError
from swarm.dht.node import DHTNode
from swarm.dht.run_keys import RUNS_KEY, check_run_id, nodes_key, owned_map
from swarm.node.progress import decode_progress
from swarm.node.settings import RunSettings, run_settings
from swarm.p2p import P2PConfig
from swarm.p2p.errors import P2PError
from swarm.p2p.identity import Identity
from swarm.p2p.maddr import parse_address
from swarm.p2p.peer_id import PeerID

logger = logging.getLogger(__name__)

LOOKUP_TIMEOUT = 15.0  # seconds: the bootstrap and one lookup
MAX_RUNS_SHOWN = 8  # runs named in a warning (the most listed first)


@dataclass(frozen=True, slots=True)
class RunLookup:
    """What the DHT says of a run before a node joins it."""

    settings: RunSettings | None  # the run's settings (None: no record carries any)
    nodes: int  # progress records of the run
    runs: dict[str, RunSeen]  # the runs this DHT lists (RUNS_KEY), by id


@dataclass(frozen=True, slots=True)
class RunSeen:
    nodes: int  # listings of it
    step: int  # the highest outer step listed
    model: str | None


async def look_up_run(
    run_id: str, initial_peers: Iterable[str], p2p_config: P2PConfig, dht_config: DHTConfig,
    vouched: frozenset[PeerID], identity: Identity | None = None, id_proof_path: Path | None = None,
    timeout: float = LOOKUP_TIMEOUT,
) -> RunLookup | None:  # fmt: skip
    """The run's settings as its progress records say, and the runs the DHT lists (None: the DHT
    did not answer in time: the node then runs with its own settings and checks again once it
    joined). `identity` and `id_proof_path`: the node's own, so that its costly DHT id is solved
    (and saved) once, not again for the lookup."""
    node = DHTNode(identity, list(initial_peers), config=dht_config, p2p_config=p2p_config, client_mode=True,
                   id_proof_path=id_proof_path)  # fmt: skip
    try:
        found, listed = await asyncio.wait_for(_read(node, nodes_key(run_id), RUNS_KEY), timeout)
    except (P2PError, DHTError, TimeoutError, asyncio.TimeoutError, OSError) as e:
        logger.info("could not read the run's settings before starting: %s", e)
        return None
    finally:
        await node.close()
    peers = []
    for subkey, entry in found.items():
        progress = decode_progress(subkey, getattr(entry, "value", None))
        if progress is not None:
            peers.append((progress.peer_id, progress.settings))
    runs = listed_runs((subkey, getattr(entry, "value", None)) for subkey, entry in listed.items())
    return RunLookup(run_settings(peers, vouched), len(peers), runs)


async def _read(node: DHTNode, *keys: str) -> list[dict[Any, Any]]:
    await node.start()
    found = await asyncio.gather(*(node.get(key, latest=True) for key in keys))
    return [f.value if f is not None and isinstance(f.value, dict) else {} for f in found]


def listed_runs(entries: Iterable[tuple[Any, Any]], limit: int = MAX_RUNS_SHOWN) -> dict[str, RunSeen]:
    """The runs in RUNS_KEY's entries (pure; peers' input: malformed entries are skipped), the
    `limit` most listed."""
    seen: dict[str, list[tuple[int, str | None]]] = {}
    for subkey, value in entries:
        owned = owned_map(subkey, value)
        if owned is None:
            continue
        run, step, model = owned[1].get("run"), owned[1].get("step"), owned[1].get("model")
        try:
            check_run_id(run)
        except (ValueError, TypeError):
            continue
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 1 << 40:
            continue
        model = model if isinstance(model, str) and len(model) <= 64 else None
        seen.setdefault(run, []).append((step, model))
    most = sorted(seen.items(), key=lambda item: (-len(item[1]), item[0]))[:limit]
    return {run: RunSeen(len(rows), max(s for s, _ in rows), rows[0][1]) for run, rows in most}


class RunChoiceError(ValueError):
    """The node was given no --run-id and the DHT carries several runs: which one is not ours to pick."""


def run_to_join(run_id: str, given: bool, lookup: RunLookup) -> tuple[str, str | None]:
    """The run a node joins and the line to say about it (pure). A given --run-id is kept (a
    warning when no node trains it while others run). Not given: the default run when it has
    nodes or is listed; else the DHT's only run; several: RunChoiceError naming them."""
    if given or lookup.nodes > 0 or not lookup.runs or run_id in lookup.runs:
        return run_id, unknown_run_warning(run_id, lookup) if given else None
    if len(lookup.runs) == 1:
        only = next(iter(lookup.runs))
        return only, f"joining run {only!r}, the one run this DHT carries (--run-id {only})"
    raise RunChoiceError(f"this DHT carries several runs: {_named(lookup.runs)}; pass --run-id to pick one")


def _named(runs: Mapping[str, RunSeen]) -> str:
    return ", ".join(f"{run!r} ({seen.nodes} node{'s' * (seen.nodes != 1)}, model {seen.model}, outer step "
                     f"{seen.step})" for run, seen in runs.items())  # fmt: skip


def unknown_run_warning(run_id: str, lookup: RunLookup) -> str | None:
    """The warning for a --run-id that no node of this DHT trains while others are (pure): the
    likely typo, with the runs it sees."""
    if lookup.nodes > 0 or run_id in lookup.runs or not lookup.runs:
        return None
    return (
        f"no node of this DHT trains run {run_id!r}: starting it anew. The DHT has {_named(lookup.runs)}; "
        "check --run-id if you meant to join one of them"
    )


def initial_peer_ids(maddrs: tuple[str, ...]) -> frozenset[PeerID]:
    """The PeerIDs named in --initial-peers (their advertised states are preferred: trust.py)."""
    ids = set()
    for text in maddrs:
        with contextlib.suppress(ValueError):
            peer_id = parse_address(text).peer_id
            if peer_id is not None:
                ids.add(peer_id)
    return frozenset(ids)
