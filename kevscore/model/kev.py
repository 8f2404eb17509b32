"""The Kev model: wires layers together. It never sees batching, only a context per forward."""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from kevscore.model.config import FULL, LINEAR, KevConfig
from kevscore.model.layers.attention import Attention
from kevscore.model.layers.common import MLP, BankTensor, BranchContext, Context, PrefillContext, Rotary, frozen_param
from kevscore.model.layers.deltanet import DeltaNet
from kevscore.model.layers.ops import Ops

FP32_PARAMS = ("A_log", "dt_bias", "_scale")  # kept in fp32 whatever the model dtype
MIXERS = {LINEAR: DeltaNet, FULL: Attention}
BANK_GROUPS = tuple(mixer.BANK for mixer in MIXERS.values())  # a bank entry's tensors, by the layer kind declaring them
BANK_TENSORS = tuple(t for group in BANK_GROUPS for t in group)


def bank_tensors(cfg: KevConfig) -> list[tuple[BankTensor, int]]:
    """Every tensor of a bank entry, as the layers declare it, with how many layers of `cfg` declare it."""
    return [(t, cfg.layer_types.count(kind)) for kind, mixer in MIXERS.items() for t in mixer.BANK]


class Block(nn.Module):
    """Pre-norm block over a residual stream, which each sub-layer's output projection adds into."""

    def __init__(self, cfg: KevConfig, kind: str, ops: Ops):
        super().__init__()
        self.kind, self.ops = kind, ops
        self.mixer = MIXERS[kind](cfg, ops)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, ops)
        # 1 + weight of Qwen3.5's zero-centred RMSNorms, in fp32
        self.input_scale, self.post_scale = frozen_param(cfg.hidden_size), frozen_param(cfg.hidden_size)
        self.eps = cfg.rms_norm_eps

    def forward(self, hidden: torch.Tensor, ctx: Context, cos, sin, keep=None) -> torch.Tensor:
        """The residual stream after the block (the backend may update `hidden` in place). keep: an index into
        the leading dims; the mixer's output projection, the MLP and the returned stream cover only those
        positions."""
        h = self.ops.rms_norm(hidden, self.input_scale, self.eps)
        if keep is not None:
            hidden = hidden[keep]
        hidden = self.mixer(h, hidden, ctx, *(() if self.kind == LINEAR else (cos, sin)), keep=keep)
        return self.mlp(self.ops.rms_norm(hidden, self.post_scale, self.eps), hidden)

    def write_bank(self, hidden: torch.Tensor, ctx: PrefillContext, cos, sin) -> None:
        """The last layer of a prefill: its mixer's bank entry only; nothing reads its output."""
        h = self.ops.rms_norm(hidden, self.input_scale, self.eps)
        self.mixer.write_bank(h, ctx, *(() if self.kind == LINEAR else (cos, sin)))


class KevModel(nn.Module):
    def __init__(self, cfg: KevConfig, ops: Ops):
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)
        self.embed = frozen_param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, kind, ops) for kind in cfg.layer_types)
        self.final_scale = frozen_param(cfg.hidden_size)
        self.lm_head = self.embed if cfg.tie_word_embeddings else frozen_param(cfg.vocab_size, cfg.hidden_size)

    @classmethod
    def from_weights(cls, cfg: KevConfig, weights: dict[str, torch.Tensor], ops: Ops,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> "KevModel":
        # shapes first (the meta device), then each parameter allocated once, where it runs, in its dtype: not
        # through torch's default dtype, which is process-wide while the warm-up builds a model on its thread, and
        # not through ops on meta tensors (to_empty, empty_like), which torch runs through its Python references:
        # their first call imports its compiler stack and sympy (seconds, holding the import lock)
        with torch.device("meta"):
            model = cls(cfg, ops)
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                kind = torch.float32 if name.endswith(FP32_PARAMS) else dtype
                setattr(module, name, frozen_param(*param.shape, dtype=kind, device=device))
            for name, buffer in list(module.named_buffers(recurse=False)):
                setattr(module, name, buffer.to(device))  # computed on the CPU (Rotary)
        if cfg.tie_word_embeddings:
            model.lm_head = model.embed
        model.load(weights)
        return model

    @torch.no_grad()
    def load(self, w: dict[str, torch.Tensor]) -> None:
        self.embed.copy_(w["model.embed_tokens.weight"])
        self.final_scale.copy_(1.0 + w["model.norm.weight"].float())
        if not self.cfg.tie_word_embeddings:
            self.lm_head.copy_(w["lm_head.weight"])
        for i, block in enumerate(self.layers):
            pre = f"model.layers.{i}."
            block.input_scale.copy_(1.0 + w[pre + "input_layernorm.weight"].float())
            block.post_scale.copy_(1.0 + w[pre + "post_attention_layernorm.weight"].float())
            gate, up = w[pre + "mlp.gate_proj.weight"], w[pre + "mlp.up_proj.weight"]
            kind = block.mlp.gate_up.dtype
            block.mlp.gate_up.copy_(self.ops.gate_up_weight(gate.to(kind), up.to(kind)))
            block.mlp.down.copy_(w[pre + "mlp.down_proj.weight"])
            block.mixer.load(w, pre + ("linear_attn." if block.kind == LINEAR else "self_attn."))

    def attach_bank(self, bank) -> None:
        """Give each layer its views of the bank tensors it declares (`BANK`): the i-th layer declaring a tensor
        gets its index i (the bank never moves, so captured graphs stay valid)."""
        seen: Counter[str] = Counter()
        for block in self.layers:
            for t in block.mixer.BANK:
                setattr(block.mixer, f"bank_{t.name}", getattr(bank, t.name)[seen[t.name]])
                seen[t.name] += 1

    def _body(self, ids: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, ...]:
        """Every layer but the last: (the residual stream into the last layer, cos, sin)."""
        hidden = self.embed[ids]
        cos, sin = self.rotary.cos_sin(ctx.positions)
        for block in self.layers[:-1]:
            hidden = block(hidden, ctx, cos, sin)
        return hidden, cos, sin

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, ctx: PrefillContext) -> None:
        """Run packed documents ids [1, N] and write their bank entries (the last layer writes only these)."""
        hidden, cos, sin = self._body(ids, ctx)
        self.layers[-1].write_bank(hidden, ctx, cos, sin)

    @torch.no_grad()
    def branch(self, ids: torch.Tensor, ctx: BranchContext, last: torch.Tensor) -> torch.Tensor:
        """Run question rows ids [R, T]; return the final-normed hidden state at each row's `last` position
        ([R] -> [R, hidden]), or at its `last` positions ([R, K] -> [R * K, hidden], row by row)."""
        last = last.reshape(ids.shape[0], -1)  # [R, K], K = 1 for [R]: views, no copy
        rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(last).reshape(-1)
        hidden, cos, sin = self._body(ids, ctx)
        hidden = self.layers[-1](hidden, ctx, cos, sin, keep=(rows, last.reshape(-1)))  # only these positions
        return self.ops.rms_norm(hidden, self.final_scale, self.cfg.rms_norm_eps)
