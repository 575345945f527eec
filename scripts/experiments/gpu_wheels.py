"""The wheels folder a GPU machine without network installs the project from.

Prepared where pip can download: every distribution the project needs (its requirements' closure,
read from this environment's installed metadata, at the versions installed here), minus what the
GPU machine already has (`--present`), plus the GPU extra (bitsandbytes) and the project's own
wheel. Binary wheels come for the GPU machine's Python and platform; a distribution published
only as a source archive is built here into a pure-Python wheel (refused if it is not pure).

Installed there with `pip install --no-index --no-deps --target SITE` of exactly those wheels:
nothing is resolved or fetched, nothing in the machine's own environment is replaced, and SITE
goes on sys.path (and PYTHONPATH / PATH, for the swarm-node processes the check starts).
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "swarm-train"
# what the GPU machine has: torch with CUDA and these; --present adds to them
PRESENT = ("torch", "triton", "msgpack", "uvloop", "click", "rich", "safetensors")
# the GPU extra: not installed on a CPU machine, so fetched by name, without its dependencies
# (torch, numpy, packaging: the GPU machine's own)
GPU_EXTRA = ("bitsandbytes",)
# manylinux tags pip matches exactly: the ones wheels of these packages are published under
PLATFORMS = ("manylinux_2_39_x86_64", "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")  # fmt: skip


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(root: str = PROJECT, python_version: str = "3.12") -> dict[str, str]:
    """{name: installed version} of `root` and everything it requires, transitively, as installed
    in this environment, with markers evaluated for Linux and that Python (extras not taken)."""
    env = {"extra": "", "python_version": python_version, "python_full_version": f"{python_version}.0",
           "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
           "platform_machine": "x86_64", "implementation_name": "cpython"}  # fmt: skip
    found: dict[str, str] = {}
    todo = [root]
    while todo:
        name = canonical(todo.pop())
        if name in found:
            continue
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            raise RuntimeError(f"{name} is needed on Python {python_version} but is not installed here: "
                               "install it, or prepare the folder where it is") from None  # fmt: skip
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(env):
                todo.append(requirement.name)
    return found


def wanted(present: set[str], python_version: str = "3.12") -> dict[str, str]:
    """{name: version} to put in the folder: the closure less the project (built apart) and less
    what the GPU machine has; the GPU extra by name ("" = the newest)."""
    have = {canonical(name) for name in present}
    pinned = {n: v for n, v in closure(PROJECT, python_version).items() if n != PROJECT and n not in have}
    return {**pinned, **{canonical(n): "" for n in GPU_EXTRA if canonical(n) not in have}}


def download_command(dest: Path, name: str, version: str, python_version: str) -> list[str]:
    """pip's command for one binary wheel of `name` for the GPU machine, without dependencies."""
    spec = f"{name}=={version}" if version else name
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest),
            "--python-version", python_version, "--implementation", "cp", *platforms, spec]  # fmt: skip


def build_command(dest: Path, name: str, version: str) -> list[str]:
    """pip's command that builds a wheel here from a source archive (pure Python ones only)."""
    spec = f"{name}=={version}" if version else name
    return [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(dest), spec]


def build_project_wheel(dest: Path) -> Path:
    """The project's wheel, built from a clean copy of its sources (a build/ folder left in the
    checkout would slip stale modules in, or hide missing ones)."""
    with tempfile.TemporaryDirectory() as work:
        source = Path(work) / "src"
        ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
        for folder in ("swarm", "swarm_kernels"):
            shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(ROOT / name, source / name)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                        "--wheel-dir", str(dest), str(source)], check=True, capture_output=True)  # fmt: skip
    return next(dest.glob("swarm_train-*.whl"))


def is_pure(wheel: str) -> bool:
    """Whether a wheel's file name says it runs anywhere (py3-none-any)."""
    return wheel.endswith("-none-any.whl")


def prepare(dest: Path, present: set[str], python_version: str = "3.12") -> list[str]:
    """Fills `dest`; returns the wheel files in it. Raises RuntimeError naming a distribution that
    has neither a wheel for that platform nor a pure-Python build."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, version in sorted(wanted(present, python_version).items()):
        if subprocess.run(download_command(dest, name, version, python_version), capture_output=True).returncode == 0:
            continue
        with tempfile.TemporaryDirectory() as built:
            result = subprocess.run(build_command(Path(built), name, version), capture_output=True, text=True)
            wheels = [p for p in Path(built).glob("*.whl")]
            if result.returncode != 0 or not wheels or not all(is_pure(p.name) for p in wheels):
                raise RuntimeError(f"{name}=={version}: no wheel for Python {python_version} on x86-64 Linux, "
                                   f"and no pure-Python build ({result.stderr.strip()[-300:]})")  # fmt: skip
            for wheel in wheels:
                wheel.replace(dest / wheel.name)
    build_project_wheel(dest)
    return sorted(p.name for p in dest.glob("*.whl"))


def install_command(wheels: Path, site: Path) -> list[str]:
    """pip's offline install of every wheel in the folder into `site`, nothing resolved."""
    return [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
            "--upgrade", "--target", str(site), *sorted(str(p) for p in wheels.glob("*.whl"))]  # fmt: skip


def use_site(site: Path) -> None:
    """Puts `site` first on this interpreter's path and, for the processes it starts, on
    PYTHONPATH and (its console scripts) PATH."""
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    os.environ["PATH"] = os.pathsep.join([str(site / "bin"), os.environ.get("PATH", "")])
