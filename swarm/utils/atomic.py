"""Files written whole or not at all: to a temporary name beside the target, fsynced, then
renamed over it.

A reader, or a process started after a crash, finds the old file or the new one under the
name, never half of one. The temporary name, `.<name>.tmp-<pid>-<thread>`, is one writer's
own (two threads or processes writing the same file never share it) and starts with a dot, so
listings skip it and a cleaner can tell a killed writer's leftovers (model/prepare.py removes
them). The directory entry itself is not fsynced here: a caller that needs the rename to
survive a power cut fsyncs the directory with fsync_path (model/checkpoint_dir.py does).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def temp_path(path: Path) -> Path:
    """The temporary name this process and thread write `path` under."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` for the caller to write, by name (a library's save
    function, an open()). On a clean exit the file is fsynced and renamed onto `path`; on an
    exception it is removed and `path` is left as it was. The parent folder is made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_path(path)
    try:
        yield temp
        fsync_path(temp)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def write_atomic(path: Path, data: bytes | bytearray | memoryview, *, mode: int | None = None) -> None:
    """`data` as the whole of `path` (see the module docstring). `mode`: the file's permissions,
    set before the first byte is written (0o600 for a secret key); None: the umask's."""
    with atomic_path(path) as temp:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)  # exactly `mode`, whatever the umask
            f.write(data)


def fsync_path(path: Path) -> None:
    """fsync a file, or a folder (its entries: a rename into it), by name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
