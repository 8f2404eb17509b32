"""The torch backend of the layer ops: fp32 arithmetic on any device; the CPU scoring path and the oracle.

Every backend module exposes the same functions (see `kevscore.kernels.fla_ops` for the GPU one).
"""
from __future__ import annotations

from itertools import accumulate, groupby

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from kevscore.kernels import gdr_ref

NAME = "torch_ops"  # kevscore.model.layers.ops.Ops: the backend in model fingerprints
GATHERS_KV = True  # attn_branch gathers each row's document K/V by BranchContext.kv_index


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm, with `scale` = 1 + weight in fp32: computed in fp32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


def proj_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + x weight^T, a new tensor."""
    return residual + F.linear(x, weight)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeltaNet's output norm: w * norm(x), then times silu(gate)."""
    return (weight * rms_norm(x, 1.0, eps) * F.silu(gate.float())).to(x.dtype)  # a unit scale: the norm alone


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


def gate_up_weight(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up])


def swiglu_proj(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    return swiglu(F.linear(x, gate_up))


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial NeoX rotary of x [..., heads, head_dim] over its first cos.shape[-1] channels (cos/sin fp32)."""
    dim, half = cos.shape[-1], cos.shape[-1] // 2
    xf = x.float()
    rot, rest = xf[..., :dim], xf[..., dim:]
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat([rot * cos + rotated * sin, rest], -1).to(x.dtype)


def qk_norm_rotary(q: torch.Tensor | None, k: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor | None, torch.Tensor]:
    """RMSNorm of each q and k head (fp32), then rotary; q and k [..., heads, head_dim] (q None: k alone)."""
    norm = lambda x, scale: rotary(rms_norm(x, scale, eps), cos, sin)  # noqa: E731
    return None if q is None else norm(q, q_scale), norm(k, k_scale)


def conv_branch(x: torch.Tensor, weight: torch.Tensor, init: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + silu of x [B, T, C] continuing from init [B, C, k-1] (earlier inputs)."""
    full = torch.cat([init.to(x.dtype), x.transpose(1, 2)], -1)
    out = F.conv1d(full, weight.unsqueeze(1), groups=weight.shape[0])
    return F.silu(out).transpose(1, 2)


def split_front(y: torch.Tensor, hk: int, dk: int, hv: int, dv: int, b: torch.Tensor,
                l2norm=gdr_ref.l2norm) -> tuple[torch.Tensor, ...]:
    """A conv output split into q, k [..., hk, dk], each head l2-normalized by `l2norm` (here in fp32), and
    v [..., hv, dv]; and beta = sigmoid(b)."""
    q, k, v = y.split([hk * dk, hk * dk, hv * dv], -1)
    return l2norm(q.unflatten(-1, (hk, dk))), l2norm(k.unflatten(-1, (hk, dk))), v.unflatten(-1, (hv, dv)), b.sigmoid()


def branch_front(x: torch.Tensor, weight: torch.Tensor, bank_conv: torch.Tensor, slots: torch.Tensor,
                 hk: int, dk: int, hv: int, dv: int, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The branch conv from the rows' conv states, split, q and k l2-normalized (`split_front`)."""
    return split_front(conv_branch(x, weight, bank_conv.index_select(0, slots.long())), hk, dk, hv, dv, b)


def pad_docs(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """The documents of lengths `lens` packed in x [1, N, ...] as one zero-padded batch [D, T, ...], so each op
    runs once per pack, not once per document. Padding sits after each document's last token, so causal ops
    leave the real positions as they would be alone."""
    return x if len(lens) == 1 else pad_sequence(x[0].split(lens), batch_first=True)


def pack_docs(y: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """[D, T, ...] -> [1, N, ...], the real positions (`pad_docs` undone)."""
    return y if len(lens) == 1 else torch.cat([doc[:n] for doc, n in zip(y, lens)])[None]


def conv_prefill(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    lens = cu_seqlens.diff().tolist()
    padded = pad_docs(x, lens)
    return pack_docs(conv_branch(padded, weight, x.new_zeros(padded.shape[0], x.shape[-1], weight.shape[-1] - 1)), lens)


def prefill_front(x: torch.Tensor, weight: torch.Tensor, ctx, hk: int, dk: int, hv: int, dv: int,
                  b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The conv of packed documents (each from zeros), split, q and k l2-normalized (`split_front`)."""
    return split_front(conv_prefill(x, weight, ctx.cu_seqlens), hk, dk, hv, dv, b)


def gdr_prefill(q, k, v, gate, beta, ctx, bank: torch.Tensor) -> torch.Tensor:
    """The pack's documents from a zero state, as padded batches of documents with as many 64-token chunks
    (the engine sorts a pack by length, so these are runs): padding has k = 0 and a decay of 1 (g = 0), so
    it leaves each document's final state as it was. Returns the output [1, N, hv, dv]; document d's final
    state goes into `bank[ctx.slots[d]]`."""
    q, k = (gdr_ref.repeat_heads(x, v.shape[2]) for x in (q, k))  # once, not in every stage
    g = gdr_ref.gate_decay(*gate)
    outs, finals = [], []
    for s, e, lens in _runs(ctx.cu_seqlens):
        o, final = gdr_ref.chunk_gated_delta_rule(*(pad_docs(x[:, s:e], lens) for x in (q, k, v, g, beta)),
                                                  output_final_state=True, use_qk_l2norm=False,
                                                  chunk=gdr_ref.chunk_size(max(lens)))
        outs.append(pack_docs(o, lens))
        finals.append(final)
    bank.index_copy_(0, ctx.slots, torch.cat(finals, 0).to(bank.dtype))
    return torch.cat(outs, 1).to(v.dtype)


def _runs(cu_seqlens: torch.Tensor) -> list[tuple[int, int, list[int]]]:
    """(first token, end token, its documents' lengths) of each run of consecutive documents that span as many
    chunks: padding within a run stays under one chunk a document."""
    bounds = cu_seqlens.tolist()
    lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    # each run's first document: runs grouped by their documents' chunk counts
    firsts = [0, *accumulate(len(list(run)) for _, run in groupby(-(-n // gdr_ref.CHUNK) for n in lens))]
    return [(bounds[a], bounds[b], lens[a:b]) for a, b in zip(firsts, firsts[1:])]


def gdr_branch(q, k, v, gate, beta, bank: torch.Tensor, slots: torch.Tensor, path: str) -> torch.Tensor:
    """Rows start from bank entries `slots`, the four stages from their states copied out (here both `path`s
    copy). gate = (a, A_log, dt_bias), see `gdr_ref.gate_decay`."""
    q, k = (gdr_ref.repeat_heads(x, v.shape[2]) for x in (q, k))  # once, not in every stage
    o, _ = gdr_ref.chunk_gated_delta_rule(q, k, v, gdr_ref.gate_decay(*gate), beta, use_qk_l2norm=False,
                                          initial_state=bank.index_select(0, slots.long()),
                                          chunk=gdr_ref.chunk_size(q.shape[1]))  # a short branch: one chunk
    return o.to(v.dtype)


def _sdpa(q, k, v, mask):
    """q [B, T, H, D], k/v [B, S, Hkv, D], mask [B, T, S] or None (causal)."""
    gqa = q.shape[2] != k.shape[2]  # each KV head serves its query heads in place (no repeated copies)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    mask = None if mask is None else mask.unsqueeze(1)  # one mask for all heads
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa).transpose(1, 2)


def attn_prefill(q, k, v, gate, ctx) -> torch.Tensor:
    """Causal attention within each packed document, times sigmoid(gate)."""
    lens = ctx.cu_seqlens.diff().tolist()
    return pack_docs(_sdpa(*(pad_docs(x, lens) for x in (q, k, v)), None), lens) * torch.sigmoid(gate)


def branch_mask(kv_mask: torch.Tensor, t: int) -> torch.Tensor:
    """[R, T, P + T]: each branch token sees its document's real tokens and the branch causally."""
    r, p = kv_mask.shape
    causal = torch.ones(t, t, dtype=torch.bool, device=kv_mask.device).tril()
    return torch.cat([kv_mask[:, None, :].expand(r, t, p), causal.expand(r, t, t)], -1)


def attn_branch(q, k, v, gate, kv: torch.Tensor, ctx) -> torch.Tensor:
    """Branch queries over the row's document K/V (gathered from the pool `kv` [2, tokens, Hkv, D]) and,
    causally, the branch's own K/V; times sigmoid(gate) (gate [R, T, heads, head_dim] or None: no gate)."""
    keys, values = (torch.cat([pool[ctx.kv_index].to(x.dtype), x], 1) for pool, x in zip(kv, (k, v)))  # document first
    out = _sdpa(q, keys, values, branch_mask(ctx.kv_mask, q.shape[1]))
    return out if gate is None else out * torch.sigmoid(gate)
