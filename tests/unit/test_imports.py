"""Imports flow one way (DESIGN.md): a module may import only its own layer or layers below it, and no
two packages import each other, even through others. Every import counts: lazy ones inside functions
and those under TYPE_CHECKING too. And README's layout, the map of these modules, lists every test file."""

from __future__ import annotations

import ast
from pathlib import Path

import tandemrl

ROOT = Path(tandemrl.__file__).parent
# lower number = lower layer; a module may not import a higher layer
LAYERS = {
    "types": 0, "threads": 0, "algo": 1, "rewards": 1, "rollout.env": 1, "rollout.tools": 1, "rollout.chat": 1, "rollout.mcp": 1,
    "data": 1, "logging": 1, "memory": 1, "generation": 2, "train": 2, "weights": 3, "rollout": 3, "server": 4,
    "pipeline": 4, "config": 5, "plan": 5, "tasks": 5, "cli": 6,
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


def test_no_two_packages_import_each_other_even_through_others():
    graph: dict[str, set[str]] = {}
    for source, target in edges():
        a, b = source.split(".")[0], target.split(".")[0]
        if a and a != b:
            graph.setdefault(a, set()).add(b)
    cycles = [(a, path) for a in graph if (path := _path(graph, a, a))]
    assert not cycles, f"package import cycles: {cycles}"


def test_no_module_imports_itself_through_others_inside_a_package():
    """Within a package too, imports form no cycle: the shared types live in a module both sides import
    (pipeline/parts.py), a factory in a module no backend imports (generation/factory.py)."""
    modules = {".".join(p for p in path.relative_to(ROOT).with_suffix("").parts if p != "__init__") for path in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for source, target in edges():
        while target not in modules and "." in target:  # `from pkg.mod import name`: the module
            target = target.rsplit(".", 1)[0]
        if target in modules and target != source:
            graph.setdefault(source, set()).add(target)
    cycles = [path for module in sorted(graph) if (path := _path(graph, module, module))]
    assert not cycles, f"module import cycles: {cycles}"


def _path(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A path start -> ... -> goal of at least one edge, or None."""
    seen, stack = set(), [(n, [start, n]) for n in graph.get(start, ())]
    while stack:
        node, path = stack.pop()
        if node == goal:
            return path
        if node not in seen:
            seen.add(node)
            stack += [(n, path + [n]) for n in graph.get(node, ())]
    return None


def test_types_imports_no_torch():
    tree = ast.parse((ROOT / "types.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert not any(name.split(".")[0] == "torch" for name in names)


def test_readmes_layout_lists_every_test_file():
    """README's layout is the map of the repository; it missed tests/unit/pipeline/test_pipeline.py (issue 36)."""
    tests = ROOT.parents[1] / "tests"
    readme = (ROOT.parents[1] / "README.md").read_text()
    layout = readme[readme.index("\ntests/\n", readme.index("## Layout")) :].split("```")[0]
    listed = {line.split()[0] for line in layout.splitlines()[2:] if line.startswith("  ")}
    missing = sorted(str(p.relative_to(tests)) for p in tests.rglob("*.py") if str(p.relative_to(tests)) not in listed)
    assert not missing, f"README's layout (tests/) lacks {missing}"
