"""The fused DeltaNet front end: conv from the bank's conv state, SiLU, q/k/v split, l2 norm, beta.

Fused DeltaNet branch front end: causal conv from the bank's conv state, SiLU, the q/k/v split and the
l2 normalization of q and k, in one pass; optionally also beta = sigmoid(b) of the same projection output.

It reads the projection output in place (a strided slice), each row's conv state straight from the bank
by its slot (no gather, no padding copy), and writes q and k (l2-normalized per head) and v, each
contiguous, as the chunk pipeline wants them. Per element it does the arithmetic of FLA 0.5.2's
`causal_conv1d` (fp32 taps in the same order, SiLU, round to the activation dtype) followed by FLA's
`l2norm_fwd` (fp32, eps 1e-6, round); it replaces those two kernels and the `.contiguous()` copies
between them. The write strength beta (fp32 sigmoid, one rounding; within a rounding of torch's, whose
exp is more exact than Triton's) comes from one more program per tile, which replaces a torch kernel and
a graph node per layer. FLA's conv, its oracle in the cuda tests and A/B benchmarks, is in `tests/fla_oracles.py`.
Torch reference: `torch_ops.conv_branch` + split + `F.normalize`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

L2_EPS = 1e-6


@triton.jit
def _taps(p_x, sx_t, p_conv, w, o_t, o_c, m_d, T, b_pos, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
          EVEN: tl.constexpr, STATE: tl.constexpr, PACKED: tl.constexpr):
    """fp32 sum over the taps, oldest first as FLA accumulates them. STATE: the tile reaches back before the
    branch's first token, so the document's last W-1 conv inputs are read from the bank entry too (a
    per-element gather; tiles that cannot need it skip it). PACKED: documents packed in one row, b_pos the
    tokens' positions within their documents; taps before a document's first token are zero."""
    b_y = tl.zeros([BT, BD], dtype=tl.float32)
    for i_w in tl.static_range(-W + 1, 1):
        o_x = o_t + i_w
        m_x = (o_x >= 0) & (o_x < T)
        if PACKED:
            m_x = m_x & (b_pos + i_w >= 0)
        if EVEN:  # whole heads: the mask is constant along channels, so loads stay vectorized
            b_x = tl.load(p_x + o_x[:, None] * sx_t + o_c[None, :], mask=m_x[:, None], other=0.0).to(tl.float32)
        else:
            b_x = tl.load(p_x + o_x[:, None] * sx_t + o_c[None, :], mask=m_x[:, None] & m_d[None, :],
                          other=0.0).to(tl.float32)
        if STATE:  # x and the state never overlap, so adding them is exact
            m_s = ((o_x < 0) & (o_x + W - 1 >= 0))[:, None] & m_d[None, :]
            b_x += tl.load(p_conv + o_c[None, :] * (W - 1) + (o_x + W - 1)[:, None], mask=m_s, other=0.0).to(tl.float32)
        b_w = tl.load(w + o_c * W + (i_w + W - 1), mask=m_d, other=0.0).to(tl.float32)
        b_y += b_x * b_w[None, :]
    return b_y


@triton.jit
def _beta_tiles(b, sb_r, sb_t, beta, i_g, i_r, T, HB: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr,
                TILES: tl.constexpr):
    """beta = sigmoid(b) for the program's tiles: b [R, T, HB] at any row and token stride -> beta contiguous."""
    o_h = tl.arange(0, BH)
    for j in range(TILES):
        o_t = (i_g * TILES + j) * BT + tl.arange(0, BT)
        m = (o_t < T)[:, None] & (o_h < HB)[None, :]
        b_b = tl.load(b + i_r.to(tl.int64) * sb_r + o_t[:, None] * sb_t + o_h[None, :], mask=m, other=0.0)
        b_b = tl.sigmoid(b_b.to(tl.float32))
        tl.store(beta + (i_r.to(tl.int64) * T + o_t[:, None]) * HB + o_h[None, :], b_b.to(beta.dtype.element_ty),
                 mask=m)


@triton.jit
def _conv_tiles(x, sx_r, sx_t, w, conv, s_conv, slots, s_slot, q, k, v, T, pos, i_g, i_c, i_r,
                QK: tl.constexpr, NQK: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr, C: tl.constexpr,
                W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, EPS: tl.constexpr, EVEN: tl.constexpr,
                TILES: tl.constexpr, PACKED: tl.constexpr):
    # channel block: a q or k head (KD channels) for i_c < 2 * NQK, else a v head (VD channels)
    is_qk = i_c < 2 * NQK
    c0 = tl.where(is_qk, i_c * KD, 2 * QK + (i_c - 2 * NQK) * VD)
    width = tl.where(is_qk, KD, VD)
    o_d = tl.arange(0, BD)
    m_d = o_d < width
    o_c = c0 + o_d

    p_x = x + i_r.to(tl.int64) * sx_r
    if not PACKED:
        slot = tl.load(slots + i_r * s_slot).to(tl.int64)
        p_conv = conv + slot * s_conv
    else:  # documents start from a zero state: no bank read
        p_conv = conv
    for j in range(TILES):  # TILES consecutive time tiles of BT tokens per program
        i_t = i_g * TILES + j
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        if PACKED:
            b_pos = tl.load(pos + o_t, mask=m_t, other=0)
            b_y = _taps(p_x, sx_t, p_conv, w, o_t, o_c, m_d, T, b_pos, W, BT, BD, EVEN, False, True)
        elif i_t * BT >= W - 1:  # only the first tile(s) of a branch reach back into the document
            b_y = _taps(p_x, sx_t, p_conv, w, o_t, o_c, m_d, T, o_t, W, BT, BD, EVEN, False, False)
        else:
            b_y = _taps(p_x, sx_t, p_conv, w, o_t, o_c, m_d, T, o_t, W, BT, BD, EVEN, True, False)
        b_y = b_y * tl.sigmoid(b_y)
        b_y = b_y.to(q.dtype.element_ty).to(tl.float32)  # the conv output is rounded before the l2 norm reads it
        if is_qk:
            b_rstd = 1 / tl.sqrt(tl.sum(b_y * b_y, 1) + EPS)
            b_y = b_y * b_rstd[:, None]
            head = i_c % NQK
            out = tl.where(i_c < NQK, 0, 1)
            p_o = o_t[:, None] * QK + head * KD + o_d[None, :] + i_r.to(tl.int64) * T * QK
            if out == 0:
                tl.store(q + p_o, b_y.to(q.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])
            else:
                tl.store(k + p_o, b_y.to(k.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])
        else:
            nv = C - 2 * QK
            p_o = o_t[:, None] * nv + (i_c - 2 * NQK) * VD + o_d[None, :] + i_r.to(tl.int64) * T * nv
            tl.store(v + p_o, b_y.to(v.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])


@triton.jit
def _branch_conv_kernel(x, sx_r, sx_t, w, conv, s_conv, slots, s_slot, q, k, v, T, pos, b, sb_r, sb_t, beta,
                        QK: tl.constexpr, NQK: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr,
                        C: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, EPS: tl.constexpr,
                        EVEN: tl.constexpr, TILES: tl.constexpr, NCB: tl.constexpr,
                        HB: tl.constexpr, BH: tl.constexpr, PACKED: tl.constexpr):
    # programs side by side take one time tile's heads: whole rows of x and of q, k, v in flight at once
    i_g, i_c, i_r = tl.program_id(0) // (NCB + (HB > 0)), tl.program_id(0) % (NCB + (HB > 0)), tl.program_id(1)
    if i_c == NCB:  # past the NCB channel blocks (only launched with HB > 0): the tiles' beta
        _beta_tiles(b, sb_r, sb_t, beta, i_g, i_r, T, HB, BH, BT, TILES)
    else:
        _conv_tiles(x, sx_r, sx_t, w, conv, s_conv, slots, s_slot, q, k, v, T, pos, i_g, i_c, i_r, QK, NQK, KD, VD,
                    C, W, BT, BD, EPS, EVEN, TILES, PACKED)


def branch_conv(x: torch.Tensor, weight: torch.Tensor, bank_conv: torch.Tensor, slots: torch.Tensor,
                hk: int, dk: int, hv: int, dv: int, b: torch.Tensor | None = None, block_t: int = 4,
                num_warps: int = 1, tiles: int = 1) -> tuple[torch.Tensor, ...]:
    """x [R, T, C] (channel stride 1; C = 2*hk*dk + hv*dv), weight [C, W], bank_conv [E, C, W-1] (the
    document's last W-1 conv inputs), slots: the rows' entries (any stride) -> (q [R,T,hk,dk] and
    k [R,T,hk,dk] l2-normalized, v [R,T,hv,dv], beta), all contiguous; beta = sigmoid(b) [R, T, H] for
    b [R, T, H] (channel stride 1, any row and token strides), None without b. Launch: tiles of `block_t`
    tokens x one head, `tiles` consecutive tiles per program, neighbouring programs over one tile's heads;
    only tiles that reach before the branch read the bank. Defaults from `benchmarks/bench_kernels.py --only
    conv` (NOTES.md 10, 12, 63)."""
    assert bank_conv.stride()[1:] == (weight.shape[1] - 1, 1)
    return _launch(x, weight, bank_conv, slots, None, hk, dk, hv, dv, b, block_t, num_warps, tiles)


def packed_conv(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, hk: int, dk: int, hv: int,
                dv: int, b: torch.Tensor | None = None, block_t: int = 4, num_warps: int = 1,
                tiles: int = 1) -> tuple[torch.Tensor, ...]:
    """The same front end for documents packed in one row x [1, N, C], each starting from a zero conv state:
    `positions` [N] (contiguous) gives each token's position within its document. Prefill's front end."""
    assert positions.is_contiguous() and x.shape[0] == 1
    return _launch(x, weight, weight, positions, positions, hk, dk, hv, dv, b, block_t, num_warps, tiles)


def _launch(x, weight, conv, slots, positions, hk, dk, hv, dv, b, block_t, num_warps, tiles):
    r, t, c = x.shape
    width = weight.shape[1]
    assert x.stride(2) == 1 and weight.is_contiguous() and c == 2 * hk * dk + hv * dv
    q = torch.empty(r, t, hk, dk, dtype=x.dtype, device=x.device)
    k = torch.empty_like(q)
    v = torch.empty(r, t, hv, dv, dtype=x.dtype, device=x.device)
    blocks = 2 * hk + hv
    hb = 0 if b is None else b.shape[2]
    assert b is None or (b.shape[:2] == (r, t) and b.stride(2) == 1)
    beta = None if b is None else torch.empty(r, t, hb, dtype=b.dtype, device=b.device)
    b_arg, beta_arg = (q, q) if b is None else (b, beta)  # without b: placeholders no program touches
    packed = positions is not None
    bd = triton.next_power_of_2(max(dk, dv))
    grid = (triton.cdiv(t, block_t * tiles) * (blocks + (hb > 0)), r)
    _branch_conv_kernel[grid](x, x.stride(0), x.stride(1), weight, conv, conv.stride(0), slots,
                              slots.stride(0), q, k, v, t, positions if packed else slots, b_arg, b_arg.stride(0),
                              b_arg.stride(1), beta_arg, QK=hk * dk, NQK=hk, KD=dk, VD=dv, C=c, W=width,
                              BT=block_t, BD=bd, EPS=L2_EPS, EVEN=dk == bd and dv == bd, TILES=tiles, NCB=blocks,
                              HB=hb, BH=triton.next_power_of_2(max(hb, 1)), num_warps=num_warps, PACKED=packed)
    return q, k, v, beta
