"""DESIGN.md "Layers": each layer imports only the layers listed above it, and swarm_kernels/ nothing of ours.

Every import of every file of a layer is read with `ast` (relative imports resolved, imports under
TYPE_CHECKING included: a type-only import upward still couples the layers), mapped to the layer
it names, and checked against the layer's allowed set; a failure lists every offender.

A layer is a folder: swarm/<package>/ is the layer of that name, swarm_kernels/ is "kernels", and
swarm/utils/ holds the helpers every layer may use and that import no layer. The only modules at
the top of swarm/ are `api.py` and `__init__.py` (which re-exports it): the "api" layer, on the
node. swarm/observe/ (metrics, dashboard) sits on the node too, and cli/ on everything.

Within and across layers, no import cycle, TYPE_CHECKING imports and imports inside functions
included: a part that needs its owner's type names a Protocol of what it reads and calls (a
stream its connection, a search its DHT node, a round's serving or audit its round), or is
given values.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
API = {"api", "__init__"}  # the only modules at the top of swarm/

# layer -> the layers it may import (itself included); DESIGN.md order: p2p, dht, kernels,
# averaging, model, state, node, cli. Stricter than "anything above" where DESIGN.md says so:
# model/ never imports the networking (p2p, dht, averaging), nor state/ averaging/ (handed in).
ALLOWED: dict[str, set[str]] = {
    "utils": {"utils"},
    "kernels": {"kernels"},
    "netlab": {"netlab"},  # shaped links for swarm-sim and the benchmarks: pure stdlib, imports nothing of ours
    "p2p": {"utils", "p2p"},
    "dht": {"utils", "p2p", "dht"},
    "averaging": {"utils", "p2p", "dht", "kernels", "averaging"},
    "model": {"utils", "kernels", "model"},
    # prepared data across the swarm: chunks, their claims in the DHT, a node's position
    "data": {"utils", "p2p", "dht", "kernels", "model", "data"},
    "state": {"utils", "p2p", "dht", "kernels", "model", "state"},
    "node": {"utils", "p2p", "dht", "kernels", "averaging", "model", "data", "state", "node"},
    # a node of several ranks (swarm/ranks/): torch.distributed under the node, beside it
    "ranks": {"utils", "p2p", "kernels", "model", "node", "ranks"},
    "api": {"utils", "p2p", "dht", "kernels", "averaging", "model", "data", "state", "node", "api"},
    # metrics and the dashboard: they read the node's events and records, and serve them to the CLI
    "observe": {"utils", "p2p", "dht", "kernels", "averaging", "model", "data", "state", "node", "observe"},
    "cli": {
        "utils",
        "p2p",
        "dht",
        "kernels",
        "averaging",
        "model",
        "data",
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
    if parts[0] == "swarm_kernels":
        return "kernels"
    assert parts[0] == "swarm", path
    if len(parts) > 2:
        return parts[1]  # swarm/<package>/...: utils, p2p, dht, averaging, model, state, node, cli
    assert parts[1] in API, f"{path}: a module at the top of swarm/ belongs in a package"
    return "api"


def module_layer(name: str) -> str | None:
    """The layer an imported module belongs to; None for a module not ours (torch, asyncio)."""
    parts = name.split(".")
    if parts[0] == "swarm_kernels":
        return "kernels"
    if parts[0] in ("scripts", "tests"):
        return parts[0]  # allowed nowhere: benchmarks and tests sit above the package
    if parts[0] != "swarm":
        return None
    if len(parts) == 1:
        return "api"  # `import swarm` / `from swarm import join`
    if (ROOT / "swarm" / parts[1]).is_dir():
        return parts[1]
    if parts[1] in API:
        return "api"
    # a module moved out of the top of swarm/ and still imported by its old name (swarm/utils/moved.py)
    return "moved"


def imported_modules(path: Path, package: list[str]) -> list[tuple[int, str]]:
    """(line, module) for every import in the file of `package` (["swarm", "dht"]); `from X
    import y` yields X.y when y is a module of ours (`from swarm import dht` imports swarm.dht)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the file's package (swarm_kernels/ uses them)
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = ROOT.joinpath(*base.split("."), alias.name)
                is_module = sub.is_dir() or sub.with_suffix(".py").exists()
                found.append((node.lineno, f"{base}.{alias.name}" if is_module else base))
    return sorted(found)


def layer_files() -> list[Path]:
    return sorted([*(ROOT / "swarm").rglob("*.py"), *(ROOT / "swarm_kernels").rglob("*.py")])


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


def cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The groups of modules that import each other round a loop (the strongly connected
    components of more than one module; Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(group)
    return found


def module_graph() -> dict[str, set[str]]:
    """Every module of swarm/ -> the modules of swarm/ it imports (TYPE_CHECKING and imports
    inside functions included: a loop through them still ties the modules together)."""
    names = {}
    for path in (ROOT / "swarm").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[path] = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    modules = set(names.values())
    graph: dict[str, set[str]] = {}
    for path, name in names.items():
        package = list(path.relative_to(ROOT).with_suffix("").parts[:-1])
        graph[name] = {m for _, m in imported_modules(path, package) if m in modules and m != name}
    return graph


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b"}, "b": set()}, []),
        ({"a": {"b"}, "b": {"a"}}, [{"a", "b"}]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [{"a", "b", "c"}]),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c", "a"}}, [{"a", "b"}, {"c", "d"}]),
        ({"a": {"a"}}, []),  # a module importing itself is no loop between modules
    ],
)
def test_cycles_finds_each_loop_of_modules(edges: dict[str, set[str]], expected: list[set[str]]) -> None:
    assert sorted(map(sorted, cycles(edges))) == sorted(map(sorted, expected))


def test_no_import_cycle() -> None:
    found = [" <-> ".join(sorted(group)) for group in cycles(module_graph())]
    assert not found, "modules that import each other round a loop (break it with a Protocol of what the part reads, "
    "or a value):\n" + "\n".join(found)
