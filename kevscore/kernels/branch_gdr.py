"""Fused short-branch gated delta rule: one kernel per DeltaNet layer for branches of at most 128 tokens.

It replaces the branch path's four stages after the conv front end: `fla_ops.gate_cumsum`, `fla_ops.wy_repr`
(FLA's kkt + solve and w/u kernels), `state_scan_indexed` and FLA's `chunk_fwd_o`. One program per (row,
value head, block of BV value columns), grid (V / BV, R * HV), computes for each 64-token chunk:

- the gate -exp(A_log) * softplus(a + dt_bias) and its chunk-local cumulative sum in log2 (FLA's
  `gdn_gate_chunk_cumsum` arithmetic and softplus), reading `a` in place in the projection output;
- A = strictly_lower(beta_i k_i.k_j exp2(g_i - g_j)) as one [64, 64] dot; (I + A)^-1 from its four diagonal
  16-row blocks, each inverted by forward substitution as in FLA's kkt + solve kernel, merged in pairs
  and then the two halves, by block products; w = (I + A)^-1 (beta k exp2(g)), u = (I + A)^-1 (beta v);
- v_new = u - w h and o = scale (q h exp2(g) + causal(q k^T exp2(g_i - g_j)) v_new), where h is the
  row's state read from the bank entry `index[r * index_stride]` (never written);
- for 65-128-token branches, the state after the first chunk, exp2(g_last) h + k^T (v_new exp2(g_last - g)),
  then the second chunk from it. Tokens past T are masked, not padded to a full chunk.

Only o is written. Values are rounded where FLA's pipeline stores them between its kernels (A, w, u,
v_new and the state entering a chunk, in the input dtype), so with bf16 inputs the two differ in
accumulation order only. Where things live (Triton decides; ptxas at the Kev-4B shape, defaults, no
spills, 72 KB of shared memory: T <= 64 with BV = V 218 registers, up to 128 with BV = 64 255; one 8-warp
program per SM either way, so occupancy is the first thing to measure): the state block [K, BV] is read
from the bank once, rounded to the input dtype, and held in registers as the dots' operand; it is fp32
only while the second chunk's state is formed, from the entry read again (L2) rather than kept through
the first chunk. The gate, beta, the [64, 64] A, S = q k^T and (I + A)^-1 and the 16x16 blocks of the
solve stay in registers; the dots stage their q, k, v, w and state operands through shared memory.
Splitting the value columns (BV < V) repeats the V-independent work (A, its inverse, w, q k^T) per block;
keys in blocks of BK (< K) halve the key tiles at the cost of more registers elsewhere (sm90_build.py).
Torch reference with the same interface: `kevscore.kernels.gdr_ref.branch_gdr`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from fla.ops.utils.constant import RCP_LN2
from fla.ops.utils.op import exp, exp2
from fla.ops.utils.softplus import softplus

from kevscore.kernels.gdr_ref import CHUNK

LOG2E = tl.constexpr(RCP_LN2)  # FLA's fp32 1/ln(2), by which its gate kernel scales the cumulative sum
MAX_T = 2 * CHUNK


@triton.jit
def _block(x, i: tl.constexpr, j: tl.constexpr, M: tl.constexpr):
    """Block (i, j) [M, M] of x, exactly (a masked sum of one term: cheaper in registers than splits)."""
    x4 = tl.reshape(x, (x.shape[0] // M, M, x.shape[1] // M, M))
    o = tl.arange(0, x4.shape[0])
    sel = (o == i)[:, None, None, None] & (o == j)[None, None, :, None]
    return tl.sum(tl.sum(tl.where(sel, x4, 0.0), 2), 0)


@triton.jit
def _lower(x00, x10, x11):
    """[[x00, 0], [x10, x11]] of three [M, M] blocks."""
    o = tl.arange(0, 2)
    row, col = o[:, None, None, None], o[None, None, :, None]
    y = tl.where((row == 0) & (col == 0), x00[None, :, None, :], 0.0)
    y = tl.where((row == 1) & (col == 0), x10[None, :, None, :], y)
    y = tl.where((row == 1) & (col == 1), x11[None, :, None, :], y)
    return tl.reshape(y, (2 * x00.shape[0], 2 * x00.shape[0]))


@triton.jit
def _gate(p_a, sa_t, A_log, dt_bias, o_t, m_t):
    """The chunk's cumulative log2 decay: FLA's gdn_gate_chunk_cumsum arithmetic; 0 past T, as FLA's later
    kernels read it."""
    b_a = tl.load(p_a + o_t * sa_t, mask=m_t, other=0.0).to(tl.float32) + tl.load(dt_bias).to(tl.float32)
    b_gate = -exp(tl.load(A_log).to(tl.float32)) * softplus(b_a)
    return tl.where(m_t, tl.cumsum(b_gate, axis=0) * LOG2E, 0.0)


@triton.jit
def _diag_inverse(b_A):
    """(I + A)^-1 of a strictly lower block by forward substitution: row i of the inverse, less the identity,
    is -A_i - sum_j A_ij Y_j; rows 0 and 1 are final as -A's. (Rows past T are zero in A: identity rows.)"""
    o = tl.arange(0, b_A.shape[0])
    b_Y = -b_A
    for i in range(2, b_A.shape[0]):
        row = tl.sum(tl.where((o == i)[:, None], -b_A, 0.0), 0)
        row += tl.sum(row[:, None] * b_Y, 0)
        b_Y = tl.where((o == i)[:, None], row[None, :], b_Y)
    return b_Y + (o[:, None] == o[None, :]).to(tl.float32)


@triton.jit
def _merge(X_a, X_b, A_ba, PREC: tl.constexpr):
    """(I + A)^-1 from the inverses X_a, X_b of its diagonal halves and its lower-left block A_ba."""
    return _lower(X_a, -tl.dot(tl.dot(X_b, A_ba, input_precision=PREC), X_a, input_precision=PREC), X_b)


@triton.jit
def _inverse(b_A, PREC: tl.constexpr):
    """(I + A)^-1 of the chunk's strictly lower A [64, 64] fp32: the four diagonal 16-row blocks inverted
    alone (as FLA's kkt + solve kernel does), merged in pairs, then the two halves merged (FLA merges the
    blocks in one step: the same products, grouped otherwise). PREC: the merges' dots, tf32 as FLA's."""
    A_ba = _block(b_A, 1, 0, 32)
    A00, A10, A11 = _block(b_A, 0, 0, 16), _block(b_A, 1, 0, 16), _block(b_A, 1, 1, 16)
    A22, A32, A33 = _block(b_A, 2, 2, 16), _block(b_A, 3, 2, 16), _block(b_A, 3, 3, 16)
    X_a = _merge(_diag_inverse(A00), _diag_inverse(A11), A10, PREC)
    X_b = _merge(_diag_inverse(A22), _diag_inverse(A33), A32, PREC)
    return _merge(X_a, X_b, A_ba, PREC)


@triton.jit
def _tile(p, o_t, m_t, o_c, S: tl.constexpr):
    """Rows o_t (masked by m_t, zero past T) and columns o_c of a [T, S] token-major tensor."""
    return tl.load(p + o_t[:, None] * S + o_c[None, :], mask=m_t[:, None], other=0.0)


@triton.jit
def _w_times_h(b_X, b_k, b_b, g, h_b):
    """w h over one block of key columns, w = (I + A)^-1 (beta k exp2(g)) rounded as FLA stores it."""
    b_kb = b_k * b_b[:, None]
    b_kb *= exp2(g)[:, None]
    b_w = tl.dot(b_X, b_kb.to(b_k.dtype)).to(b_k.dtype)
    return tl.dot(b_w, h_b)


@triton.jit
def _chunk(q, k, v, beta, o, p_a, sa_t, A_log, dt_bias, h1, h2, i_t, T, o_v, m_v, scale,
           H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
           BK: tl.constexpr, PREC: tl.constexpr):
    """Writes the chunk's output from the state entering it, h1 (and h2: key rows BK.. when K > BK) in the
    input dtype; returns its corrected values decayed to its end (input dtype) and that decay, which the
    state update after it needs."""
    o_t, o_k = i_t * BT + tl.arange(0, BT), tl.arange(0, BK)
    m_t = o_t < T
    m_tv = m_t[:, None] & m_v[None, :]
    dt = k.dtype.element_ty
    g = _gate(p_a, sa_t, A_log, dt_bias, o_t, m_t)
    b_b = tl.load(beta + o_t * HV, mask=m_t, other=0.0)
    # A = strictly_lower(beta_i k_i.k_j exp2(g_i - g_j)) on the valid tokens (each element as FLA's blocks
    # have it) and S = causal(q_i.k_j exp2(g_i - g_j)) (as FLA's chunk_o), over blocks of BK key columns
    b_k, b_q = _tile(k, o_t, m_t, o_k, H * K), _tile(q, o_t, m_t, o_k, H * K)
    b_A = tl.dot(b_k, tl.trans(b_k))
    b_S = tl.dot(b_q, tl.trans(b_k))
    if K > BK:
        b_k, b_q = _tile(k, o_t, m_t, BK + o_k, H * K), _tile(q, o_t, m_t, BK + o_k, H * K)
        b_A += tl.dot(b_k, tl.trans(b_k))
        b_S += tl.dot(b_q, tl.trans(b_k))
    m_S = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    b_S = tl.where(m_S, b_S * exp2(tl.where(m_S, g[:, None] - g[None, :], 0.0)), 0.0).to(dt)
    m_A = (o_t[:, None] > o_t[None, :]) & m_t[:, None] & m_t[None, :]
    b_A *= tl.where(m_A, exp2(tl.where(m_A, g[:, None] - g[None, :], 0.0)), 0.0)
    b_X = _inverse(b_A * b_b.to(tl.float32)[:, None], PREC).to(dt)

    # v_new = u - w h, w h over blocks of BK key columns as FLA's scan
    b_v = tl.load(v + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_tv, other=0.0)
    b_u = tl.dot(b_X, (b_v * b_b[:, None]).to(b_v.dtype), input_precision="ieee").to(b_v.dtype)
    b_wh = _w_times_h(b_X, _tile(k, o_t, m_t, o_k, H * K), b_b, g, h1)
    if K > BK:
        b_wh += _w_times_h(b_X, _tile(k, o_t, m_t, BK + o_k, H * K), b_b, g, h2)
    b_vn = b_u - b_wh  # fp32: the state update reads it unrounded, the output as stored (input dtype)
    g_last = tl.sum(tl.where(o_t == tl.minimum(T, (i_t + 1) * BT) - 1, g, 0.0))
    b_vd = (b_vn * tl.where(m_t, exp2(g_last - g), 0.0)[:, None]).to(dt)

    # o = scale (q h exp2(g) + S v_new)
    b_o = tl.dot(_tile(q, o_t, m_t, o_k, H * K), h1)
    if K > BK:
        b_o += tl.dot(_tile(q, o_t, m_t, BK + o_k, H * K), h2)
    b_o = b_o * exp2(g)[:, None] * scale + tl.dot(b_S, b_vn.to(b_v.dtype)) * scale
    tl.store(o + o_t[:, None] * (HV * V) + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
    return b_vd, g_last


@triton.jit(do_not_specialize=["T"])
def _branch_gdr_kernel(q, k, v, a, sa_r, sa_t, A_log, dt_bias, beta, bank, index, index_stride, bank_stride, o,
                       T, scale, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                       SHORT: tl.constexpr):
    i_v, i_rh = tl.program_id(0), tl.program_id(1)
    i_r, i_h = i_rh // HV, i_rh % HV
    slot = tl.load(index + i_r * index_stride).to(tl.int64)
    q += (i_r * T * H + i_h // (HV // H)).to(tl.int64) * K
    k += (i_r * T * H + i_h // (HV // H)).to(tl.int64) * K
    v += (i_r * T * HV + i_h).to(tl.int64) * V
    o += (i_r * T * HV + i_h).to(tl.int64) * V
    beta += (i_r * T * HV + i_h).to(tl.int64)
    p_a = a + i_r.to(tl.int64) * sa_r + i_h
    A_log += i_h
    dt_bias += i_h

    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_k = tl.arange(0, BK)
    # the row's state, from the bank entry its index names, in blocks of BK key rows
    p_h = bank + slot * bank_stride + i_h * K * V + o_k[:, None] * V + o_v[None, :]
    h1 = tl.load(p_h, mask=m_v[None, :], other=0.0).to(k.dtype.element_ty)
    h2 = h1
    if K > BK:
        h2 = tl.load(p_h + BK * V, mask=m_v[None, :], other=0.0).to(k.dtype.element_ty)
    if SHORT:  # T <= BT: compiled without the second chunk, which would take registers it does not need
        _chunk(q, k, v, beta, o, p_a, sa_t, A_log, dt_bias, h1, h2, 0, T, o_v, m_v, scale, H, HV, K, V, BT, BK, PREC)
    elif T > BT:  # the first chunk, then the state entering the second from the entry read again
        b_vd, g_last = _chunk(q, k, v, beta, o, p_a, sa_t, A_log, dt_bias, h1, h2, 0, T, o_v, m_v, scale,
                              H, HV, K, V, BT, BK, PREC)
        o_t = tl.arange(0, BT)
        b_h = tl.load(p_h, mask=m_v[None, :], other=0.0) * exp2(g_last)
        b_h += tl.dot(tl.trans(_tile(k, o_t, o_t < T, o_k, H * K)), b_vd)
        h1 = b_h.to(k.dtype.element_ty)
        if K > BK:
            b_h = tl.load(p_h + BK * V, mask=m_v[None, :], other=0.0) * exp2(g_last)
            b_h += tl.dot(tl.trans(_tile(k, o_t, o_t < T, BK + o_k, H * K)), b_vd)
            h2 = b_h.to(k.dtype.element_ty)
        _chunk(q, k, v, beta, o, p_a, sa_t, A_log, dt_bias, h1, h2, 1, T, o_v, m_v, scale, H, HV, K, V, BT, BK, PREC)
    else:  # not launched (the launcher sends T <= BT to SHORT), but with it this variant compiles spill-free
        _chunk(q, k, v, beta, o, p_a, sa_t, A_log, dt_bias, h1, h2, 0, T, o_v, m_v, scale, H, HV, K, V, BT, BK, PREC)

def branch_gdr(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate, beta: torch.Tensor, bank: torch.Tensor,
               index: torch.Tensor, index_stride: int | None = None, block_k: int = 128,
               block_v: int | None = None, num_warps: int = 8, num_stages: int = 1) -> torch.Tensor:
    """o [R, T, HV, V] (v's dtype) of branches of T <= 128 tokens, row r from `bank[index[r * index_stride]]`.

    q, k [R, T, H, K] l2-normalized, v [R, T, HV, V], beta [R, T, HV]: contiguous, as `branch_conv` writes
    them; gate = (a, A_log, dt_bias): a [R, T, HV] at any row and token stride (a slice of the projection
    output), A_log and dt_bias [HV]; bank [E, HV, K, V] fp32 (any entry stride), never written; index: int
    tensor read at `r * index_stride`. Launch: block_k key columns per step, block_v value columns per
    program (default: 128 for one chunk, 64 for two); one compiled variant for T <= 64, one for T <= 128. At
    the Kev-4B shape the defaults are the 8-warp configurations without spills (benchmarks/sm90_build.py)."""
    a, A_log, dt_bias = gate
    r, t, h, kd = k.shape
    hv, vd = v.shape[2], v.shape[3]
    assert 0 < t <= MAX_T and kd in (16, 32, 64, 128) and hv % h == 0
    assert all(x.is_contiguous() for x in (q, k, v, beta)) and q.shape == k.shape and beta.shape == (r, t, hv)
    assert a.shape == (r, t, hv) and a.stride(2) == 1
    assert bank.shape[1:] == (hv, kd, vd) and bank.stride()[1:] == (kd * vd, vd, 1) and bank.dtype == torch.float32
    stride = index.stride(0) if index_stride is None else index_stride
    short = t <= CHUNK
    bv = min(block_v or (128 if short else 64), triton.next_power_of_2(vd))
    o = torch.empty_like(v)
    grid = (triton.cdiv(vd, bv), r * hv)
    _branch_gdr_kernel[grid](q, k, v, a, a.stride(0), a.stride(1), A_log, dt_bias, beta, bank, index, stride,
                             bank.stride(0), o, t, kd ** -0.5, H=h, HV=hv, K=kd, V=vd, BT=CHUNK,
                             BK=min(kd, block_k), BV=bv, PREC="tf32", SHORT=short, num_warps=num_warps,
                             num_stages=num_stages)
    return o
