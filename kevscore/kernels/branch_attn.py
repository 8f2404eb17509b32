"""Branch attention: question tokens over their document's K/V read in place from the bank's token pool.

Branch attention: question tokens attend to their document's K/V straight from the bank's token pool,
then causally to the branch's own K/V. No per-row gather of the document K/V, no repeated KV heads.

One program handles BM (query token, query head) pairs of one row and one KV head: the G query heads
sharing a KV head are stacked along M, so every K/V tile read serves all of them. The query tile and the
document's K/V tiles come through TMA descriptors (the pool's a [BN, D] box at the row's document start and
the program's KV head), the document's full tiles with no mask.
Torch reference: `kevscore.kernels.torch_ops.attn_branch` (gathered K/V, boolean mask, SDPA).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

LOG2E = 1.4426950408889634


@triton.jit
def _online_block(b_q, b_k, b_v, valid, b_m, b_l, acc, qk_scale):
    s = tl.dot(b_q, tl.trans(b_k)) * qk_scale
    if valid is not None:  # None: every key of the tile is valid
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(b_m, tl.max(s, 1))
    alpha = tl.math.exp2(b_m - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    b_l = b_l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v)
    return m_new, b_l, acc


@triton.jit
def _branch_attn_kernel(q, k, v, o, gate, pool_k, pool_v, kv_start, kv_len, T, qk_scale,
                        sk_r, sk_t, sv_r, sv_t, so_r, so_t, sg_r, sg_t, sg_h, s_start, s_len,
                        NKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        HAS_GATE: tl.constexpr):
    i_m, i_rh = tl.program_id(0), tl.program_id(1)
    i_r, i_kv = i_rh // NKV, i_rh % NKV
    o_m = i_m * BM + tl.arange(0, BM)
    t_m, head = o_m // G, i_kv * G + o_m % G  # query token and query head of each M row
    m_m = t_m < T
    o_d = tl.arange(0, D)
    b_q = tl.reshape(q.load([i_r, i_m * (BM // G), i_kv * G, 0]), (BM, D))  # [1, tokens, G heads, D]; zeros past T
    b_m = tl.full([BM], float("-inf"), tl.float32)
    b_l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)

    start = tl.load(kv_start + i_r * s_start).to(tl.int32)  # both may be strided upload-buffer columns
    n_doc = tl.load(kv_len + i_r * s_len).to(tl.int32)
    n_full = n_doc // BN * BN
    for n0 in range(0, n_full, BN):  # the document's full tiles, from the bank: nothing to mask
        b_k = pool_k.load([start + n0, i_kv * D])
        b_v = pool_v.load([start + n0, i_kv * D])
        b_m, b_l, acc = _online_block(b_q, b_k, b_v, None, b_m, b_l, acc, qk_scale)
    if n_full < n_doc:  # its last tile: the pool's rows past the document may hold anything, NaN included
        m_n = n_full + tl.arange(0, BN) < n_doc
        b_k = pool_k.load([start + n_full, i_kv * D])
        b_v = tl.where(m_n[:, None], pool_v.load([start + n_full, i_kv * D]), 0.0)
        b_m, b_l, acc = _online_block(b_q, b_k, b_v, m_n[None, :], b_m, b_l, acc, qk_scale)

    t_hi = tl.minimum((i_m * BM + BM - 1) // G + 1, T)
    for n0 in range(0, t_hi, BN):  # the branch itself, causally
        o_n = n0 + tl.arange(0, BN)
        m_n = o_n < T
        b_k = tl.load(k + i_r.to(tl.int64) * sk_r + o_n[:, None] * sk_t + i_kv * D + o_d[None, :],
                      mask=m_n[:, None], other=0.0)
        b_v = tl.load(v + i_r.to(tl.int64) * sv_r + o_n[:, None] * sv_t + i_kv * D + o_d[None, :],
                      mask=m_n[:, None], other=0.0)
        valid = (o_n[None, :] <= t_m[:, None]) & m_n[None, :]
        b_m, b_l, acc = _online_block(b_q, b_k, b_v, valid, b_m, b_l, acc, qk_scale)

    out = acc / b_l[:, None]
    if HAS_GATE:  # the layer's output gate, read in place from the q|gate projection
        p_g = gate + i_r.to(tl.int64) * sg_r + t_m[:, None] * sg_t + head[:, None] * sg_h + o_d[None, :]
        out = out * tl.sigmoid(tl.load(p_g, mask=m_m[:, None], other=0.0).to(tl.float32))
    p_o = o + i_r.to(tl.int64) * so_r + t_m[:, None] * so_t + head[:, None] * D + o_d[None, :]
    tl.store(p_o, out.to(o.dtype.element_ty), mask=m_m[:, None])


def branch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool_k: torch.Tensor,
                     pool_v: torch.Tensor, kv_start: torch.Tensor, kv_len: torch.Tensor,
                     gate: torch.Tensor | None = None, block_m: int = 128, block_n: int = 32, num_warps: int = 8,
                     num_stages: int = 3) -> torch.Tensor:
    """q [R, T, NH, D]; k, v [R, T, NKV, D] (token and row strides free, heads packed; q's strides 16-byte
    multiples, as a TMA descriptor needs); gate: None or
    [R, T, NH, D] with channels contiguous (any other strides): the output is multiplied by sigmoid(gate);
    pool_k, pool_v [tokens, NKV, D]; row r's document is pool[kv_start[r] : kv_start[r] + kv_len[r]];
    kv_start and kv_len are 1-D with any stride (the runner passes columns of its upload buffer).
    Launch defaults from `benchmarks/bench_kernels.py --only attention` (NOTES.md 94)."""
    r, t, nh, d = q.shape
    nkv = k.shape[2]
    assert all(x.stride(3) == 1 and x.stride(2) == d for x in (q, k, v)), "heads must be packed"
    assert pool_k.stride()[1:] == (d, 1) and pool_v.stride() == pool_k.stride()
    o = torch.empty(r, t, nh, d, dtype=q.dtype, device=q.device)
    g = nh // nkv
    assert block_m % g == 0, "a program's query tile holds whole tokens"
    assert gate is None or (gate.shape == q.shape and gate.stride(3) == 1)
    sg = gate.stride()[:3] if gate is not None else (0, 0, 0)
    grid = (triton.cdiv(t * g, block_m), r * nkv)
    q_tiles = TensorDescriptor(q, list(q.shape), list(q.stride()), [1, block_m // g, g, d])
    pools = [TensorDescriptor(p, [p.shape[0], nkv * d], [p.stride(0), 1], [block_n, d]) for p in (pool_k, pool_v)]
    _branch_attn_kernel[grid](q_tiles, k, v, o, gate if gate is not None else q, *pools, kv_start, kv_len, t,
                              d ** -0.5 * LOG2E, k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0),
                              o.stride(1), *sg, kv_start.stride(0), kv_len.stride(0), NKV=nkv, G=g, D=d, BM=block_m,
                              BN=block_n, HAS_GATE=gate is not None, num_warps=num_warps, num_stages=num_stages)
    return o
