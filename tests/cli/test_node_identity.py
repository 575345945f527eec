"""A node's identity persists: `swarm-node` and `swarm-dht serve` come back under the PeerID they
had, from their --checkpoint-dir or the per-user config folder, so a printed join line survives
a restart; two nodes of one machine never share a key; a key file that is not a private key is
refused in one line that says what to do."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from swarm.cli.dht import main as dht_main
from swarm.cli.node import main as node_main
from swarm.cli.node_identity import default_key_name
from swarm.p2p.identity import Identity
from swarm.utils import process_control
from swarm.utils.process_control import console_script
from tests.children import child_env
from tests.node.conftest import FAST, LOOPBACK


@pytest.mark.parametrize(
    ("name", "host_maddrs", "key"),
    [
        ("demo", (), "demo"),
        ("demo", ("/ip4/0.0.0.0/tcp/0",), "demo"),  # a free port: a new address each start anyway
        ("demo", ("/ip4/0.0.0.0/tcp/31400",), "demo-tcp31400"),  # a fixed port: one key per port
        ("demo", ("/ip4/0.0.0.0/tcp/31400", "/ip6/::/tcp/31400"), "demo-tcp31400"),
        ("demo", ("/ip4/0.0.0.0/tcp/31400", "/ip4/127.0.0.1/tcp/31401"), "demo"),  # no one port
        ("my run/ä", (), "my_run__"),  # a file name of its own characters only
        ("..", (), "_"),
    ],
)
def test_the_default_key_is_named_by_run_and_fixed_port(name: str, host_maddrs: tuple[str, ...], key: str) -> None:
    assert default_key_name(name, host_maddrs) == key


def one_line_error(result: object, *parts: str) -> str:
    output = getattr(result, "output", "")
    assert getattr(result, "exit_code", None) == 1, output
    assert len(output.strip().splitlines()) == 1 and "Traceback" not in output, output
    for part in parts:
        assert part in output, output
    return output


@pytest.mark.parametrize("command", ["serve", "node"])
def test_a_corrupt_or_shared_key_is_refused_in_one_line_with_the_fix(tmp_path: Path, command: str) -> None:
    def run(key: Path) -> object:
        if command == "serve":
            return CliRunner().invoke(dht_main, ["serve", "--host-maddrs", LOOPBACK, "--identity", str(key)])
        return CliRunner().invoke(node_main, ["--host-maddrs", LOOPBACK, "--identity", str(key)])

    corrupt = tmp_path / "corrupt.key"
    corrupt.write_bytes(b"\x08\x01\x12\x40" + b"\x00" * 10)
    corrupt.chmod(0o600)
    one_line_error(run(corrupt), f"identity file {corrupt} is not a libp2p Ed25519 key", "move it away")
    shared = tmp_path / "shared.key"
    Identity.generate().save(shared)
    shared.chmod(0o644)
    one_line_error(run(shared), f"{shared} can be read by others (mode 0644)", f"chmod 600 {shared}")
    blocked = tmp_path / "file"
    blocked.write_text("")
    out = one_line_error(CliRunner().invoke(node_main, ["--checkpoint-dir", str(blocked / "ckpt")]))
    assert "cannot create --checkpoint-dir" in out


def serve_peer_id(env: dict[str, str], *args: str) -> tuple[str, subprocess.Popen[str]]:
    proc = process_control.start([console_script("swarm-dht"), "serve", "--json", "--host-maddrs", LOOPBACK, *args],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    return process_control.read_json_line(proc, 60, what="swarm-dht serve")["peer_id"], proc


@pytest.mark.swarm
@pytest.mark.timeout(180)
def test_dht_serve_keeps_its_peer_id_and_two_at_once_get_two(tmp_path: Path) -> None:
    env = child_env(XDG_CONFIG_HOME=str(tmp_path / "config"))
    procs: list[subprocess.Popen[str]] = []
    try:
        first, proc = serve_peer_id(env)
        procs.append(proc)
        second, proc = serve_peer_id(env)  # the first holds dht.key: this one takes dht.2.key
        procs.append(proc)
        assert first != second
        keys = tmp_path / "config" / "swarm" / "identity"
        assert {p.name for p in keys.glob("*.key")} == {"dht.key", "dht.2.key"}
        assert all(p.stat().st_mode & 0o777 == 0o600 for p in keys.glob("*.key"))
        process_control.stop_all(procs, 15.0)
        again, proc = serve_peer_id(env)
        procs.append(proc)
        assert again == first  # restarted: the same PeerID, its join line holds
        ephemeral, proc = serve_peer_id(env, "--identity", "ephemeral")
        procs.append(proc)
        assert ephemeral not in (first, second)
        held = subprocess.run([console_script("swarm-dht"), "serve", "--host-maddrs", LOOPBACK, "--identity",
                               str(keys / "dht.key")], capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
        assert held.returncode == 1 and "is in use by another process on this machine" in held.stderr, held.stderr
    finally:
        process_control.stop_all(procs, 15.0)


def node_peer_id(tmp_path: Path, env: dict[str, str], name: str, *args: str) -> str:
    """Start a first node of a run, read the PeerID of its start event, stop it (SIGTERM)."""
    metrics = tmp_path / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    command = [console_script("swarm-node"), "--run-id", "keeps", "--host-maddrs", LOOPBACK, *FAST,
               "--metrics-file", str(metrics), *args]  # fmt: skip
    with open(tmp_path / f"{name}.err", "w") as err:
        proc = process_control.start(command, stdout=subprocess.DEVNULL, stderr=err, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and '"start"' in metrics.read_text()):
            assert proc.poll() is None, (tmp_path / f"{name}.err").read_text()
            assert time.monotonic() < deadline, f"no start event from {name}"
            time.sleep(0.2)
    finally:
        process_control.stop_all([proc], 30.0)
    start = next(json.loads(line) for line in metrics.read_text().splitlines() if '"start"' in line)
    return str(start["peer_id"])


@pytest.mark.swarm
@pytest.mark.timeout(400)
def test_a_restarted_node_keeps_its_peer_id_with_and_without_a_checkpoint_dir(tmp_path: Path) -> None:
    env = child_env(OMP_NUM_THREADS="1", XDG_CONFIG_HOME=str(tmp_path / "config"))
    plain = node_peer_id(tmp_path, env, "plain")
    assert node_peer_id(tmp_path, env, "plain") == plain
    assert (tmp_path / "config" / "swarm" / "identity" / "keeps.key").exists()
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    resumed = node_peer_id(tmp_path, env, "ckpt", *ckpt)
    assert resumed != plain and node_peer_id(tmp_path, env, "ckpt", *ckpt) == resumed
    assert os.stat(tmp_path / "ckpt" / "node.key").st_mode & 0o777 == 0o600
    assert node_peer_id(tmp_path, env, "ephemeral", "--identity", "ephemeral") not in (plain, resumed)
