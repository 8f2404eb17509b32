"""The reference backend: transformers' Qwen3_5ForCausalLM on the full `prefix + branch` sequence.

The tests' correctness oracle (tests/conftest.py scores with it) and compare's hf baseline. Trap:
transformers routes the gated delta rule and the causal conv to flash-linear-attention whenever `fla`
imports, even for CPU tensors; `force_torch_kernels` rebinds those functions so CPU tensors always take
transformers' own torch implementations.
"""
from __future__ import annotations

import functools

import torch

from kevscore.model.checkpoint import Checkpoint

KERNELS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update")


def _device_dispatch(wrapped):
    torch_impl = getattr(wrapped, "__wrapped__", None)
    if torch_impl is None or getattr(wrapped, "_kevscore_dispatch", False):
        return wrapped

    @functools.wraps(torch_impl)
    def dispatch(*args, **kwargs):
        on_cpu = any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in (*args, *kwargs.values()))
        return torch_impl(*args, **kwargs) if on_cpu else wrapped(*args, **kwargs)

    dispatch._kevscore_dispatch = True
    return dispatch


def force_torch_kernels() -> None:
    """Make transformers' Qwen3.5 modeling use its torch kernels for CPU tensors (idempotent)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    for name in KERNELS:
        if (fn := getattr(modeling, name, None)) is not None:
            setattr(modeling, name, _device_dispatch(fn))


def reference_model(ckpt: Checkpoint, device: str = "cpu", dtype: torch.dtype = torch.float32):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    force_torch_kernels()
    with torch.device(device):
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**ckpt.config.to_hf(), attn_implementation="sdpa")).to(dtype)
    model.load_state_dict({k: v.to(device, dtype) for k, v in ckpt.weights.items()}, strict=True)
    return model.eval()
