"""swarm.utils.atomic on real files: a write replaces the file whole, a failed or killed writer
leaves the old file under the name, a key file gets exactly 0600 whatever the umask, and
concurrent writers of one file each leave a whole file, never a mix."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from swarm.utils.atomic import atomic_path, temp_path, write_atomic

ROOT = Path(__file__).resolve().parents[2]

# writes half a file through atomic_path, says so, then waits to be killed
KILLED_MID_WRITE = """
import sys, time
from pathlib import Path
from swarm.utils.atomic import atomic_path
with atomic_path(Path(sys.argv[1])) as temp, open(temp, "wb") as f:
    f.write(b"half of the new")
    f.flush()
    print("written", flush=True)
    time.sleep(60)
"""


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "state.json"  # the folder is made
    write_atomic(path, b"old")
    write_atomic(path, b"new contents")
    assert path.read_bytes() == b"new contents"
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json"]


def test_a_writer_that_raises_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk full"), atomic_path(path) as temp:
        temp.write_bytes(b"half")
        raise RuntimeError("disk full")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.bin"]


def test_a_killed_writer_leaves_the_old_file_under_the_name(tmp_path: Path) -> None:
    path = tmp_path / "LATEST"
    path.write_bytes(b"step-00000004")
    child = subprocess.Popen([sys.executable, "-c", KILLED_MID_WRITE, str(path)], cwd=ROOT,
                             stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == b"written\n"
        child.kill()
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    assert path.read_bytes() == b"step-00000004"
    # the killed writer's temporary stays, named so that a cleaner can tell whose it is
    leftovers = [p.name for p in tmp_path.iterdir() if p != path]
    assert len(leftovers) == 1 and leftovers[0].startswith(f".LATEST.tmp-{child.pid}-"), leftovers


@pytest.mark.parametrize("umask", [0o000, 0o077, 0o277])
def test_a_key_file_is_0600_whatever_the_umask_and_whatever_was_there(tmp_path: Path, umask: int) -> None:
    path = tmp_path / "identity.key"
    path.write_bytes(b"an old key")
    path.chmod(0o644)
    old = os.umask(umask)
    try:
        write_atomic(path, b"secret", mode=0o600)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes() == b"secret"


def test_concurrent_writers_each_have_their_own_temporary_and_one_whole_file_wins(tmp_path: Path) -> None:
    path = tmp_path / "shard.bin"
    payloads = [bytes([i]) * (1 << 20) for i in range(4)]
    names: set[Path] = set()
    together = threading.Barrier(len(payloads), timeout=30)  # all alive at once: no thread id reused

    def write(data: bytes) -> None:
        together.wait()
        names.add(temp_path(path))
        write_atomic(path, data)

    threads = [threading.Thread(target=write, args=(data,)) for data in payloads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(names) == len(payloads)  # no two writers shared a temporary name
    assert path.read_bytes() in payloads
    assert [p.name for p in tmp_path.iterdir()] == ["shard.bin"]
