"""Both ops backends implement kevscore.model.layers.ops.Ops: every function the layers call, with its signature."""
from __future__ import annotations

import importlib
import inspect

import pytest

from kevscore.model.layers.ops import Ops

MEMBERS = [n for n, v in vars(Ops).items() if inspect.isfunction(v) and not n.startswith("_")]


def parameters(fn, drop_self: bool) -> list[tuple[str, object]]:
    params = list(inspect.signature(fn).parameters.values())[1 if drop_self else 0:]
    return [(p.name, p.default) for p in params]


@pytest.mark.parametrize("backend", ["torch_ops", "fla_ops"])
def test_backend_implements_the_ops_interface(backend):
    if backend == "fla_ops":
        pytest.importorskip("fla")
    ops = importlib.import_module(f"kevscore.kernels.{backend}")
    assert isinstance(ops.NAME, str) and ops.NAME == backend  # the name model fingerprints record
    for name in MEMBERS:
        assert callable(getattr(ops, name, None)), f"{backend} has no {name}"
        assert parameters(getattr(ops, name), False) == parameters(getattr(Ops, name), True), name


def test_the_layers_call_only_the_interface():
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parent.parent / "kevscore"
    called = set()
    for path in [package / "model" / "kev.py", *(package / "model" / "layers").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "ops":
                called.add(node.attr)  # self.ops.<name>
    assert called and called <= set(MEMBERS), called - set(MEMBERS)
