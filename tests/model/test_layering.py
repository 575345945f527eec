"""DESIGN.md layers: swarm/model imports nothing of ours above it (the averaging is handed in)."""

from __future__ import annotations

import ast
from pathlib import Path

import swarm.model

FORBIDDEN = ("swarm.p2p", "swarm.dht", "swarm.averaging", "swarm.state", "swarm.node", "swarm.cli")


def test_swarm_model_imports_no_networking_layer() -> None:
    for path in Path(swarm.model.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not [n for n in names if n.startswith(FORBIDDEN)], f"{path.name} imports {names}"
