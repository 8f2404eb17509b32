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


def test_fused_mlp_switch_picks_the_weight_layout_and_the_kernel(monkeypatch):
    """KEVSCORE_FUSED_MLP on the GPU backend: bf16 weights whose intermediate size is a multiple of 128 are
    interleaved and go through `swiglu_gemm`; fp32, other sizes and the switch off stay stacked, through the
    GEMM and `swiglu_rows`."""
    pytest.importorskip("fla")
    import torch

    from kevscore.kernels import fla_ops
    from kevscore.kernels.swiglu_gemm import interleave

    monkeypatch.setattr(fla_ops, "swiglu_gemm", lambda x, w: "fused")
    monkeypatch.setattr(fla_ops, "swiglu_rows", lambda y: "rows")
    gate, up = torch.randn(256, 8), torch.randn(256, 8)
    for on, dtype, inner, fused in ((True, torch.bfloat16, 256, True), (True, torch.float32, 256, False),
                                    (True, torch.bfloat16, 192, False), (False, torch.bfloat16, 256, False)):
        monkeypatch.setattr(fla_ops, "FUSED_MLP", on)
        g, u = gate[:inner].to(dtype), up[:inner].to(dtype)
        w = fla_ops.gate_up_weight(g, u)
        assert torch.equal(w, interleave(g, u) if fused else torch.cat([g, u])), (on, dtype, inner)
        assert fla_ops.swiglu_proj(torch.randn(3, 8).to(dtype), w) == ("fused" if fused else "rows")
