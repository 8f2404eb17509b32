"""Gated DeltaNet layer over fused projections; its state lives in the bank, which the runner attaches."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kevscore.model.config import KevConfig
from kevscore.model.layers.common import BankTensor, Context, PrefillContext, frozen_param
from kevscore.model.layers.ops import Ops


class DeltaNet(nn.Module):
    # each tensor it declares reaches it as `bank_<name>`, its view of the bank (KevModel.attach_bank):
    # bank_state [E, HV, K, V] fp32, bank_conv [E, conv_dim, k - 1]
    BANK = (BankTensor("state", ("linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"), fp32=True,
                       component="recurrent"),   # the final recurrent state
            BankTensor("conv", ("conv_dim", "conv_state_len")))  # the last k - 1 conv inputs

    def __init__(self, cfg: KevConfig, ops: Ops):
        super().__init__()
        self.ops = ops
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.splits = [cfg.conv_dim, cfg.value_dim, self.hv, self.hv]
        self.eps = cfg.rms_norm_eps
        self.in_proj = frozen_param(sum(self.splits), cfg.hidden_size)  # qkv | z | b | a
        self.conv_weight = frozen_param(cfg.conv_dim, cfg.linear_conv_kernel_dim)
        self.A_log, self.dt_bias = frozen_param(self.hv), frozen_param(self.hv)
        self.norm_weight = frozen_param(self.dv)
        self.out_proj = frozen_param(cfg.hidden_size, cfg.value_dim)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, ctx: Context,
                keep: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """The residual stream plus the layer's output. keep: an index into the leading dims (`residual` holds
        only those positions); only those positions' outputs are normed and projected."""
        mixed, z, b, a = F.linear(x, self.in_proj).split(self.splits, -1)
        gate = (a, self.A_log, self.dt_bias)  # the ops compute the decay -exp(A_log) * softplus(a + dt_bias)
        # the fronts: the conv, the q/k/v split and beta = sigmoid(b), in one kernel on the GPU
        if isinstance(ctx, PrefillContext):
            o = self._prefill(mixed, b, gate, ctx)
        else:
            q, k, v, beta = self.ops.branch_front(mixed, self.conv_weight, self.bank_conv, ctx.slots, self.hk, self.dk,
                                                  self.hv, self.dv, b)
            o = self.ops.gdr_branch(q, k, v, gate, beta, self.bank_state, ctx.slots, ctx.path)
        z = z.unflatten(-1, (self.hv, self.dv))
        if keep is not None:
            o, z = o[keep], z[keep]
        o = self.ops.gated_rms_norm(o, z, self.norm_weight, self.eps)
        return self.ops.proj_add(o.flatten(-2), self.out_proj, residual)

    def write_bank(self, x: torch.Tensor, ctx: PrefillContext) -> None:
        """Prefill's last layer: the documents' states and nothing more (its output would feed nothing)."""
        mixed, _, b, a = F.linear(x, self.in_proj).split(self.splits, -1)
        self._prefill(mixed, b, (a, self.A_log, self.dt_bias), ctx)

    def _prefill(self, mixed: torch.Tensor, b: torch.Tensor, gate, ctx: PrefillContext) -> torch.Tensor:
        """Packed documents from zero states: their conv and recurrent states into the bank; returns the output."""
        # the conv state: each document's last k - 1 inputs [D, C, k - 1], zero where a document is shorter
        tail = (mixed[0][ctx.tail_index] * ctx.tail_valid[..., None]).transpose(1, 2)
        self.bank_conv.index_copy_(0, ctx.slots, tail.to(self.bank_conv.dtype))
        q, k, v, beta = self.ops.prefill_front(mixed, self.conv_weight, ctx, self.hk, self.dk, self.hv, self.dv, b)
        return self.ops.gdr_prefill(q, k, v, gate, beta, ctx, self.bank_state)

    def load(self, w: dict[str, torch.Tensor], prefix: str) -> None:
        self.in_proj.copy_(torch.cat([w[f"{prefix}in_proj_{n}.weight"] for n in ("qkv", "z", "b", "a")]))
        self.conv_weight.copy_(w[f"{prefix}conv1d.weight"].squeeze(1))
        for param, name in ((self.A_log, "A_log"), (self.dt_bias, "dt_bias"), (self.norm_weight, "norm.weight"),
                            (self.out_proj, "out_proj.weight")):  # as the checkpoint holds them
            param.copy_(w[prefix + name])
