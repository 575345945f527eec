"""swarm-dht inspect --run-id: the compact table (100 columns hold 8 nodes), the run's settings
printed once, and the records of a peer that is gone left out. The pure view on tables of cases;
then 8 real DHT nodes on 127.0.0.1 read by the installed console script, one of them stopped."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from swarm.cli import inspect_view as view
from swarm.dht import DHT, owner_subkey, run_keys
from swarm.node.config import NodeConfig
from swarm.node.progress import OwnProgress
from swarm.node.settings import training_settings
from swarm.p2p import Identity, P2PConfig
from swarm.utils.process_control import console_script
from tests.children import child_env

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
SETTINGS = training_settings(NodeConfig()).wire()
HEADERS = view.COLUMNS


def _peer(i: int) -> str:
    return str(Identity.from_seed(bytes([i + 1]) * 32).peer_id)


def _record(i: int, now: float, **overrides: object) -> dict[str, object]:
    own = OwnProgress(maddrs=[f"/ip4/127.0.0.1/tcp/{4000 + i}"], client=False, step=123_456 + i, inner=49, H=50,
                      sec_per_step=0.25, train_loss=2.123456, eval_loss=1234.5678, tokens_per_s=1_234_567.0,
                      group_size=8, settings=SETTINGS, evals=((0, 3.0), (1, 2.5)), reach="punched")  # fmt: skip
    return {**own.encode(now - 2.0), **overrides}


def test_eight_nodes_fit_100_columns_with_every_column() -> None:
    now = time.time()
    nodes = [{"peer_id": _peer(i), "subkey": None, "value": _record(i, now)} for i in range(8)]
    nodes[3]["value"] = {"client": True, "step": "seven", "eval_loss": float("nan")}  # a record missing or lying
    states = [{"peer_id": _peer(i), "subkey": None, "value": {"step": 5, "manifest": f"{i:x}" * 64}} for i in range(8)]
    rows = view.node_rows(nodes, states, now)
    lines = view.table_lines(rows)
    assert len(lines) == 9 and max(map(len, lines)) <= 100, "\n".join(lines)
    assert lines[0].split() == list(HEADERS)
    top = lines[1].split()  # the most steps done first
    assert top[0] == "…" + _peer(7)[-6:] and top[1:4] == ["123463", "49/50", "2.1235"]
    assert top[4:] == ["1234.57", "1.23M", "8", "punched", "77777777", "2s"]
    assert lines[-1].split()[1:] == ["?", "?/?", "?", "?", "?", "?", "client", "33333333", "?"]
    settings, others = view.run_settings(nodes)
    assert settings == SETTINGS and others == []
    text = view.settings_lines(settings, others, 100)
    assert all(len(line) <= 100 for line in text) and text[0].startswith("settings: model=tiny")
    assert "inner_steps=50" in " ".join(text) and "max_outer_steps=-" in " ".join(text)


def test_a_peer_is_named_by_an_end_no_other_shares() -> None:
    names = view.suffixes(["aaa123456", "bbb123456", "ccc999999"])
    assert names == {"aaa123456": "a123456", "bbb123456": "b123456", "ccc999999": "999999"}
    assert max(map(len, view.table_lines(view.node_rows(
        [{"peer_id": p, "subkey": None, "value": {}} for p in names], [], 0.0)))) <= 100  # fmt: skip


def test_settings_of_a_minority_are_named() -> None:
    nodes = [{"peer_id": _peer(i), "subkey": None, "value": {"settings": {**SETTINGS, "lr": 0.001 + (i == 2)}}}
             for i in range(3)]  # fmt: skip
    settings, others = view.run_settings(nodes)
    assert settings == SETTINGS and others == [_peer(2)]
    assert view.settings_lines(settings, others, 100)[-1].endswith("…" + _peer(2)[-6:])
    assert view.settings_lines(None, [], 100) == ["settings: not published"]


NOW = 1_000_000.0
GONE_CASES = [
    # (record, answered its ping, gone?)
    ({"time": NOW - 1}, True, False),
    ({"time": NOW - 1}, False, True),  # killed: its record is fresh, its address silent
    ({"time": NOW - 1000}, True, False),  # a ping answered outweighs an old record (a stuck publisher)
    ({"time": NOW - 5}, None, False),  # not asked (client or relayed): fresh enough
    ({"time": NOW - view.STALE_S - 1}, None, True),  # not asked and not refreshed
    ({}, None, False),  # nothing to judge by: shown
    ({"time": "yesterday"}, None, False),
]


@pytest.mark.parametrize(("record", "answered", "gone"), GONE_CASES)
def test_gone_reason(record: dict[str, object], answered: bool | None, gone: bool) -> None:
    assert (view.gone_reason(record, answered, NOW) is not None) == gone


@pytest.mark.parametrize(
    ("record", "target"),
    [
        ({"maddrs": ["/ip4/1.2.3.4/tcp/5"]}, "/ip4/1.2.3.4/tcp/5"),
        ({"maddrs": ["/ip4/1.2.3.4/tcp/5/p2p/x/p2p-circuit", "/ip4/5.6.7.8/tcp/9"]}, "/ip4/5.6.7.8/tcp/9"),
        ({"maddrs": ["/ip4/1.2.3.4/tcp/5"], "client": True}, None),
        ({"maddrs": ["/ip4/1.2.3.4/tcp/5"], "reach": "relayed"}, None),
        ({"maddrs": "not a list"}, None),
        ("not a record", None),
    ],
)
def test_ping_target(record: object, target: str | None) -> None:
    assert view.ping_target(record) == target


# --- 8 real DHT nodes, read by `swarm-dht inspect` -------------------------------------------


@pytest.fixture
def eight_nodes() -> Iterator[list[DHT]]:
    with ExitStack() as stack:
        nodes: list[DHT] = []
        for i in range(8):
            initial = [nodes[0].visible_maddrs[0]] if nodes else []
            identity = Identity.from_seed(bytes([i + 1]) * 32)
            nodes.append(stack.enter_context(DHT(identity, initial, p2p_config=P2PConfig(host_maddrs=(LOOPBACK,)))))
        yield nodes


def _inspect(maddr: str, run: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [console_script("swarm-dht"), "inspect", "--run-id", run, "--initial-peers", maddr, "--timeout", "15", *flags],
        capture_output=True, text=True, timeout=60, env=child_env(COLUMNS="100"),
    )  # fmt: skip


@pytest.mark.swarm  # a child interpreter and 8 DHT nodes
@pytest.mark.timeout(120)
def test_inspect_of_8_nodes_fits_100_columns_and_leaves_out_a_stopped_one(eight_nodes: list[DHT]) -> None:
    run = "inspect-eight"
    expiration = time.time() + 120
    for i, node in enumerate(eight_nodes):
        record = _record(i, time.time(), maddrs=node.visible_maddrs)
        assert node.store(run_keys.nodes_key(run), record, expiration, owner_subkey(node.peer_id)) > 0
        state = {"step": 5, "manifest": f"{i:x}" * 64, "maddrs": node.visible_maddrs, "bytes": 1}
        assert node.store(run_keys.state_key(run), state, expiration, owner_subkey(node.peer_id)) > 0
    suffix = {str(n.peer_id): "…" + str(n.peer_id)[-6:] for n in eight_nodes}

    shown = _inspect(eight_nodes[1].visible_maddrs[0], run)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert max(map(len, lines)) <= 100, shown.stdout
    assert sum(line.startswith("settings:") for line in lines) == 1 and "inner_steps=50" in shown.stdout
    header = next(line for line in lines if line.startswith("peer"))
    assert header.split() == list(HEADERS)
    assert all(any(line.startswith(s) for line in lines) for s in suffix.values()), shown.stdout
    assert "left out" not in shown.stdout

    stopped = eight_nodes[5]
    stopped.shutdown()  # its records stay in the DHT until they expire; its address answers nothing
    after = _inspect(eight_nodes[1].visible_maddrs[0], run)
    assert after.returncode == 0, after.stderr
    assert not any(line.startswith(suffix[str(stopped.peer_id)]) for line in after.stdout.splitlines())
    assert f"left out: 1 peer gone ({suffix[str(stopped.peer_id)]})" in after.stdout, after.stdout
    as_json = json.loads(_inspect(eight_nodes[1].visible_maddrs[0], run, "--json").stdout)
    assert as_json["gone"] == [{"peer_id": str(stopped.peer_id), "reason": "does not answer at its address"}]
    assert len(as_json["nodes"]) == 7 and len(as_json["state"]) == 7 and as_json["settings"] == SETTINGS
