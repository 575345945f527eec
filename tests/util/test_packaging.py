"""The project's wheel holds every package and data file the source tree has: a non-editable
install (`pip install .`, the GPU check's wheels folder) once lacked swarm.ranks, and every
swarm-node died at its start with ModuleNotFoundError."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from scripts.experiments import gpu_wheels

ROOT = Path(__file__).resolve().parents[2]
# source folder -> the import name it is installed as (pyproject's package-dir)
INSTALLED_AS = {"swarm": "swarm", "swarm_kernels": "swarm_kernels"}


def source_files() -> set[str]:
    """Every .py file of a package and every data file the code reads, as wheel paths."""
    found = set()
    for folder, name in INSTALLED_AS.items():
        for path in (ROOT / folder).rglob("*"):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            in_package = (path.parent / "__init__.py").exists()
            if (path.suffix in (".py", ".html") and in_package) or path.suffix == ".cpp":
                found.add(f"{name}/{path.relative_to(ROOT / folder).as_posix()}")
    return found


@pytest.mark.swarm  # builds the wheel in a child process: seconds of CPU
def test_the_wheel_holds_every_module_and_data_file_of_the_source_tree(tmp_path: Path) -> None:
    wheel = gpu_wheels.build_project_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        inside = set(archive.namelist())
    expected = source_files()
    assert {"swarm/ranks/__init__.py", "swarm_kernels/csrc/int8_cpu.cpp", "swarm/observe/dashboard.html"} <= expected
    assert not expected - inside, f"not in the wheel: {sorted(expected - inside)}"
