"""(I + A)^-1 of each 64-token chunk, A = strictly_lower(beta_i k_i . k_j exp2(g_i - g_j)): the gated delta rule's solve.

Written as FLA's `chunk_gated_delta_rule_fwd_kkt_solve_kernel` writes it ([R, T, HV, 64] in k's dtype: for each
row of a chunk, the blocks on and below the diagonal, rows past T not written), from the same products merged in
the same order, so either kernel can feed `kernels/branch_wy.py`; FLA's is the cuda tests' oracle
(tests/fla_oracles.py), `gdr_ref.chunk_inverse` the torch reference. One program serves a key head's G value heads
(GQA) on one warp: the ten 16 x 16 blocks of k k^T on and below the diagonal are computed once for them, and a
value head's four diagonal blocks (one value head per step of a loop, not unrolled: half the compile) are inverted
together, by forward substitution over one [4, 16, 16] tensor (14 dependent steps where four blocks one after
another take 4 x 14). The substitution's steps do not spread over warps: one warp is the fastest launch, at 2 and
4 the program waits on its barriers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from fla.ops.utils.op import exp2
from fla.utils import IS_TF32_SUPPORTED

from kevscore.kernels.gdr_ref import CHUNK


@triton.jit
def _gated(kk, g_r, g_c, b_r, m_r, m_c, DIAG: tl.constexpr):
    """beta_r kk exp2(g_r - g_c) of one 16 x 16 block of k k^T, zero outside valid rows and columns (and on and
    above the diagonal of a diagonal block)."""
    m = m_r[:, None] & m_c[None, :]
    if DIAG:
        o_i = tl.arange(0, 16)
        m = m & (o_i[:, None] > o_i[None, :])
    return tl.where(m, kk * exp2(g_r[:, None] - g_c[None, :]), 0.0) * b_r[:, None]


@triton.jit
def _blocks(b_ai):
    """The four [16, 16] blocks of a stacked [4, 16, 16] tensor, by splits (no masked sums)."""
    x = tl.reshape(tl.permute(b_ai, (1, 2, 0)), (16, 16, 2, 2))  # [..., 2 a + b] -> [..., a, b]
    lo, hi = tl.split(tl.permute(x, (0, 1, 3, 2)))  # blocks (0, 1) and (2, 3)
    a0, a1 = tl.split(lo)
    a2, a3 = tl.split(hi)
    return a0, a1, a2, a3


@triton.jit
def _merge(a, b, PRECISION: tl.constexpr):
    """a b at the solve's precision (fp32 operands: whatever the process's default for Triton's dots)."""
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit(do_not_specialize=["T"])
def _kkt_solve_kernel(k, g, beta, A, cu_seqlens, chunk_indices, T, H: tl.constexpr, HV: tl.constexpr,
                      G: tl.constexpr, K: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr):
    """One program per (chunk, row and key head); grid (chunks, R * H)."""
    i_t, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    if IS_VARLEN:
        i_n, i_t = tl.load(chunk_indices + i_t * 2).to(tl.int32), tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
        bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        T = (eos - bos).to(tl.int32)
    else:
        bos = i_b.to(tl.int64) * T
    t0 = i_t * 64
    o_i, o_k, o_b = tl.arange(0, 16), tl.arange(0, K), tl.arange(0, 4)
    m0, m1, m2, m3 = t0 + o_i < T, t0 + 16 + o_i < T, t0 + 32 + o_i < T, t0 + 48 + o_i < T
    p_k = k + (bos * H + i_h) * K + o_k[None, :]
    k0 = tl.load(p_k + (t0 + o_i)[:, None] * (H * K), mask=m0[:, None], other=0.0)
    k1 = tl.load(p_k + (t0 + 16 + o_i)[:, None] * (H * K), mask=m1[:, None], other=0.0)
    k2 = tl.load(p_k + (t0 + 32 + o_i)[:, None] * (H * K), mask=m2[:, None], other=0.0)
    k3 = tl.load(p_k + (t0 + 48 + o_i)[:, None] * (H * K), mask=m3[:, None], other=0.0)
    # k k^T's ten blocks on and below the diagonal, once for the key head's G value heads; a block row past the
    # chunk's last token (a short last chunk: a branch's second) stays zero, its dots skipped
    kk00 = _merge(k0, tl.trans(k0), PRECISION)
    kk11, kk10 = tl.zeros([16, 16], dtype=tl.float32), tl.zeros([16, 16], dtype=tl.float32)
    kk22, kk20, kk21 = kk11, kk11, kk11
    kk33, kk30, kk31, kk32 = kk11, kk11, kk11, kk11
    if t0 + 16 < T:
        kk11, kk10 = _merge(k1, tl.trans(k1), PRECISION), _merge(k1, tl.trans(k0), PRECISION)
    if t0 + 32 < T:
        kk22, kk20 = _merge(k2, tl.trans(k2), PRECISION), _merge(k2, tl.trans(k0), PRECISION)
        kk21 = _merge(k2, tl.trans(k1), PRECISION)
    if t0 + 48 < T:
        kk33, kk30 = _merge(k3, tl.trans(k3), PRECISION), _merge(k3, tl.trans(k0), PRECISION)
        kk31, kk32 = _merge(k3, tl.trans(k1), PRECISION), _merge(k3, tl.trans(k2), PRECISION)

    p_a = A + (bos * HV + i_h * G) * 64 + (t0 + o_i)[:, None] * (HV * 64) + o_i[None, :]
    for j in range(G):
        i_v = i_h * G + j
        p_g, p_b = g + bos * HV + i_v + t0 * HV, beta + bos * HV + i_v + t0 * HV
        g0 = tl.load(p_g + o_i * HV, mask=m0, other=0.0)
        g1 = tl.load(p_g + (16 + o_i) * HV, mask=m1, other=0.0)
        g2 = tl.load(p_g + (32 + o_i) * HV, mask=m2, other=0.0)
        g3 = tl.load(p_g + (48 + o_i) * HV, mask=m3, other=0.0)
        b0 = tl.load(p_b + o_i * HV, mask=m0, other=0.0).to(tl.float32)
        b1 = tl.load(p_b + (16 + o_i) * HV, mask=m1, other=0.0).to(tl.float32)
        b2 = tl.load(p_b + (32 + o_i) * HV, mask=m2, other=0.0).to(tl.float32)
        b3 = tl.load(p_b + (48 + o_i) * HV, mask=m3, other=0.0).to(tl.float32)
        # the four diagonal blocks stacked [4, 16, 16], (I + D)^-1 of all four at once: forward substitution
        b_d = tl.where((o_b == 0)[:, None, None], _gated(kk00, g0, g0, b0, m0, m0, True)[None], 0.0)
        b_d += tl.where((o_b == 1)[:, None, None], _gated(kk11, g1, g1, b1, m1, m1, True)[None], 0.0)
        b_d += tl.where((o_b == 2)[:, None, None], _gated(kk22, g2, g2, b2, m2, m2, True)[None], 0.0)
        b_d += tl.where((o_b == 3)[:, None, None], _gated(kk33, g3, g3, b3, m3, m3, True)[None], 0.0)
        b_ai = -b_d
        for i in range(2, tl.minimum(16, T - t0)):  # block 0's valid rows; blocks 1-3 have rows only if it has 16
            b_a = tl.sum(tl.where((o_i == i)[None, :, None], -b_d, 0.0), 1)  # row i of every block [4, 16]
            b_a = tl.where((o_i < i)[None, :], b_a, 0.0)
            b_a += tl.sum(b_a[:, :, None] * b_ai, 1)
            b_ai = tl.where((o_i == i)[None, :, None], b_a[:, None, :], b_ai)
        b_ai += (o_i[:, None] == o_i[None, :])[None, :, :]
        ai00, ai11, ai22, ai33 = _blocks(b_ai)
        # each block of the inverse stored as soon as it is merged, its gated k k^T block made where it is used
        # (a21 twice): the loop's live set then fits one warp's registers beside the ten kk blocks, with no spill
        dt = A.dtype.element_ty
        p = p_a + j * 64
        tl.store(p, ai00.to(dt), mask=m0[:, None])
        tl.store(p + 16 * HV * 64 + 16, ai11.to(dt), mask=m1[:, None])
        tl.store(p + 32 * HV * 64 + 32, ai22.to(dt), mask=m2[:, None])
        tl.store(p + 48 * HV * 64 + 48, ai33.to(dt), mask=m3[:, None])
        ai10 = -_merge(_merge(ai11, _gated(kk10, g1, g0, b1, m1, m0, False), PRECISION), ai00, PRECISION)
        tl.store(p + 16 * HV * 64, ai10.to(dt), mask=m1[:, None])
        ai21 = -_merge(_merge(ai22, _gated(kk21, g2, g1, b2, m2, m1, False), PRECISION), ai11, PRECISION)
        tl.store(p + 32 * HV * 64 + 16, ai21.to(dt), mask=m2[:, None])
        ai20 = -_merge(ai22, _merge(_gated(kk20, g2, g0, b2, m2, m0, False), ai00, PRECISION)
                       + _merge(_gated(kk21, g2, g1, b2, m2, m1, False), ai10, PRECISION), PRECISION)
        tl.store(p + 32 * HV * 64, ai20.to(dt), mask=m2[:, None])
        a31 = _gated(kk31, g3, g1, b3, m3, m1, False)
        a32 = _gated(kk32, g3, g2, b3, m3, m2, False)
        ai32 = -_merge(_merge(ai33, a32, PRECISION), ai22, PRECISION)
        tl.store(p + 48 * HV * 64 + 32, ai32.to(dt), mask=m3[:, None])
        ai31 = -_merge(ai33, _merge(a31, ai11, PRECISION) + _merge(a32, ai21, PRECISION), PRECISION)
        tl.store(p + 48 * HV * 64 + 16, ai31.to(dt), mask=m3[:, None])
        ai30 = -_merge(ai33, _merge(_gated(kk30, g3, g0, b3, m3, m0, False), ai00, PRECISION)
                       + _merge(a31, ai10, PRECISION) + _merge(a32, ai20, PRECISION), PRECISION)
        tl.store(p + 48 * HV * 64, ai30.to(dt), mask=m3[:, None])


def solve_chunks(k: torch.Tensor, gc: torch.Tensor, beta: torch.Tensor, a: torch.Tensor | None = None,
                 cu_seqlens=None, chunk_indices=None, num_warps: int = 1) -> torch.Tensor:
    """(I + A)^-1 of each 64-token chunk and value head of rows of equal length (or of packed documents:
    `cu_seqlens`, `chunk_indices`) into `a` [R, T, HV, 64] (k's dtype), which it returns; k [R, T, H, K] (K a
    power of two), gc the chunk-local cumulative log2 decay [R, T, HV] (fp32), beta [R, T, HV]. Only the blocks
    on and below the diagonal of valid rows are written, so a new buffer (a None) holds garbage elsewhere, which
    `branch_wy` never reads. Its dots of fp32 operands (the block merges; in an fp32 model k k^T too) run in TF32
    on bf16 models (as FLA's) and in 3xTF32, fp32's precision, on fp32 models, whatever the process's default."""
    r, t, h, dk = k.shape
    hv = beta.shape[2]
    a = torch.empty(r, t, hv, CHUNK, device=k.device, dtype=k.dtype) if a is None else a
    grid = (triton.cdiv(t, CHUNK) if cu_seqlens is None else chunk_indices.shape[0], r * h)
    precision = ("tf32x3" if k.dtype == torch.float32 else "tf32") if IS_TF32_SUPPORTED else "ieee"
    _kkt_solve_kernel[grid](k, gc, beta, a, cu_seqlens, chunk_indices, t, H=h, HV=hv, G=hv // h, K=dk,
                            IS_VARLEN=cu_seqlens is not None, PRECISION=precision, num_warps=num_warps, num_stages=1)
    return a
