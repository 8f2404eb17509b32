"""The indexed state scan: the gated delta rule's state recurrence reading each row's state in place.

Indexed state scan: the chunked gated-delta-rule state recurrence, reading each row's initial state
straight from the state bank at `bank + index[row * index_stride] * bank_stride`.

It replaces only the state-scan stage of FLA 0.5.2's chunk pipeline (`chunk_gated_delta_rule_fwd_h`)
and does the same arithmetic in the same order, with the same launch configuration as FLA's autotuned
kernel, so it gives bit-identical `h` and `v_new` to FLA's scan on gathered initial states. It never
writes a final state, so rows sharing an entry cannot advance or overwrite it, and it skips the update after
the last chunk, whose only output would be that final state (for a branch of one chunk, the whole update).
Torch reference with the same interface: `kevscore.kernels.gdr_ref.state_scan_indexed`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from fla.ops.utils.op import exp2

from kevscore.kernels.gdr_ref import CHUNK
from kevscore.kernels.tuning import autotuner


@triton.jit
def _publish_and_predict(p_h, w, v, v_new, b_h1, b_h2, b_h3, b_h4, i_t, T, o_v, m_v, o_k1, o_k2, o_k3, o_k4,
                         m_k1, m_k2, m_k3, m_k4, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BT: tl.constexpr):
    """Store the state entering chunk i_t at p_h, then its values corrected by that state: v_new = v - w @ h.
    Returns them in fp32, with the chunk's token offsets and mask.

    The chunk's w is loaded before h is stored: Triton does not move a load above a store to another pointer
    (they might alias), and after the store it would wait for the state load behind it; issued first, both
    are in flight together. v is loaded after the store, under the dots: loaded first too, it would raise the
    kernel's registers enough to cost a program per SM (benchmarks/NOTES.md 13). The arithmetic is unchanged."""
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    m_tv = m_t[:, None] & m_v[None, :]
    p_w = w + o_t[:, None] * (HV * K)
    b_w1 = tl.load(p_w + o_k1[None, :], mask=m_t[:, None] & m_k1[None, :], other=0.0)
    if K > 64:
        b_w2 = tl.load(p_w + o_k2[None, :], mask=m_t[:, None] & m_k2[None, :], other=0.0)
    if K > 128:
        b_w3 = tl.load(p_w + o_k3[None, :], mask=m_t[:, None] & m_k3[None, :], other=0.0)
    if K > 192:
        b_w4 = tl.load(p_w + o_k4[None, :], mask=m_t[:, None] & m_k4[None, :], other=0.0)
    tl.store(p_h + o_k1[:, None] * V, b_h1.to(p_h.dtype.element_ty), mask=m_k1[:, None] & m_v[None, :])
    if K > 64:
        tl.store(p_h + o_k2[:, None] * V, b_h2.to(p_h.dtype.element_ty), mask=m_k2[:, None] & m_v[None, :])
    if K > 128:
        tl.store(p_h + o_k3[:, None] * V, b_h3.to(p_h.dtype.element_ty), mask=m_k3[:, None] & m_v[None, :])
    if K > 192:
        tl.store(p_h + o_k4[:, None] * V, b_h4.to(p_h.dtype.element_ty), mask=m_k4[:, None] & m_v[None, :])
    b_u = tl.load(v + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_tv, other=0.0)
    b_v = tl.dot(b_w1, b_h1.to(b_w1.dtype))
    if K > 64:
        b_v += tl.dot(b_w2, b_h2.to(b_w2.dtype))
    if K > 128:
        b_v += tl.dot(b_w3, b_h3.to(b_w3.dtype))
    if K > 192:
        b_v += tl.dot(b_w4, b_h4.to(b_w4.dtype))
    b_v = b_u - b_v
    tl.store(v_new + o_t[:, None] * (HV * V) + o_v[None, :], b_v.to(v_new.dtype.element_ty), mask=m_tv)
    return b_v, o_t, m_t


@triton.jit(do_not_specialize=["T"])
def _indexed_scan_kernel(k, v, w, v_new, g, h, bank, index, index_stride, bank_stride, T,
                         H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BT: tl.constexpr, BV: tl.constexpr, FINAL_UPDATE: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    bos = i_n * T
    NT = tl.cdiv(T, BT)

    # the row's initial state lives in the bank entry named by its index
    slot = tl.load(index + i_n * index_stride).to(tl.int64)
    h0 = bank + slot * bank_stride + i_h * K * V

    h += ((i_n * NT) * HV + i_h).to(tl.int64) * K * V
    v += (bos * HV + i_h).to(tl.int64) * V
    k += (bos * H + i_h // (HV // H)).to(tl.int64) * K
    w += (bos * HV + i_h).to(tl.int64) * K
    v_new += (bos * HV + i_h).to(tl.int64) * V

    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_k1 = tl.arange(0, 64)
    o_k2, o_k3, o_k4 = 64 + o_k1, 128 + o_k1, 192 + o_k1
    m_k1, m_k2, m_k3, m_k4 = o_k1 < K, o_k2 < K, o_k3 < K, o_k4 < K

    # state blocks of 64 key rows each, accumulated from zero as FLA does (blocks past K stay unused zeros)
    b_h1 = tl.zeros([64, BV], dtype=tl.float32)
    b_h2 = tl.zeros([64, BV], dtype=tl.float32)
    b_h3 = tl.zeros([64, BV], dtype=tl.float32)
    b_h4 = tl.zeros([64, BV], dtype=tl.float32)
    b_h1 += tl.load(h0 + o_k1[:, None] * V + o_v[None, :], mask=m_k1[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    if K > 64:
        b_h2 += tl.load(h0 + o_k2[:, None] * V + o_v[None, :], mask=m_k2[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    if K > 128:
        b_h3 += tl.load(h0 + o_k3[:, None] * V + o_v[None, :], mask=m_k3[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    if K > 192:
        b_h4 += tl.load(h0 + o_k4[:, None] * V + o_v[None, :], mask=m_k4[:, None] & m_v[None, :], other=0.0).to(tl.float32)

    # every chunk but the last: publish, predict, update. The update after the last chunk would only feed
    # the final state, which is never written, so the last chunk is peeled off below without it (a loop
    # rather than a branch around the dots: Triton 3.6 cannot compile the latter for fp32 on 2 warps).
    # Not software-pipelined: at 64 tokens the loop never runs, and pipelining's staging buffers would nearly
    # triple the kernel's shared memory (benchmarks/NOTES.md 13). The arithmetic and the bits are the same.
    for i_t in tl.range(0, NT if FINAL_UPDATE else NT - 1, num_stages=1):
        b_v, o_t, m_t = _publish_and_predict(h + o_v[None, :], w, v, v_new, b_h1, b_h2, b_h3, b_h4, i_t, T, o_v,
                                             m_v, o_k1, o_k2, o_k3, o_k4, m_k1, m_k2, m_k3, m_k4, HV, K, V, BT)
        h += HV * K * V  # the next chunk's state (64-bit pointer arithmetic)

        # decay the state to the chunk's end and the new values to their distance from it
        last = min((i_t + 1) * BT, T) - 1
        b_g_last = tl.load(g + (bos * HV + last * HV + i_h).to(tl.int64)).to(tl.float32)
        b_g = tl.load(g + (bos * HV + i_h).to(tl.int64) + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
        b_v = b_v * tl.where(m_t, exp2(b_g_last - b_g), 0)[:, None]
        b_g_last = exp2(b_g_last)
        b_h1 *= b_g_last
        if K > 64:
            b_h2 *= b_g_last
        if K > 128:
            b_h3 *= b_g_last
        if K > 192:
            b_h4 *= b_g_last
        b_v = b_v.to(k.dtype.element_ty)

        # add the chunk's keys times its corrected values
        b_k = tl.load(k + o_k1[:, None] + o_t[None, :] * (H * K), mask=m_k1[:, None] & m_t[None, :], other=0.0)
        b_h1 += tl.dot(b_k, b_v)
        if K > 64:
            b_k = tl.load(k + o_k2[:, None] + o_t[None, :] * (H * K), mask=m_k2[:, None] & m_t[None, :], other=0.0)
            b_h2 += tl.dot(b_k, b_v)
        if K > 128:
            b_k = tl.load(k + o_k3[:, None] + o_t[None, :] * (H * K), mask=m_k3[:, None] & m_t[None, :], other=0.0)
            b_h3 += tl.dot(b_k, b_v)
        if K > 192:
            b_k = tl.load(k + o_k4[:, None] + o_t[None, :] * (H * K), mask=m_k4[:, None] & m_t[None, :], other=0.0)
            b_h4 += tl.dot(b_k, b_v)
    if not FINAL_UPDATE:  # the last chunk: publish and predict only
        _publish_and_predict(h + o_v[None, :], w, v, v_new, b_h1, b_h2, b_h3, b_h4, NT - 1, T, o_v, m_v,
                             o_k1, o_k2, o_k3, o_k4, m_k1, m_k2, m_k3, m_k4, HV, K, V, BT)


_FLA_CONFIGS: dict[tuple, triton.Config] = {}


def fla_scan_config(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g: torch.Tensor) -> triton.Config:
    """The launch configuration FLA's autotuned scan uses for these shapes and dtypes.

    Our kernel must run with it: block shape and warp count decide how the dots are computed, and so the
    bits. If FLA has not tuned this key yet, it is tuned now by one FLA scan on these inputs."""
    from fla.ops.common import chunk_delta_h

    key = (k.shape[2], u.shape[2], k.shape[3], u.shape[3], k.dtype, w.dtype, u.dtype, g.dtype)
    if key not in _FLA_CONFIGS:
        h0 = torch.zeros(u.shape[0], u.shape[2], k.shape[3], u.shape[3], dtype=torch.float32, device=k.device)
        chunk_delta_h.chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, initial_state=h0, chunk_size=CHUNK)
        _FLA_CONFIGS[key] = autotuner(chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64).best_config
    return _FLA_CONFIGS[key]


def state_scan_indexed(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g: torch.Tensor, bank: torch.Tensor,
                       index: torch.Tensor, index_stride: int | None = None,
                       config: triton.Config | None = None,
                       final_update: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [R, NT, HV, K, V], v_new [R, T, HV, V]) with row r starting from `bank[index[r * index_stride]]`.

    k [R, T, H, K]; w [R, T, HV, K]; u [R, T, HV, V]; g [R, T, HV] chunk-local cumulative gate (log2);
    bank [E, HV, K, V] fp32 (any entry stride); index: int tensor read at `r * index_stride`.
    final_update: also run the last chunk's state update, as FLA does (its result is dropped; benchmarks only).
    """
    r, t, h, kd = k.shape
    hv, vd = u.shape[2], u.shape[3]
    assert kd <= 256 and all(x.is_contiguous() for x in (k, w, u, g))
    assert bank.shape[1:] == (hv, kd, vd) and bank.stride()[1:] == (kd * vd, vd, 1) and bank.dtype == torch.float32
    stride = index.stride(0) if index_stride is None else index_stride
    config = config or fla_scan_config(k, w, u, g)
    nt = triton.cdiv(t, CHUNK)
    out_h = k.new_empty(r, nt, hv, kd, vd)
    v_new = torch.empty_like(u)
    grid = (triton.cdiv(vd, config.kwargs["BV"]), r * hv)
    _indexed_scan_kernel[grid](k, u, w, v_new, g, out_h, bank, index, stride, bank.stride(0), t,
                               H=h, HV=hv, K=kd, V=vd, BT=CHUNK, BV=config.kwargs["BV"],
                               FINAL_UPDATE=final_update, num_warps=config.num_warps, num_stages=config.num_stages)
    return out_h, v_new
