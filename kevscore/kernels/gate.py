"""The DeltaNet decay gate, summed within each chunk in log2 units, in one Triton kernel.

The DeltaNet decay gate as the chunked gated delta rule consumes it: per token and value head
g = -exp(A_log) * softplus(a + dt_bias), summed within each 64-token chunk and scaled to log2 units, for
packed documents (chunks restart at each document) and for rows of equal length. FLA's gate kernel's
arithmetic, reading `a` in place from the projection output (FLA copies it first), and ours so that a job
never imports FLA's gate module, whose `torch.compiler.disable` imports torch's dynamo (seconds at start).
`gdr_ref.chunk_cumsum(gdr_ref.gate_decay(...))` is its torch reference."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from fla.ops.utils.op import exp
from fla.ops.utils.softplus import softplus


@triton.jit(do_not_specialize=["T", "stride_b", "stride_t"])
def _gate_cumsum_kernel(a, A_log, dt_bias, out, scale, cu_seqlens, chunk_indices, T, stride_b, stride_t,
                        H: tl.constexpr, BT: tl.constexpr, VARLEN: tl.constexpr):
    i_c, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    if VARLEN:  # packed documents in one row: chunk i_c is chunk c of document n
        n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
        i_c = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + n).to(tl.int64)
        T = tl.load(cu_seqlens + n + 1).to(tl.int64) - bos
    else:
        bos = i_b * T
    t = i_c * BT + tl.arange(0, BT)
    mask = t < T
    if VARLEN:
        src = a + (bos + t) * stride_t + i_h
    else:
        src = a + i_b * stride_b + t * stride_t + i_h
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32) + tl.load(dt_bias + i_h).to(tl.float32)
    g = -exp(tl.load(A_log + i_h).to(tl.float32)) * softplus(x)
    tl.store(out + (bos + t) * H + i_h, tl.cumsum(g, axis=0) * scale, mask=mask)


def gate_cumsum(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, chunk: int, scale: float,
                cu_seqlens: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None) -> torch.Tensor:
    """a [B, T, H] (any token and row strides, unit stride over heads) -> fp32 [B, T, H], contiguous. With
    `cu_seqlens` and `chunk_indices` (FLA's layout: (document, chunk) pairs), B is 1 and T packs documents."""
    B, T, H = a.shape
    assert a.stride(-1) == 1, "heads must be contiguous"
    out = torch.empty(B, T, H, device=a.device, dtype=torch.float32)
    varlen = cu_seqlens is not None
    chunks = chunk_indices.shape[0] if varlen else triton.cdiv(T, chunk)
    if chunks and H:
        _gate_cumsum_kernel[(chunks, B * H)](a, A_log, dt_bias, out, scale, cu_seqlens, chunk_indices, T,
                                             a.stride(0), a.stride(1), H=H, BT=chunk, VARLEN=varlen,
                                             num_warps=1)
    return out
