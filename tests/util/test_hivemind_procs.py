"""scripts.compare.procs without hivemind: a stand-in process with p2pd's `-listen=` argument."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.compare.procs import exists, remove_files, running, socket_files
from swarm.utils import process_control

psutil = pytest.importorskip("psutil")  # the bench extra


def test_socket_files_come_from_p2pds_listen_argument_and_are_removed(tmp_path: Path) -> None:
    daemon = tmp_path / "hivemind-p2pd-test.sock"
    client = tmp_path / "hivemind-p2pclient-test.sock"
    for path in (daemon, client):
        path.write_text("")
    # python -c CODE ARG: ARG shows in the cmdline as p2pd's does
    stand_in = [sys.executable, "-c", "import sys; sys.stdin.read()", f"-listen=/unix{daemon}"]
    proc = process_control.start(stand_in, stdin=subprocess.PIPE, new_session=False)
    try:
        p = psutil.Process(proc.pid)
        assert running(p) and exists(p)
        # until the child has exec'd, its cmdline is still ours (seen once under a loaded CI)
        deadline = time.monotonic() + 10
        while not any(arg.startswith("-listen=") for arg in p.cmdline()):
            assert time.monotonic() < deadline, p.cmdline()
            time.sleep(0.01)
        assert socket_files([p], connections=False) == {str(daemon), str(client)}
        assert socket_files([p]) == {str(daemon), str(client)}  # it listens on no unix socket
        remove_files([str(daemon), str(client), str(tmp_path / "never-there.sock")])
        assert not os.listdir(tmp_path)
    finally:
        process_control.close_stdin(proc)
        assert process_control.stop(proc, 10, term=None) == 0
    assert not running(p) and not exists(p)
    assert socket_files([p]) == set()  # a process that is gone is skipped
