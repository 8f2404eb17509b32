"""Fused WY, state scan and output: the gated delta rule after FLA's solve, one kernel per DeltaNet layer.

The branch path (branches of at most 128 tokens) runs three kernels per DeltaNet layer: our gate cumsum
(`kernels/gate.py`), FLA's kkt + solve kernel (A_inv = (I + A)^-1 of each 64-token chunk and value head,
[R, T, HV, 64]) and this one, in place of FLA's w/u kernel, our indexed scan and FLA's chunk_fwd_o (those
stages, the cuda tests' oracle, are in `tests/fla_oracles.py`). The solve stays out of it: in the first fused
kernel (benchmarks/NOTES.md 18, slower than the stages, removed) it sat on every program's critical path.
One program per (row, value head, block of BV value columns; 64 or 128 on 4 warps by default), grid
(V / BV, R * HV), computes for each chunk, from the state entering it
(h [K, BV]; the first chunk's is the row's state read from the bank entry `index[r * index_stride]`, which is
never written):

- v_new = A_inv (beta v - (beta exp2(g) k) h): FLA's u - w h with A_inv applied once, to the difference,
  rather than to beta exp2(g) k (w, [64, K] of work that every value block would repeat) and to beta v apart;
- o = scale (exp2(g) q h + causal(q k^T exp2(g_i - g_j)) v_new), as FLA's chunk_fwd_o;
- after the first of two chunks, the state exp2(g_last) h + k^T (v_new exp2(g_last - g)) in fp32, as our
  scan computes it.

Chunks are tiles of BT1 and BT2 tokens (16, 32 or 64 by default, `token_tiles`) masked past T: the second chunk
of an 85-token branch reads its 21 tokens and nothing past them. After the first of two chunks the state is
read from the bank again (L2) rather than kept in registers through it, and a state update reads its chunk's
keys again: registers bound these programs (benchmarks/sm90_build.py). The dots take the state and v_new in the
input dtype (where FLA's pipeline stores them between kernels), and beta (v - exp2(g) k h) rounded once where
FLA rounds w and u: with bf16 inputs the two differ by rounding, with fp32 by tf32 dots only.
Torch reference with the same interface: `kevscore.kernels.gdr_ref.branch_wy`.

Sequences of any length run the same chunk step in a loop (`_chunks_wy_kernel`): one program per (sequence,
value head, block of value columns) walks the sequence's 64-token chunks, the state in fp32 registers from
chunk to chunk (`chunks_wy`). Given `cu_seqlens` (prefill), it walks packed documents from a zero
state and writes each one's final state, in place of FLA's w/u kernel, state scan and output kernel (and the h
and v_new they pass between them through memory); without (branches of more than 128 tokens), rows start from
their bank entries read by index, as `branch_wy`'s rows do.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from fla.ops.utils.op import exp2
from triton.tools.tensor_descriptor import TensorDescriptor

from kevscore.kernels.gdr_ref import CHUNK

BC = tl.constexpr(CHUNK)  # A_inv's row length: the solve's chunk
MAX_T = 2 * CHUNK


@triton.jit
def _v_new(b_k, b_h, b_v, b_g, b_b, b_a):
    """The chunk's v_new (fp32) from its keys, values, gate, beta and (I + A)^-1 rows and the entering state
    (in the input dtype): beta (v - exp2(g) k h), the rows' scales after the dot (no scaled copy of k), times
    (I + A)^-1."""
    b_x = (b_v.to(tl.float32) - tl.dot(b_k, b_h) * exp2(b_g)[:, None]) * b_b[:, None]
    return tl.dot(b_a, b_x.to(b_k.dtype))


@triton.jit
def _chunk_out(b_q, b_k, b_h, b_g, b_vn, m_low, scale):
    """The chunk's output (fp32): the entering state's part and the chunk's own, causal within it."""
    dt = b_k.dtype
    b_s = tl.dot(b_q, tl.trans(b_k))
    b_s = tl.where(m_low, b_s * exp2(tl.where(m_low, b_g[:, None] - b_g[None, :], 0.0)), 0.0)
    b_o = tl.dot(b_q, b_h) * exp2(b_g)[:, None]
    return b_o * scale + tl.dot(b_s.to(dt), b_vn.to(dt)) * scale


@triton.jit
def _state_update(b_h, b_kt, b_vn, b_g, g_last):
    """The fp32 state after a chunk: exp2(g_last) h + k^T (v_new exp2(g_last - g))."""
    return b_h * exp2(g_last) + tl.dot(b_kt, (b_vn * exp2(g_last - b_g)[:, None]).to(b_kt.dtype))


@triton.jit
def _chunk(q, k, v, beta, g, a_inv, o, b_h, t0, T, o_v, m_v, scale, H: tl.constexpr, HV: tl.constexpr,
           K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    """Writes the output of the BT tokens from t0 (masked past T) from the state entering them, b_h [K, BV]
    (fp32; the dots take it in the input dtype); returns their v_new (fp32) and cumulative gate, which a state
    update needs (with the keys, which it reads again: `_state_after`)."""
    b_h = b_h.to(k.dtype.element_ty)
    o_t, o_j, o_k = t0 + tl.arange(0, BT), tl.arange(0, BT), tl.arange(0, K)
    m_t = o_t < T
    m_tv = m_t[:, None] & m_v[None, :]
    b_g = tl.load(g + o_t * HV, mask=m_t, other=0.0)
    b_b = tl.load(beta + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
    b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_t[:, None], other=0.0)
    b_v = tl.load(v + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_tv, other=0.0)
    # the chunk's rows of A_inv, read on and below the diagonal of valid rows (nothing else is ever written)
    m_low = (o_j[None, :] <= (o_t - t0)[:, None]) & m_t[:, None]
    b_a = tl.load(a_inv + o_t[:, None] * (HV * BC) + o_j[None, :], mask=m_low, other=0.0)
    b_vn = _v_new(b_k, b_h, b_v, b_g, b_b, b_a)
    b_q = tl.load(q + o_t[:, None] * (H * K) + o_k[None, :], mask=m_t[:, None], other=0.0)
    b_o = _chunk_out(b_q, b_k, b_h, b_g, b_vn, m_low, scale)
    tl.store(o + o_t[:, None] * (HV * V) + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
    return b_vn, b_g


@triton.jit
def _state_after(b_h, k, g, b_vn, b_g, t0, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                 BT: tl.constexpr):
    """The fp32 state after the BT tokens from t0 (masked past T), their keys read again (from L2) rather than
    held through the chunk's output."""
    o_t, o_k = t0 + tl.arange(0, BT), tl.arange(0, K)
    g_last = tl.load(g + (tl.minimum(t0 + BT, T) - 1) * HV)
    b_kt = tl.load(k + o_t[None, :] * (H * K) + o_k[:, None], mask=(o_t < T)[None, :], other=0.0)
    return _state_update(b_h, b_kt, b_vn, b_g, g_last)


@triton.jit(do_not_specialize=["T"])
def _branch_wy_kernel(q, k, v, g, beta, a_inv, bank, index, index_stride, bank_stride, o, T, scale,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                      BT1: tl.constexpr, BT2: tl.constexpr):
    i_v, i_rh = tl.program_id(0), tl.program_id(1)
    i_r, i_h = i_rh // HV, i_rh % HV
    slot = tl.load(index + i_r * index_stride).to(tl.int64)
    q += (i_r * T * H + i_h // (HV // H)).to(tl.int64) * K
    k += (i_r * T * H + i_h // (HV // H)).to(tl.int64) * K
    v += (i_r * T * HV + i_h).to(tl.int64) * V
    o += (i_r * T * HV + i_h).to(tl.int64) * V
    g += (i_r * T * HV + i_h).to(tl.int64)
    beta += (i_r * T * HV + i_h).to(tl.int64)
    a_inv += (i_r * T * HV + i_h).to(tl.int64) * BC

    o_v, o_k = i_v * BV + tl.arange(0, BV), tl.arange(0, K)
    m_v = o_v < V
    p_h = bank + slot * bank_stride + i_h * K * V + o_k[:, None] * V + o_v[None, :]
    b_vn, b_g = _chunk(q, k, v, beta, g, a_inv, o, tl.load(p_h, mask=m_v[None, :], other=0.0), 0, T, o_v, m_v, scale,
                       H, HV, K, V, BT1)
    if BT2 > 0:  # T > 64: the first chunk was full; the state after it, then the second chunk
        b_h = _state_after(tl.load(p_h, mask=m_v[None, :], other=0.0), k, g, b_vn, b_g, 0, T, H, HV, K, BT1)
        _chunk(q, k, v, beta, g, a_inv, o, b_h, BT1, T, o_v, m_v, scale, H, HV, K, V, BT2)


@triton.jit(do_not_specialize=["T"])
def _chunks_wy_kernel(q, k, v, g, beta, a_inv, cu_seqlens, T, bank, index, index_stride, bank_stride, o, scale,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                      PACKED: tl.constexpr, STAGES: tl.constexpr):
    """Every 64-token chunk of a sequence, the state in fp32 registers between them. PACKED: documents from
    cu_seqlens, from a zero state, document d's final state written to `bank[index[d * index_stride]]`; else
    rows of T tokens, row r from `bank[index[r * index_stride]]`, nothing but the output written. q, k, v and
    a_inv are TMA descriptors over [tokens, heads * dim]: a chunk's tiles land in shared memory, STAGES chunks
    ahead, and its keys serve the state update too. Rows past a sequence's end are the next one's or zeros:
    the gate, beta and the output are masked, and (I + A)^-1 is taken on its valid lower triangle only."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    o_v, o_k, o_j = i_v * BV + tl.arange(0, BV), tl.arange(0, K), tl.arange(0, BC)
    m_v = o_v < V
    slot = tl.load(index + i_n * index_stride).to(tl.int64)
    p_h = bank + slot * bank_stride + i_h * K * V + o_k[:, None] * V + o_v[None, :]
    if PACKED:
        bos, eos = tl.load(cu_seqlens + i_n).to(tl.int32), tl.load(cu_seqlens + i_n + 1).to(tl.int32)
        T = eos - bos
        b_h = tl.zeros([K, BV], dtype=tl.float32)
    else:
        bos = i_n * T
        b_h = tl.load(p_h, mask=m_v[None, :], other=0.0)
    g += bos.to(tl.int64) * HV + i_h
    beta += bos.to(tl.int64) * HV + i_h
    o += (bos.to(tl.int64) * HV + i_h) * V
    col_k, col_v = (i_h // (HV // H)) * K, i_h * V + i_v * BV
    for t0 in tl.range(0, T, BC, num_stages=STAGES):
        o_t = t0 + o_j
        m_t = o_t < T
        b_g = tl.load(g + o_t * HV, mask=m_t, other=0.0)
        b_b = tl.load(beta + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
        b_k = k.load([bos + t0, col_k])
        m_low = (o_j[None, :] <= o_j[:, None]) & m_t[:, None]
        b_a = tl.where(m_low, a_inv.load([bos + t0, i_h * BC]), 0.0)
        b_hd = b_h.to(b_k.dtype)
        b_vn = _v_new(b_k, b_hd, v.load([bos + t0, col_v]), b_g, b_b, b_a)
        b_o = _chunk_out(q.load([bos + t0, col_k]), b_k, b_hd, b_g, b_vn, m_low, scale)
        tl.store(o + o_t[:, None] * (HV * V) + o_v[None, :], b_o.to(o.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])
        b_h = _state_update(b_h, tl.trans(b_k), b_vn, b_g, tl.load(g + (tl.minimum(t0 + BC, T) - 1) * HV))
    if PACKED:
        tl.store(p_h, b_h, mask=m_v[None, :])


def token_tiles(t: int, tiles: tuple[int, ...] = (16, 32, 64)) -> tuple[int, int]:
    """The two chunks' token tiles for a branch of t <= 128 tokens, each the smallest of `tiles` (powers of two
    from 16 to 64) that holds its tokens; 0: no second chunk. Below 64 rows the dots take their operands in
    registers (no wgmma); at BV 128 the 32-row tile is still the faster for a short second chunk."""
    tile = lambda n: min(x for x in (*tiles, CHUNK) if x >= n)  # noqa: E731
    return (tile(t), 0) if t <= CHUNK else (CHUNK, tile(t - CHUNK))


def default_block_v(bt1: int, bt2: int, fp32: bool = False) -> int:
    """Value columns per program: 128 where that spills no registers on sm_90a at 4 warps in bf16, else 64 (a
    32-row first tile, two chunks of 64 rows, fp32 operands: benchmarks/sm90_build.py)."""
    return 64 if fp32 or bt1 == 32 or bt2 == CHUNK else 128


def _shapes(q, k, v, g, beta, a_inv, bank) -> tuple[int, ...]:
    """(R, T, H, K, HV, V) of the tensors as `branch_wy` takes them, their layouts checked."""
    (r, t, h, kd), (hv, vd) = k.shape, v.shape[2:]
    assert kd in (16, 32, 64, 128) and hv % h == 0 and q.shape == k.shape
    assert all(x.is_contiguous() for x in (q, k, v, g, beta, a_inv))
    assert g.shape == beta.shape == (r, t, hv) and g.dtype == torch.float32 and a_inv.shape == (r, t, hv, CHUNK)
    assert bank.shape[1:] == (hv, kd, vd) and bank.stride()[1:] == (kd * vd, vd, 1) and bank.dtype == torch.float32
    return r, t, h, kd, hv, vd


def branch_wy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              a_inv: torch.Tensor, bank: torch.Tensor, index: torch.Tensor, index_stride: int | None = None,
              block_v: int | None = None, num_warps: int = 4, num_stages: int = 1,
              tiles: tuple[int, ...] = (16, 32, 64), **options) -> torch.Tensor:
    """o [R, T, HV, V] (v's dtype) of branches of T <= 128 tokens, row r from `bank[index[r * index_stride]]`.

    q, k [R, T, H, K] l2-normalized, v [R, T, HV, V], beta [R, T, HV]: contiguous, as `branch_conv` writes
    them; g [R, T, HV] fp32, the chunk-local cumulative gate in log2 (`gate.gate_cumsum`); a_inv
    [R, T, HV, 64] in k's dtype as FLA's kkt + solve kernel writes it (only its lower triangles are read);
    bank [E, HV, K, V] fp32 (any entry stride), never written; index: int tensor read at `r * index_stride`.
    Launch: block_v value columns per program (None: `default_block_v`), warps, and the chunks' token tiles
    (`token_tiles`), and Triton's other launch options (e.g. maxnreg); benchmarks/bench_kernels.py --only "fused
    wy" sweeps them, sm90_build.py reports their registers."""
    r, t, h, kd, hv, vd = _shapes(q, k, v, g, beta, a_inv, bank)
    assert 0 < t <= MAX_T
    stride = index.stride(0) if index_stride is None else index_stride
    bt1, bt2 = token_tiles(t, tiles)
    bv = min(block_v or default_block_v(bt1, bt2, v.dtype == torch.float32), triton.next_power_of_2(vd))
    # Triton 3.6 (the H200's) computes the output's bf16 S v_new dot wrong with 32 value columns on 4 warps
    num_warps = num_warps if bv >= 64 else max(num_warps, 8)
    o = torch.empty_like(v)
    _branch_wy_kernel[(triton.cdiv(vd, bv), r * hv)](
        q, k, v, g, beta, a_inv, bank, index, stride, bank.stride(0), o, t, kd ** -0.5, H=h, HV=hv, K=kd, V=vd,
        BV=bv, BT1=bt1, BT2=bt2, num_warps=num_warps, num_stages=num_stages, **options)
    return o


def chunks_wy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              a_inv: torch.Tensor, bank: torch.Tensor, index: torch.Tensor, index_stride: int | None = None,
              cu_seqlens: torch.Tensor | None = None, block_v: int = 64, num_warps: int = 4,
              num_stages: int | None = None, **options) -> torch.Tensor:
    """o [R, T, HV, V] (v's dtype), every 64-token chunk of a sequence in one program (`_chunks_wy_kernel`),
    tensors as `branch_wy` takes them. Rows (branches of any length): row r from `bank[index[r * index_stride]]`,
    never written. Packed documents (`cu_seqlens` [D + 1] their bounds; R = 1, T = N, g and a_inv chunked per
    document as FLA's varlen gate cumsum and solve give them): each from a zero state, document d's final state
    [HV, K, V] written into `bank[index[d * index_stride]]` (fp32, any entry stride). `num_stages`: the chunks'
    tiles in flight (None: 2, or 1 for fp32 operands, whose tiles would not fit twice); `options`: Triton's other
    launch options (e.g. maxnreg); bench_kernels.py --only "prefill wy" sweeps the launches."""
    r, t, h, kd, hv, vd = _shapes(q, k, v, g, beta, a_inv, bank)
    # Triton 3.6 (the H200's) computes this kernel wrong in bf16 at 32 value columns, on 4 warps or 8: narrow
    # value heads take a block of 64, masked
    assert block_v >= 64, "the chunk loop takes blocks of at least 64 value columns"
    bv = min(block_v, max(64, triton.next_power_of_2(vd)))
    packed = cu_seqlens is not None
    sequences = cu_seqlens.shape[0] - 1 if packed else r
    assert not packed or (r == 1 and index.shape == (sequences,))
    stride = index.stride(0) if index_stride is None else index_stride
    o = torch.empty_like(v)
    stages = num_stages or (1 if k.dtype == torch.float32 else 2)
    tiles = [TensorDescriptor(x, [r * t, x.shape[2] * x.shape[3]], [x.shape[2] * x.shape[3], 1], [CHUNK, cols])
             for x, cols in ((q, kd), (k, kd), (v, bv), (a_inv, CHUNK))]
    _chunks_wy_kernel[(triton.cdiv(vd, bv), sequences * hv)](
        *tiles[:3], g, beta, tiles[3], cu_seqlens, t, bank, index, stride, bank.stride(0), o, kd ** -0.5, H=h,
        HV=hv, K=kd, V=vd, BV=bv, PACKED=packed, STAGES=stages, num_warps=num_warps, num_stages=stages, **options)
    return o
