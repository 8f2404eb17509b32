"""The reference backend: transformers' Qwen3_5ForCausalLM on the full `prefix + branch` sequence.

It is the correctness oracle. Trap: transformers routes the gated delta rule and the causal conv to
flash-linear-attention whenever `fla` imports, even for CPU tensors; `force_torch_kernels` rebinds
those functions so CPU tensors always take transformers' own torch implementations.
"""
from __future__ import annotations

import functools

import torch

from kevscore.model.checkpoint import Checkpoint

KERNELS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
           "causal_conv1d_fn", "causal_conv1d_update")


def _device_dispatch(wrapped):
    torch_impl = getattr(wrapped, "__wrapped__", None)
    if torch_impl is None or getattr(wrapped, "_kevscore_dispatch", False):
        return wrapped

    @functools.wraps(torch_impl)
    def dispatch(*args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        on_cpu = any(t.device.type == "cpu" for t in tensors)
        return torch_impl(*args, **kwargs) if on_cpu else wrapped(*args, **kwargs)

    dispatch._kevscore_dispatch = True
    return dispatch


def force_torch_kernels() -> None:
    """Make transformers' Qwen3.5 modeling use its torch kernels for CPU tensors (idempotent)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    for name in KERNELS:
        fn = getattr(modeling, name, None)
        if fn is not None:
            setattr(modeling, name, _device_dispatch(fn))


def reference_model(ckpt: Checkpoint, device: str = "cpu", dtype: torch.dtype = torch.float32):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    force_torch_kernels()
    config = Qwen3_5TextConfig(**ckpt.config.to_hf())
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = Qwen3_5ForCausalLM(config).to(dtype)
    model.load_state_dict({k: v.to(device, dtype) for k, v in ckpt.weights.items()}, strict=True)
    return model.eval()


@torch.no_grad()
def reference_scores(model, prefix: list[int], branch: list[int], label_ids: list[int]) -> tuple[list[float], float]:
    """(softmax over the label logits, full-vocabulary mass of the labels) at the last position."""
    device = next(model.parameters()).device
    ids = torch.tensor([prefix + branch], device=device)
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].double()
    label = logits[label_ids]
    mass = torch.exp(torch.logsumexp(label, 0) - torch.logsumexp(logits, 0))
    return torch.softmax(label, 0).tolist(), float(mass)


@torch.no_grad()
def reference_sequence_scores(model, prefix: list[int], branch: list[int],
                              labels: list[list[int]]) -> tuple[list[float], float]:
    """Labels of any number of tokens, each on its own full sequence `prefix + branch + label[:-1]`: (softmax
    over the labels' summed token log-probabilities, the labels' total probability)."""
    device = next(model.parameters()).device
    summed = []
    for label in labels:
        ids = torch.tensor([prefix + branch + list(label[:-1])], device=device)
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(label)).logits[0].double()
        summed.append(torch.log_softmax(logits, -1)[range(len(label)), list(label)].sum())
    logprob = torch.stack(summed)
    return torch.softmax(logprob, 0).tolist(), float(torch.exp(torch.logsumexp(logprob, 0)))
