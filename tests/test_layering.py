"""DESIGN.md "Layers": each layer imports only the layers listed above it, and kernels/ nothing of ours.

Every import of every file of a layer is read with `ast` (relative imports resolved, imports under
TYPE_CHECKING included: a type-only import upward still couples the layers), mapped to the layer
it names, and checked against the layer's allowed set; a failure lists every offender.

Beyond DESIGN.md's list: `swarm/eventloop.py`, `log_once.py`, `supervised.py`, `process_control.py`
and `process_memory.py` are shared helpers that every layer may use and that import no layer; the
other modules at the top of swarm/ (node.py and its parts: node_config, plan, progress, trainer,
...) form the node layer; `swarm/api.py` (and
`swarm/__init__.py`, which re-exports it) sits on the node, `swarm/observe/` (metrics, dashboard)
too, and cli/ on everything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# swarm/<name>.py usable from every layer
HELPERS = {"eventloop", "log_once", "supervised", "process_control", "process_memory"}
API = {"api", "__init__"}

# layer -> the layers it may import (itself included); DESIGN.md order: p2p, dht, kernels,
# averaging, model, state, node, cli. Stricter than "anything above" where DESIGN.md says so:
# model/ never imports the networking (p2p, dht, averaging), nor state/ averaging/ (handed in).
ALLOWED: dict[str, set[str]] = {
    "helpers": {"helpers"},
    "kernels": {"kernels"},
    "netlab": {"netlab"},  # shaped links for swarm-sim and the benchmarks: pure stdlib, imports nothing of ours
    "p2p": {"helpers", "p2p"},
    "dht": {"helpers", "p2p", "dht"},
    "averaging": {"helpers", "p2p", "dht", "kernels", "averaging"},
    "model": {"helpers", "kernels", "model"},
    "state": {"helpers", "p2p", "dht", "kernels", "model", "state"},
    "node": {"helpers", "p2p", "dht", "kernels", "averaging", "model", "state", "node"},
    # a node of several ranks (swarm/ranks/): torch.distributed under the node, beside it
    "ranks": {"helpers", "p2p", "kernels", "model", "node", "ranks"},
    "api": {"helpers", "p2p", "dht", "kernels", "averaging", "model", "state", "node", "api"},
    # metrics and the dashboard: they read the node's events and records, and serve them to the CLI
    "observe": {"helpers", "p2p", "dht", "kernels", "averaging", "model", "state", "node", "observe"},
    "cli": {
        "helpers",
        "p2p",
        "dht",
        "kernels",
        "averaging",
        "model",
        "state",
        "node",
        "api",
        "ranks",
        "netlab",
        "observe",
        "cli",
    },
}


def file_layer(path: Path) -> str:
    """The layer a file of the repository belongs to."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] == "kernels":
        return "kernels"
    assert parts[0] == "swarm", path
    if len(parts) > 2:
        return parts[1]  # swarm/<package>/...: p2p, dht, averaging, model, state, cli
    return "helpers" if parts[1] in HELPERS else "api" if parts[1] in API else "node"


def module_layer(name: str) -> str | None:
    """The layer an imported module belongs to; None for a module not ours (torch, asyncio)."""
    parts = name.split(".")
    if parts[0] in ("swarm_kernels", "kernels"):  # installed as swarm_kernels; relative imports inside
        return "kernels"
    if parts[0] in ("scripts", "tests"):
        return parts[0]  # allowed nowhere: benchmarks and tests sit above the package
    if parts[0] != "swarm":
        return None
    if len(parts) == 1:
        return "api"  # `import swarm` / `from swarm import join`
    if (ROOT / "swarm" / parts[1]).is_dir():
        return parts[1]
    return "helpers" if parts[1] in HELPERS else "api" if parts[1] in API else "node"


def imported_modules(path: Path, package: list[str]) -> list[tuple[int, str]]:
    """(line, module) for every import in the file of `package` (["swarm", "dht"]); `from X
    import y` yields X.y when y is a module of ours (`from swarm import dht` imports swarm.dht)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the file's package (kernels/ uses them)
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = ROOT.joinpath(*base.split("."), alias.name)
                is_module = sub.is_dir() or sub.with_suffix(".py").exists()
                found.append((node.lineno, f"{base}.{alias.name}" if is_module else base))
    return sorted(found)


def layer_files() -> list[Path]:
    return sorted([*(ROOT / "swarm").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")])


def offences(path: Path, package: list[str], layer: str) -> list[str]:
    """The imports of one file that its layer may not make, one line each."""
    bad = []
    for line, module in imported_modules(path, package):
        target = module_layer(module)
        if target is not None and target not in ALLOWED[layer]:
            bad.append(f"{path.name}:{line} imports {module} (layer {target})")
    return bad


def offenders(layer: str) -> list[str]:
    bad = []
    for path in layer_files():
        if file_layer(path) == layer:
            package = list(path.relative_to(ROOT).with_suffix("").parts[:-1])
            bad += [f"{'/'.join(package)}/{b}" for b in offences(path, package, layer)]
    return bad


@pytest.mark.parametrize("layer", list(ALLOWED))
def test_each_layer_imports_only_the_layers_below_it(layer: str) -> None:
    assert any(file_layer(p) == layer for p in layer_files()), f"no file of layer {layer}: the map is stale"
    bad = offenders(layer)
    assert not bad, f"{layer} may import only {sorted(ALLOWED[layer])}; offenders:\n" + "\n".join(bad)


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The parser itself: relative, aliased and TYPE_CHECKING imports all count."""
    probe = tmp_path / "probe.py"  # read as if it were a file of swarm/model/
    probe.write_text(
        "from typing import TYPE_CHECKING\nimport torch\nfrom . import llama\nfrom swarm import dht\n"
        "if TYPE_CHECKING:\n    from swarm.averaging.averager import Averager\nimport swarm.node as n\n"
    )
    assert offences(probe, ["swarm", "model"], "model") == [
        "probe.py:4 imports swarm.dht (layer dht)",
        "probe.py:6 imports swarm.averaging.averager (layer averaging)",
        "probe.py:7 imports swarm.node (layer node)",
    ]
