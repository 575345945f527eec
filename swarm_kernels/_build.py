"""Build (once) and load the C++ CPU extension.

The extension (csrc/int8_cpu.cpp and csrc/lowbit_cpu.cpp, one library) is compiled by
``torch.utils.cpp_extension.load`` into a cache directory keyed by a hash of the sources, the
compiler flags, the torch and Python versions and the machine:

    $TORCH_EXTENSIONS_DIR/swarm_kernels/int8_cpu-<key>/   if TORCH_EXTENSIONS_DIR is set, else
    ${XDG_CACHE_HOME:-~/.cache}/swarm_kernels/int8_cpu-<key>/

The extension is a plain shared library with C entry points (no pybind11: that header alone
took 13 of the 15 s of a build here); _cpu.py binds it with ctypes. A finished build holds a
``READY`` file; later processes open the library straight from there (no ninja run).

Two processes building at once: each takes an exclusive ``flock`` on ``int8_cpu-<key>.lock``
next to the build directory, so one builds while the other waits (at most BUILD_WAIT_S) and
then loads the result. The kernel drops a flock when its holder dies, unlike torch's own lock
file (``<dir>/lock``), which a builder killed mid-build leaves behind and which makes torch
wait forever; a build directory without ``READY`` is therefore wiped (stale lock file and
half-written objects included) before building again.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "int8_cpu.cpp"
LOWBIT_SOURCE = SOURCE.with_name("lowbit_cpu.cpp")  # the int4 / int2 codecs
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fno-fast-math", "-fvisibility=hidden")
LDFLAGS = ("-fopenmp",)
BUILD_WAIT_S = 600.0
READY = "READY"


def cache_root() -> Path:
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "swarm_kernels"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "swarm_kernels"


def sources() -> list[Path]:
    return [SOURCE, LOWBIT_SOURCE]


def build_key() -> str:
    h = hashlib.sha256()
    for source in sources():
        h.update(source.read_bytes() + b"\0")
    for part in (*CFLAGS, "|", *LDFLAGS, torch.__version__, sys.version, platform.machine(), sys.platform):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _exclusive(lock_path: Path, timeout: float) -> Iterator[None]:
    """An exclusive advisory lock, released by the kernel if this process dies."""
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on torch's own lock file
        yield
        return
    with open(lock_path, "a+b") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited {timeout:.0f} s for another build of {lock_path.stem}") from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _library(name: str, build_dir: Path) -> Path:
    suffix = {"win32": ".pyd", "darwin": ".dylib"}.get(sys.platform, ".so")  # torch's LIB_EXT
    return build_dir / f"{name}{suffix}"


def _find_ninja() -> None:
    """torch runs ``ninja`` from PATH; the PyPI wheel puts it beside this interpreter, which is
    not on PATH when a virtual environment's python runs without the venv activated."""
    beside = Path(sys.executable).parent
    if shutil.which("ninja") is None and shutil.which("ninja", path=str(beside)):
        os.environ["PATH"] = f"{beside}{os.pathsep}{os.environ.get('PATH', '')}"


def load_extension(verbose: bool = False) -> ctypes.CDLL:
    """The compiled library, building it first if needed. Raises on any build failure."""
    key = build_key()
    name = f"swarm_int8_cpu_{key}"
    root = cache_root()
    build_dir = root / f"int8_cpu-{key}"
    if (build_dir / READY).exists():
        return ctypes.CDLL(str(_library(name, build_dir)))
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / f"int8_cpu-{key}.lock", BUILD_WAIT_S):
        if (build_dir / READY).exists():  # another process built it while this one waited
            return ctypes.CDLL(str(_library(name, build_dir)))
        shutil.rmtree(build_dir, ignore_errors=True)  # a half build: stale lock, partial objects
        build_dir.mkdir(parents=True)
        _find_ninja()
        from torch.utils import cpp_extension

        cpp_extension.load(
            name=name,
            sources=[str(source) for source in sources()],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(build_dir),
            verbose=verbose,
            is_python_module=False,
        )
        library = ctypes.CDLL(str(_library(name, build_dir)))
        tmp = build_dir / f"{READY}.tmp"
        tmp.write_text(f"{torch.__version__}\n")
        os.replace(tmp, build_dir / READY)
        return library
