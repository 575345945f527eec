"""swarm-dht as a user runs it: the installed console script in real processes on 127.0.0.1
(click's CliRunner only where no network is involved). Every process a test starts is
terminated, then killed, when the test ends, pass or fail."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from swarm.cli.dht import main
from swarm.cli.dht_records import parse_value
from swarm.cli.output import jsonable
from swarm.dht import DHT, owner_subkey, run_keys
from swarm.node.relay_records import RELAYS_KEY
from swarm.p2p import Identity, P2PConfig, PeerID
from swarm.utils import process_control
from swarm.utils.process_control import console_script
from tests.children import child_env

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
CLIENT_TIMEOUT = "5"  # seconds, --timeout of the client commands
OTHER_PEER = Identity.from_seed(b"\x07" * 32).peer_id


SCRIPT = console_script("swarm-dht")
ENV = child_env()


class Processes:
    """The serve processes of one test (or module), each stopped when it ends."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen[str]] = []

    def serve(self, *args: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
        """Start `swarm-dht serve --json` and read its first line: {"peer_id", "maddrs"}."""
        log = self.logs / f"serve{len(self.procs)}.err"
        with open(log, "w") as err:
            proc = process_control.start(
                [SCRIPT, "serve", "--json", "--host-maddrs", LOOPBACK, *args],
                stdout=subprocess.PIPE, stderr=err, text=True, env=ENV, new_session=False,
            )  # fmt: skip
        self.procs.append(proc)
        try:
            return proc, process_control.read_json_line(proc, 30, what="serve")
        except (TimeoutError, process_control.ChildExited) as e:
            pytest.fail(f"{e}: {log.read_text()}")

    def close(self) -> None:
        process_control.stop_all(self.procs, 10.0)
        for proc in self.procs:
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    processes = Processes(tmp_path)
    try:
        yield processes
    finally:
        processes.close()


@pytest.fixture(scope="module")
def lone_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One serve process for the tests that need a DHT but not a big one."""
    processes = Processes(tmp_path_factory.mktemp("lone"))
    try:
        yield processes.serve()[1]
    finally:
        processes.close()


def dht(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=60, env=ENV)


def parsed(result: subprocess.CompletedProcess[str]) -> Any:
    """The one JSON line a successful --json command prints."""
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    return json.loads(lines[0])


def dht_json(*args: str) -> Any:
    return parsed(dht(*args, "--json", "--timeout", CLIENT_TIMEOUT))


def dht_parallel(*commands: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """Independent commands at once (each process spends most of its second importing)."""
    timeout = ["--timeout", CLIENT_TIMEOUT]  # serve has none: it runs until stopped
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: dht(*args, *(timeout if args[0] != "serve" else [])), commands))


def assert_one_line_error(result: Any, *needles: str, exit_code: int | None = None) -> None:
    code = result.returncode if isinstance(result, subprocess.CompletedProcess) else result.exit_code
    assert code != 0 and (exit_code is None or code == exit_code), (code, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- a chain of real processes --------------------------------------------------------------


@pytest.mark.swarm
def test_chain_of_eight_serves_store_at_one_end_get_at_the_other(procs: Processes) -> None:
    nodes: list[tuple[subprocess.Popen[str], dict[str, Any]]] = []
    for _ in range(8):
        join = ["--initial-peers", nodes[-1][1]["maddrs"][0]] if nodes else []
        nodes.append(procs.serve(*join))
    maddrs = [info["maddrs"][0] for _, info in nodes]
    ids = {info["peer_id"] for _, info in nodes}
    assert len(ids) == 8

    stored, stored_dict = map(
        parsed,
        dht_parallel(
            ["store", "cli/greeting", '{"hello": [1, 2]}', "--ttl", "60", "--initial-peers", maddrs[0], "--json"],
            ["store", "cli/scores", "5", "--subkey", "a", "--initial-peers", maddrs[0], "--json"],
        ),
    )
    assert stored["accepted"] == 8 and stored["subkey"] is None and stored_dict["accepted"] == 8
    assert stored["expiration"] == pytest.approx(time.time() + 60, abs=10)

    got, got_dict, table, peers, pong = dht_parallel(
        ["get", "cli/greeting", "--initial-peers", f"{maddrs[7]} {maddrs[6]}", "--json"],  # a space-separated list
        ["get", "cli/scores", "--latest", "--initial-peers", f"{maddrs[7]},{maddrs[5]}", "--json"],  # commas
        ["get", "cli/greeting", "--initial-peers", maddrs[7]],
        ["peers", "--initial-peers", maddrs[7], "--json"],
        ["ping", maddrs[3], "--json"],
    )
    expected = {"key": "cli/greeting", "value": {"hello": [1, 2]}, "expiration": stored["expiration"], "subkeys": False}
    assert parsed(got) == expected
    got_dict = parsed(got_dict)
    assert got_dict["subkeys"] is True and list(got_dict["value"]) == ["a"] and got_dict["value"]["a"]["value"] == 5
    assert table.returncode == 0 and '{"hello": [1, 2]}' in table.stdout, table.stderr

    peers = parsed(peers)
    assert peers["client_mode"] is True and peers["peer_id"] not in ids
    assert {p["peer_id"] for p in peers["peers"]} == ids  # the self-lookup walks the whole chain
    maddr_of = {info["peer_id"]: info["maddrs"] for _, info in nodes}
    for row in peers["peers"]:
        assert row["maddrs"] == maddr_of[row["peer_id"]]
        assert isinstance(row["bucket"], int) and 0 <= row["last_seen_s"] < 60

    pong = parsed(pong)
    assert pong["peer_id"] == nodes[3][1]["peer_id"] and 0 < pong["rtt_ms"] < 5000 and pong["connect_ms"] > 0

    for i, (proc, _) in enumerate(nodes):
        proc.send_signal(signal.SIGINT if i == 0 else signal.SIGTERM)
    assert [proc.wait(15) for proc, _ in nodes] == [0] * 8


def test_serve_prints_its_maddrs_and_a_join_line(procs: Processes, tmp_path: Path) -> None:
    key = tmp_path / "bootstrap.key"
    peer_id = str(Identity.load_or_create(key).peer_id)
    proc = subprocess.Popen(
        [SCRIPT, "serve", "--host-maddrs", LOOPBACK, "--identity", str(key)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    procs.procs.append(proc)
    assert proc.stdout is not None
    assert select.select([proc.stdout], [], [], 30)[0], "serve printed nothing in 30 s"
    lines: list[str] = []  # the banner is written and flushed at once: the lines are all there
    while not lines or not lines[-1].startswith("Serving"):
        line = proc.stdout.readline()
        assert line, f"serve exited {proc.wait()} after printing {lines}"
        lines.append(line.rstrip("\n"))
    assert lines[0] == f"DHT node {peer_id} listening on:"
    maddr = lines[1].strip()
    assert maddr.startswith("/ip4/127.0.0.1/tcp/") and maddr.endswith(f"/p2p/{peer_id}")
    assert f"  swarm-node --initial-peers {maddr}" in lines
    proc.terminate()
    assert proc.wait(15) == 0
    assert "Traceback" not in proc.stderr.read()  # type: ignore[union-attr]


# --- what a training run publishes ----------------------------------------------------------


def test_inspect_shows_the_nodes_and_state_holders_of_a_run(lone_node: dict[str, Any], tmp_path: Path) -> None:
    maddr = lone_node["maddrs"][0]
    run = f"cli-run-{os.getpid()}"
    alice = Identity.from_seed(b"\x01" * 32)
    alice.save(tmp_path / "alice.key")
    record = {"maddrs": ["/ip4/127.0.0.1/tcp/1"], "step": 7, "client": False, "added_later": {"x": 1}}
    stored = dht_json(
        "store", run_keys.nodes_key(run), json.dumps(record), "--owned", "--identity", str(tmp_path / "alice.key"),
        "--initial-peers", maddr, "--ttl", "600",  # <run>/nodes records live minutes (DHTConfig.ttl_caps)
    )  # fmt: skip
    assert stored["accepted"] == 1 and stored["subkey"] == owner_subkey(alice.peer_id)

    bob = Identity.from_seed(b"\x02" * 32)  # a node that publishes in-process, with fields missing
    with DHT(bob, [maddr], p2p_config=P2PConfig(host_maddrs=(LOOPBACK,)), client_mode=True) as node:
        expiration = time.time() + 60
        assert node.store(run_keys.nodes_key(run), {"client": True}, expiration, owner_subkey(bob.peer_id))
        state = {"step": 6, "manifest": "ab" * 32, "maddrs": ["/ip4/127.0.0.1/tcp/2"]}
        assert node.store(run_keys.state_key(run), state, expiration, owner_subkey(bob.peer_id))

    seen, text, nothing = dht_parallel(
        ["inspect", "--run-id", run, "--initial-peers", maddr, "--json"],
        ["inspect", "--run-id", run, "--initial-peers", maddr, "-v"],  # every field of every record
        ["inspect", "--run-id", f"{run}-never", "--initial-peers", maddr],
    )
    seen = parsed(seen)
    assert seen["run_id"] == run
    assert seen["keys"] == {"nodes": f"{run}/nodes", "state": f"{run}/state", "chunks": f"{run}/chunks"}
    assert seen["data"] is None  # no chunk claims: a run on the built-in data
    by_peer = {e["peer_id"]: e for e in seen["nodes"]}
    assert set(by_peer) == {str(alice.peer_id), str(bob.peer_id)}
    assert by_peer[str(alice.peer_id)]["value"] == record
    assert by_peer[str(bob.peer_id)]["value"] == {"client": True}
    assert [(e["peer_id"], e["value"]) for e in seen["state"]] == [(str(bob.peer_id), state)]

    assert text.returncode == 0, text.stderr
    assert str(alice.peer_id) in text.stdout and "ab" * 32 in text.stdout and "added_later" in text.stdout
    assert_one_line_error(nothing, "publishes nothing", exit_code=1)


def test_a_store_no_node_accepts_is_tried_again_and_exits_1(lone_node: dict[str, Any]) -> None:
    """The node already holds the key until later (a newer expiration wins): the record is
    refused on every try; -v shows the tries and the warning, the exit code says it failed."""
    maddr, key = lone_node["maddrs"][0], f"refused-{os.getpid()}"
    assert dht_json("store", key, "first", "--initial-peers", maddr, "--ttl", "600")["accepted"] == 1
    result = dht("store", key, "older", "--initial-peers", maddr, "--ttl", "60", "-v", "--timeout", CLIENT_TIMEOUT)
    assert result.returncode == 1 and "no node accepted the record" in result.stderr, result.stderr
    assert result.stderr.count("trying again") == 2 and "(3 tries)" in result.stderr, result.stderr


# --- bad input: one line on stderr, a non-zero exit, never a traceback -----------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["get", "k", "--initial-peers", "/ip4/not-an-ip/tcp/1"], "malformed multiaddr"),
        (["get", "k", "--initial-peers", "/ip4/127.0.0.1/tcp/1 /ip4/127.0.0.1/udp/2"], "--initial-peers"),
        (["get", "k"], "--initial-peers is required"),
        (["store", "k", "v", "--ttl", "0", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "--ttl"),
        (["store", "k", "v", "--ttl", "nan", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "--ttl"),
        (["store", "k", "v", "--ttl", "soon", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "--ttl"),
        (["store", "k", "v", "--ttl", "1e9", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "--ttl"),
        (["ping", "127.0.0.1:31337"], "must start with '/'"),
        (["inspect", "--run-id", "a/b", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "--run-id"),
        (["peers", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--timeout", "-1"], "--timeout"),
        (["serve", "--host-maddrs", "/ip4/127.0.0.1/tcp/99999"], "--host-maddrs"),
        (["nosuchcommand"], "No such command"),
        (["ping", "/ip4/127.0.0.1/tcp/1", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "--initial-peers"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(main, args, prog_name="swarm-dht")
    assert_one_line_error(result, needle, exit_code=2)
    assert result.stdout == ""


def test_no_command_prints_the_help() -> None:
    result = CliRunner().invoke(main, [], prog_name="swarm-dht")
    assert result.exit_code == 2 and "Usage: swarm-dht" in result.stderr and "inspect" in result.stderr


def test_store_of_a_subkey_owned_by_another_peer_is_refused_before_any_network() -> None:
    owned = owner_subkey(OTHER_PEER, "x")
    result = CliRunner().invoke(
        main, ["store", "k", "v", "--subkey", owned, "--initial-peers", f"/ip4/127.0.0.1/tcp/{closed_port()}"]
    )
    assert_one_line_error(result, "bad_signature", str(OTHER_PEER), "--identity", exit_code=1)
    again = CliRunner().invoke(
        main, ["store", "k", "v", "--owned", "--subkey", owned, "--initial-peers", "/ip4/1.2.3.4/tcp/1"]
    )
    assert_one_line_error(again, "--owned", exit_code=2)


def test_an_identity_file_that_is_not_a_key_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"not a key")
    result = CliRunner().invoke(main, ["ping", "/ip4/127.0.0.1/tcp/1", "--identity", str(bad)])
    assert_one_line_error(result, "not a libp2p Ed25519 key", exit_code=1)


def test_unreachable_peers_are_one_line() -> None:
    dead = f"/ip4/127.0.0.1/tcp/{closed_port()}"
    get, ping, serve = dht_parallel(
        ["get", "k", "--initial-peers", dead],
        ["ping", dead],
        ["serve", "--host-maddrs", LOOPBACK, "--initial-peers", dead],
    )
    assert_one_line_error(get, "none of the 1 initial peers answered", dead, exit_code=1)
    assert_one_line_error(ping, "cannot connect", exit_code=1)
    assert_one_line_error(serve, "none of the 1 initial peers answered", exit_code=1)


def test_serve_lists_itself_as_a_relay(lone_node: dict[str, Any]) -> None:
    """NATed nodes learn relays from the DHT's `relays` records (node/relay_records.py): the one
    serve stores at start names its direct address and carries its id proof."""
    maddr, peer = lone_node["maddrs"][0], lone_node["peer_id"]
    deadline = time.monotonic() + 20
    get = ["get", RELAYS_KEY, "--initial-peers", maddr, "--json", "--timeout", CLIENT_TIMEOUT]
    while (result := dht(*get)).returncode:
        assert time.monotonic() < deadline, result.stderr  # stored as serve starts: moments after its first line
        time.sleep(0.2)
    found = parsed(result)
    [(subkey, entry)] = found["value"].items()
    assert subkey == owner_subkey(PeerID.from_base58(peer))
    assert entry["value"]["maddrs"] == lone_node["maddrs"] and entry["value"]["proof"]
    assert lone_node["pid"] > 0  # serve --json says its pid


def test_a_missing_key_is_one_line_and_exit_1(lone_node: dict[str, Any]) -> None:
    maddr = lone_node["maddrs"][0]
    flags: list[list[str]] = [[], ["--json"], ["--latest"]]
    for result in dht_parallel(*(["get", "cli/never-stored", *extra, "--initial-peers", maddr] for extra in flags)):
        assert_one_line_error(result, "'cli/never-stored' not found", exit_code=1)
        assert result.stdout == ""


def test_values_map_onto_json() -> None:
    assert [parse_value(t) for t in ("5", '{"a": 1}', '"5"', "hello", "[1, 2.5]", "null")] == [
        5, {"a": 1}, "5", "hello", [1, 2.5], None,
    ]  # fmt: skip
    assert jsonable({b"\x00k": b"\x01", 3: [b"", (1, "x")], "s": {"n": None}}) == {
        "$bytes:AGs=": {"$bytes": "AQ=="}, "3": [{"$bytes": ""}, [1, "x"]], "s": {"n": None},
    }  # fmt: skip


def test_open_network_options_reach_the_configs() -> None:
    import click
    from click.testing import CliRunner

    from swarm.cli.options import OpenNetworkLimits, open_network_options

    seen: list[OpenNetworkLimits] = []

    @click.command()
    @open_network_options
    def command(limits: OpenNetworkLimits) -> None:
        seen.append(limits)

    args = ["--max-connections", "50", "--max-connections-per-ip", "2", "--exempt-ip", "10.0.0.1", "--dht-id-bits", "3"]
    assert CliRunner().invoke(command, args).exit_code == 0
    p2p, dht = seen[0].p2p(host_maddrs=("/ip4/127.0.0.1/tcp/0",)), seen[0].dht()
    assert (p2p.max_connections, p2p.max_connections_per_ip, p2p.exempt_ips) == (50, 2, ("10.0.0.1",))
    assert dht.id_bits == 3
    assert CliRunner().invoke(command, []).exit_code == 0
    assert seen[1].p2p().exempt_ips == ("127.0.0.1", "::1")
