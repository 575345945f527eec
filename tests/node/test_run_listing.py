"""The DHT's list of runs (RUNS_KEY) and the warning for a --run-id nobody trains: pure, by table."""

from __future__ import annotations

import pytest

from swarm.dht.records import owner_subkey
from swarm.node.run_lookup import RunChoiceError, RunLookup, RunSeen, listed_runs, run_to_join, unknown_run_warning
from swarm.p2p.identity import Identity

PEERS = [Identity.generate().peer_id for _ in range(6)]


def entry(i: int, value: object) -> tuple[object, object]:
    return owner_subkey(PEERS[i]), value


def test_runs_are_counted_by_listing_with_their_highest_step_and_bad_entries_skipped() -> None:
    entries = [
        entry(0, {"run": "ref", "model": "tiny", "step": 4}),
        entry(1, {"run": "ref", "model": "tiny", "step": 7}),
        entry(2, {"run": "other", "model": "small", "step": 1}),
        entry(3, {"run": "a/b", "step": 1}),  # not a run id
        entry(4, {"run": "ref", "step": -1}),  # not a step
        entry(5, ["not", "a", "map"]),
        ("not-an-owner", {"run": "ghost", "step": 1}),
    ]
    runs = listed_runs(entries)
    assert runs == {"ref": RunSeen(2, 7, "tiny"), "other": RunSeen(1, 1, "small")}
    assert list(listed_runs(entries, limit=1)) == ["ref"]  # the most listed first


@pytest.mark.parametrize(
    ("run_id", "nodes", "runs", "warned"),
    [
        ("reff", 0, {"ref": RunSeen(3, 12, "tiny")}, "no node of this DHT trains run 'reff': starting it anew. The "
         "DHT has 'ref' (3 nodes, model tiny, outer step 12); check --run-id"),
        ("ref", 0, {"ref": RunSeen(3, 12, "tiny")}, None),  # listed: its records may lag
        ("reff", 2, {"ref": RunSeen(3, 12, "tiny")}, None),  # it has nodes: a real run
        ("new", 0, {}, None),  # an empty DHT: the first node of a first run
    ],
)  # fmt: skip
def test_a_run_id_nobody_trains_is_warned_about_naming_the_runs(
    run_id: str, nodes: int, runs: dict[str, RunSeen], warned: str | None
) -> None:
    warning = unknown_run_warning(run_id, RunLookup(None, nodes, runs))
    assert warning == warned if warned is None else warning is not None and warning.startswith(warned)


REF, OTHER = RunSeen(3, 12, "tiny"), RunSeen(1, 2, "small")


@pytest.mark.parametrize(
    ("run_id", "given", "nodes", "runs", "joins", "says"),
    [
        ("swarm", False, 0, {"ref": REF}, "ref", "joining run 'ref', the one run this DHT carries (--run-id ref)"),
        ("swarm", False, 0, {}, "swarm", None),  # an empty DHT: the first node of the default run
        ("swarm", False, 2, {"ref": REF}, "swarm", None),  # the default run has nodes: it is the one
        ("swarm", False, 0, {"swarm": REF, "ref": OTHER}, "swarm", None),  # listed: its records may lag
        ("reff", True, 0, {"ref": REF}, "reff", "no node of this DHT trains run 'reff'"),  # given: kept, warned
        ("ref", True, 3, {"ref": REF, "x": OTHER}, "ref", None),
    ],
)  # fmt: skip
def test_a_node_without_a_run_id_joins_the_dhts_one_run(
    run_id: str, given: bool, nodes: int, runs: dict[str, RunSeen], joins: str, says: str | None
) -> None:
    joined, said = run_to_join(run_id, given, RunLookup(None, nodes, runs))
    assert joined == joins
    assert said == says if says is None else said is not None and said.startswith(says)


def test_a_node_without_a_run_id_in_a_dht_of_several_runs_is_told_to_pick() -> None:
    with pytest.raises(RunChoiceError, match=r"several runs: 'ref' \(3 nodes, model tiny, outer step 12\), 'x' "):
        run_to_join("swarm", False, RunLookup(None, 0, {"ref": REF, "x": OTHER}))
