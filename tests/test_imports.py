"""The package's import graph (every import, at module level or inside a function): no circles, and no
module importing another module's private names."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kevscore"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def imports(tree: ast.Module, known: set[str]) -> set[str]:
    """The package modules `tree` imports: `import kevscore.x`, `from kevscore import x`,
    `from kevscore.x import name` (a name that is a module counts as that module)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in known:
            out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                    for a in node.names}
    return out


def graph() -> dict[str, set[str]]:
    trees = modules()
    known = set(trees)
    return {name: imports(tree, known) - {name, "kevscore"} for name, tree in trees.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path a -> b -> ... -> a, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_imports_inside_functions():
    edges = graph()
    assert "kevscore.model.demo" in edges["kevscore.model.checkpoint"]  # imported inside load_checkpoint
    assert "kevscore.kernels.torch_ops" in edges["kevscore.engine.backend"]


def test_the_runtime_never_imports_the_demo_subpackage():
    """kevscore.demo makes the demo model (its task, trainer and tokenizer files): no runtime code of it."""
    edges = graph()
    importers = sorted(name for name, deps in edges.items() if not name.startswith("kevscore.demo")
                       and any(d.startswith("kevscore.demo") for d in deps))
    assert not importers, importers


def test_no_import_circles():
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_module_imports_another_modules_private_names():
    found = []
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kevscore"):
                found += [f"{name}: from {node.module} import {a.name}" for a in node.names
                          if a.name.startswith("_") and a.name != "__version__"]
    assert not found, found
