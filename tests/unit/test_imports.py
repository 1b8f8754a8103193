"""Imports flow one way (DESIGN.md): a module may import only its own layer or layers below it."""

from __future__ import annotations

import ast
from pathlib import Path

import tandemrl

ROOT = Path(tandemrl.__file__).parent
# lower number = lower layer; a module may not import a higher layer
LAYERS = {
    "types": 0, "config": 5, "algo": 1, "rewards": 1, "rollout.env": 1, "rollout.tools": 1, "rollout.chat": 1, "rollout.mcp": 1,
    "data": 1, "logging": 1, "generation": 2, "weights": 2, "train": 2, "rollout": 3, "server": 3,
    "pipeline": 4, "tasks": 5, "cli": 6,
}


def layer(module: str) -> int | None:
    parts = module.split(".")
    for n in (2, 1):
        key = ".".join(parts[:n])
        if key in LAYERS:
            return LAYERS[key]
    return None


def edges():
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        source = ".".join(p for p in rel.parts if p != "__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tandemrl."):
                yield source, node.module.removeprefix("tandemrl.")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("tandemrl."):
                        yield source, alias.name.removeprefix("tandemrl.")


def test_no_import_goes_up_a_layer():
    back = [(s, t) for s, t in edges() if layer(s) is not None and layer(t) is not None and layer(t) > layer(s)]
    assert not back, f"imports against the layering of DESIGN.md: {back}"


def test_types_imports_no_torch():
    tree = ast.parse((ROOT / "types.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert not any(name.split(".")[0] == "torch" for name in names)
