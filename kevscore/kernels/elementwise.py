"""Row-tiled elementwise kernels: SwiGLU, RMSNorm with the residual add, q/k norm + rotary, gated norms.

Row-tiled elementwise kernels for the fused GPU path: SwiGLU over the gate|up projection output, the
residual stream's RMSNorm (with the residual add), and the attention layer's per-head RMSNorm + partial
rotary of q and k in one pass.

`swiglu_rows` does the arithmetic of FLA 0.5.2's `swiglu_fwd` (fp32 `x * sigmoid(x) * y`, one rounding),
tiled over rows and columns so that every load and store is a contiguous vector (FLA's kernel indexes the
flattened tensor and divides by the row length per element). `qk_norm_rope` reads q straight out of the
q|gate projection output (strided heads), normalizes each head in fp32, rotates its first `rotary_dim`
channels NeoX-style with fp32 cos/sin and rounds once; it replaces the norm, the `.contiguous()` copy and the
five-kernel torch rotary (slices, negation, two concatenations) of each tensor.
`gated_rms_norm_heads` is DeltaNet's output norm reading its gate in place from the projection output.
`sigmoid_gate` is the attention prefill's output gate, reading the gate in place from the q|gate projection
output and each token's attention output wherever the attention left it (a padded batch: the unpadding gather).
`rms_norm_rows` is FLA's `rms_norm` arithmetic (fp32 sum of squares over the row, one rounding) with nothing
that depends on the token count at compile time: FLA's kernel takes `cdiv(tokens, 2048)` as a constexpr and
autotune key, so each new group or batch size compiled (and tuned) it again.
Launch defaults: `benchmarks/bench_kernels.py` on the H200 (benchmarks/NOTES.md 8).
Torch references: `torch_ops.swiglu`, `torch_ops.rms_norm` + `torch_ops.rotary`, `torch_ops.gated_rms_norm`,
`x * torch.sigmoid(gate)`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _swiglu_kernel(x, o, n_rows, sx, N_IN: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    i_c, i_r = tl.program_id(0), tl.program_id(1)
    o_r = i_r * BR + tl.arange(0, BR)
    o_c = i_c * BC + tl.arange(0, BC)
    m = (o_r < n_rows)[:, None] & (o_c < N_IN)[None, :]
    p_x = x + o_r[:, None].to(tl.int64) * sx + o_c[None, :]
    b_g = tl.load(p_x, mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(p_x + N_IN, mask=m, other=0.0).to(tl.float32)
    b_o = b_g * tl.sigmoid(b_g) * b_u
    tl.store(o + o_r[:, None].to(tl.int64) * N_IN + o_c[None, :], b_o.to(o.dtype.element_ty), mask=m)


def swiglu_rows(gate_up: torch.Tensor, block_rows: int = 2, block_cols: int = 1024, num_warps: int = 8) -> torch.Tensor:
    """gate_up [..., 2I] (last dim contiguous, leading dims flattenable) -> silu(gate) * up [..., I], contiguous."""
    inner = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * inner)
    assert x.stride(1) == 1
    out = torch.empty(*gate_up.shape[:-1], inner, dtype=gate_up.dtype, device=gate_up.device)
    n = x.shape[0]
    bc = min(block_cols, triton.next_power_of_2(inner))
    grid = (triton.cdiv(inner, bc), triton.cdiv(n, block_rows))
    _swiglu_kernel[grid](x, out, n, x.stride(0), N_IN=inner, BR=block_rows, BC=bc, num_warps=num_warps)
    return out


@triton.jit
def _rms_norm_kernel(x, w, y, n_rows, eps, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m = (o_r < n_rows)[:, None] & m_d[None, :]
    p = o_r[:, None].to(tl.int64) * D + o_d[None, :]
    b_x = tl.load(x + p, mask=m, other=0.0).to(tl.float32)
    b_rstd = 1 / tl.sqrt(tl.sum(b_x * b_x, 1) / D + eps)
    b_y = b_x * b_rstd[:, None] * tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    tl.store(y + p, b_y.to(y.dtype.element_ty), mask=m)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, block_rows: int = 4,
                  num_warps: int = 8) -> torch.Tensor:
    """RMSNorm of the rows of x [..., D] (contiguous) times `weight` [D] (fp32), in x's dtype."""
    d = x.shape[-1]
    assert x.is_contiguous() and weight.is_contiguous()
    n = x.numel() // d
    y = torch.empty_like(x)
    _rms_norm_kernel[(triton.cdiv(n, block_rows),)](x, weight, y, n, eps, D=d, BD=triton.next_power_of_2(d),
                                                    BR=block_rows, num_warps=num_warps)
    return y


def token_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x [..., H, D] as N token rows [N, H, D] (a view where its leading dims flatten to one stride), and N, H, D."""
    flat = x.flatten(0, -3) if x.dim() > 2 else x[None]
    return flat, *flat.shape


@triton.jit(do_not_specialize=["n_tok"])  # one compile for every token count
def _qk_norm_rope_kernel(x, sx_t, sx_h, w, cos, sin, o, n_tok, eps,
                         H: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < n_tok
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    half: tl.constexpr = ROT // 2
    # the channel each output channel rotates with: d + half in the first half, d - half in the second
    o_p = tl.where(o_d < half, o_d + half, tl.where(o_d < ROT, o_d - half, o_d))
    m = m_t[:, None] & m_d[None, :]
    p_x = x + o_t[:, None].to(tl.int64) * sx_t + i_h * sx_h
    b_x = tl.load(p_x + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_p = tl.load(p_x + o_p[None, :], mask=m, other=0.0).to(tl.float32)
    b_rstd = 1 / tl.sqrt(tl.sum(b_x * b_x, 1) / D + eps)
    b_y = b_x * b_rstd[:, None] * tl.load(w + o_d, mask=m_d, other=0.0)[None, :]
    b_yp = b_p * b_rstd[:, None] * tl.load(w + o_p, mask=m_d, other=0.0)[None, :]
    m_r = m_t[:, None] & (o_d < ROT)[None, :]
    p_cs = o_t[:, None].to(tl.int64) * ROT + o_d[None, :]
    b_cos = tl.load(cos + p_cs, mask=m_r, other=1.0)
    b_sin = tl.load(sin + p_cs, mask=m_r, other=0.0)
    sign = tl.where(o_d < half, -1.0, 1.0)
    b_o = b_y * b_cos + sign[None, :] * b_yp * b_sin
    tl.store(o + (o_t[:, None].to(tl.int64) * H + i_h) * D + o_d[None, :], b_o.to(o.dtype.element_ty), mask=m)


def qk_norm_rope(x: torch.Tensor, scale: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                 block_t: int = 32, num_warps: int = 8) -> torch.Tensor:
    """x [..., H, D] (channels contiguous, heads and tokens at any stride; leading dims that do not flatten to one
    token stride are copied first),
    scale [D] fp32 (1 + the norm weight), cos/sin [..., rotary_dim] fp32 -> rotary(rms_norm(x)) packed
    [..., H, D] in x's dtype."""
    flat, n, h, d = token_rows(x)
    rot = cos.shape[-1]
    assert flat.stride(2) == 1 and rot % 2 == 0 and rot <= d
    cos, sin = cos.reshape(-1, rot).contiguous(), sin.reshape(-1, rot).contiguous()
    assert cos.shape[0] == n and scale.is_contiguous()
    out = torch.empty(*x.shape, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_t), h)
    _qk_norm_rope_kernel[grid](flat, flat.stride(0), flat.stride(1), scale, cos, sin, out, n, eps, H=h, D=d,
                               ROT=rot, BD=triton.next_power_of_2(d), BT=block_t, num_warps=num_warps)
    return out


@triton.jit
def _gated_norm_kernel(x, z, sz_t, w, o, n_tok, eps, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                       BT: tl.constexpr):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m = (o_t < n_tok)[:, None] & m_d[None, :]
    p_x = (o_t[:, None].to(tl.int64) * H + i_h) * D + o_d[None, :]
    b_x = tl.load(x + p_x, mask=m, other=0.0).to(tl.float32)
    b_z = tl.load(z + o_t[:, None].to(tl.int64) * sz_t + i_h * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_rstd = 1 / tl.sqrt(tl.sum(b_x * b_x, 1) / D + eps)
    b_y = b_x * b_rstd[:, None] * tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    b_y = b_y * b_z * tl.sigmoid(b_z)
    tl.store(o + p_x, b_y.to(o.dtype.element_ty), mask=m)


def gated_rms_norm_heads(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                         block_t: int = 16, num_warps: int = 4) -> torch.Tensor:
    """DeltaNet's output norm, FLA `rms_norm_gated` arithmetic (swish): per head, w * x * rstd, then times
    silu(gate). x [..., H, D] contiguous; gate [..., H, D] with heads packed and tokens at one stride (a
    slice of the projection output, read in place: FLA's kernel would copy it) -> [..., H, D]."""
    flat, n, h, d = token_rows(gate)
    assert x.is_contiguous() and gate.shape == x.shape and gate.stride(-1) == 1 and gate.stride(-2) == d
    out = torch.empty_like(x)
    grid = (triton.cdiv(n, block_t), h)
    _gated_norm_kernel[grid](x, flat, flat.stride(0), weight, out, n, eps, H=h, D=d, BD=triton.next_power_of_2(d),
                             BT=block_t, num_warps=num_warps)
    return out


@triton.jit(do_not_specialize=["L", "n_tok"])  # one compile for every token count and padded length
def _sigmoid_gate_kernel(x, index, sx_b, sx_l, sx_h, L, g, sg_t, sg_h, o, n_tok, H: tl.constexpr, D: tl.constexpr,
                         BD: tl.constexpr, BT: tl.constexpr, INDEXED: tl.constexpr):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < n_tok
    o_d = tl.arange(0, BD)
    m = m_t[:, None] & (o_d < D)[None, :]
    place = tl.load(index + o_t, mask=m_t, other=0).to(tl.int64) if INDEXED else o_t.to(tl.int64)
    p_x = x + (place // L * sx_b + place % L * sx_l)[:, None] + i_h * sx_h + o_d[None, :]
    b_x = tl.load(p_x, mask=m, other=0.0).to(tl.float32)
    b_g = tl.load(g + o_t[:, None].to(tl.int64) * sg_t + i_h * sg_h + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(o + (o_t[:, None].to(tl.int64) * H + i_h) * D + o_d[None, :], (b_x * tl.sigmoid(b_g)).to(o.dtype.element_ty),
             mask=m)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor, index: torch.Tensor | None = None, block_t: int = 16,
                 num_warps: int = 4) -> torch.Tensor:
    """x * sigmoid(gate), rounded once, for N packed tokens: gate [..., H, D] (channels contiguous, heads at any
    stride, leading dims flattening to one token stride: a slice of the projection output, read in place); x
    [B, L, H, D] at any strides with contiguous channels, token n at place index[n] of its flattened B x L (None:
    n) -> [..., H, D] contiguous, x's dtype."""
    flat, n, h, d = token_rows(gate)
    assert x.dim() == 4 and x.shape[2:] == (h, d) and x.stride(3) == 1 and flat.stride(2) == 1
    assert (x.shape[0] * x.shape[1] if index is None else index.numel()) == n
    out = torch.empty(gate.shape, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_t), h)
    _sigmoid_gate_kernel[grid](x, x if index is None else index, x.stride(0), x.stride(1), x.stride(2), x.shape[1], flat,
                               flat.stride(0), flat.stride(1), out, n, H=h, D=d, BD=triton.next_power_of_2(d),
                               BT=block_t, INDEXED=index is not None, num_warps=num_warps)
    return out
