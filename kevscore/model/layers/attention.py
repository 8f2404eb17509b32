"""Gated full attention over fused q|gate, k, v projections; document K/V live in the bank's token pool."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kevscore.model.config import KevConfig
from kevscore.model.layers.common import TOKENS, BankTensor, Context, PrefillContext, frozen_param
from kevscore.model.layers.ops import Ops


class Attention(nn.Module):
    # its view of the bank's K/V pool reaches it as `bank_kv` [2, tokens, Hkv, D] (KevModel.attach_bank)
    BANK = (BankTensor("kv", (2, TOKENS, "num_key_value_heads", "head_dim")),)  # K and V of every document token

    def __init__(self, cfg: KevConfig, ops: Ops):
        super().__init__()
        self.ops = ops
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.splits = [2 * self.nh * self.d, self.nkv * self.d, self.nkv * self.d]
        self.eps = cfg.rms_norm_eps
        self.qkv_proj = frozen_param(sum(self.splits), cfg.hidden_size)
        self.q_scale, self.k_scale = frozen_param(self.d), frozen_param(self.d)  # 1 + weight of the zero-centred norms, fp32
        self.o_proj = frozen_param(cfg.hidden_size, self.nh * self.d)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, ctx: Context, cos: torch.Tensor, sin: torch.Tensor,
                keep: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """The residual stream plus the layer's output. keep: an index into the leading dims (`residual` holds
        only those positions); only those positions' outputs are projected."""
        shape = x.shape[:-1]
        qg, k, v = F.linear(x, self.qkv_proj).split(self.splits, -1)
        q, gate = qg.reshape(*shape, self.nh, 2 * self.d).chunk(2, -1)
        q, k = self.ops.qk_norm_rotary(q, k.reshape(*shape, self.nkv, self.d), self.q_scale, self.k_scale,
                                       cos, sin, self.eps)
        v = v.reshape(*shape, self.nkv, self.d)
        if isinstance(ctx, PrefillContext):
            self._store_kv(k, v, ctx)
            o = self.ops.attn_prefill(q, k, v, gate, ctx)
        else:
            o = self.ops.attn_branch(q, k, v, gate, self.bank_kv, ctx)
        o = o.reshape(*shape, -1)
        return self.ops.proj_add(o if keep is None else o[keep], self.o_proj, residual)

    def write_bank(self, x: torch.Tensor, ctx: PrefillContext, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Prefill's last layer: the documents' K/V and nothing more (its output would feed nothing), so only
        k and v are projected."""
        shape = (*x.shape[:-1], self.nkv, self.d)
        k, v = F.linear(x, self.qkv_proj[self.splits[0]:]).split(self.splits[1:], -1)
        _, k = self.ops.qk_norm_rotary(None, k.reshape(shape), self.q_scale, self.k_scale, cos, sin, self.eps)
        self._store_kv(k, v.reshape(shape), ctx)

    def _store_kv(self, k: torch.Tensor, v: torch.Tensor, ctx: PrefillContext) -> None:
        """The packed documents' K/V [1, N, Hkv, D] into their slots of the bank's token pool."""
        self.bank_kv[0].index_copy_(0, ctx.kv_slots, k[0].to(self.bank_kv.dtype))
        self.bank_kv[1].index_copy_(0, ctx.kv_slots, v[0].to(self.bank_kv.dtype))

    def load(self, w: dict[str, torch.Tensor], prefix: str) -> None:
        self.qkv_proj.copy_(torch.cat([w[f"{prefix}{n}_proj.weight"] for n in "qkv"]))
        self.q_scale.copy_(1.0 + w[f"{prefix}q_norm.weight"].float())
        self.k_scale.copy_(1.0 + w[f"{prefix}k_norm.weight"].float())
        self.o_proj.copy_(w[f"{prefix}o_proj.weight"])
