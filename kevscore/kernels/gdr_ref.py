"""Torch reference of the chunked gated delta rule, split into FLA 0.5.2's four forward stages.

Stages and tensor layouts follow `fla.ops.gated_delta_rule.chunk_gated_delta_rule_fwd`:
gate cumsum (log2 space) -> WY representation (w, u) -> state scan (h, v_new) -> output.
Shapes: q, k [R, T, H, K]; v, u [R, T, HV, V]; w [R, T, HV, K]; g, beta [R, T, HV];
h [R, NT, HV, K, V] (the state entering each chunk); states [N, HV, K, V] in fp32.
Every function computes in fp32. `torch_ops.gdr_branch` composes the four stages for branches; `branch_wy`, the
stages after the solve (`chunk_inverse`), has the interface of the fused kernel in `kevscore.kernels.branch_wy`:
row r's initial state is `bank[index[r * index_stride]]` (`bank_rows`), as the fused kernels read it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

RCP_LN2 = 1.0 / math.log(2.0)
CHUNK = 64


def chunk_size(t: int) -> int:
    """For a sequence of t tokens: FLA's 64-token chunks, or one chunk of its own length when shorter (the
    CPU path's choice: a short branch costs t x t blocks, not 64 x 64, the same arithmetic without padding).
    Every stage takes `chunk` (default FLA's 64, which the reference and the demo's training keep)."""
    return max(1, min(CHUNK, t))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _chunks(x: torch.Tensor, chunk: int, gate: bool = False) -> torch.Tensor:
    """[R, T, ...] -> [R, NT, chunk, ...], padded at the end with zeros, or for a cumulative gate with
    its last value (so padded decays stay <= 1, as FLA's masked loads make them)."""
    x, pad = x.float(), -x.shape[1] % chunk
    if pad:
        fill = x[:, -1:].expand(-1, pad, *x.shape[2:]) if gate else x.new_zeros(x.shape[0], pad, *x.shape[2:])
        x = torch.cat([x, fill], 1)
    return x.view(x.shape[0], x.shape[1] // chunk, chunk, *x.shape[2:])


def repeat_heads(k: torch.Tensor, hv: int) -> torch.Tensor:
    """k [R, T, H, K] with each key head repeated for its value heads: [R, T, HV, K] (itself when H == HV)."""
    return k.repeat_interleave(hv // k.shape[2], dim=2) if k.shape[2] != hv else k


def chunk_cumsum(g: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """Chunk-local cumulative sum of the log decay, scaled to log2 space: [R, T, HV]."""
    return (_chunks(g, chunk).cumsum(2) * RCP_LN2).flatten(1, 2)[:, :g.shape[1]]


def _masked_decay(gc: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """exp2(g_i - g_j) as [R, NT, HV, i, j], 0 where `keep` is false. Masking the exponent (not the
    product) keeps the kept values bit-identical and the gradient finite: the dropped exponents are
    positive and can overflow, and inf * 0 in a backward pass is NaN."""
    diff = (gc.unsqueeze(3) - gc.unsqueeze(2)).permute(0, 1, 4, 2, 3)
    return torch.exp2(diff.masked_fill(~keep, -math.inf))


def _unit_lower(kc: torch.Tensor, gc: torch.Tensor, bc: torch.Tensor) -> torch.Tensor:
    """I + strictly_lower(beta_i k_i.k_j exp2(g_i - g_j)) of each chunk: [R, NT, HV, C, C] from chunked k, g, beta."""
    c = kc.shape[2]
    kk = torch.einsum("rnihk,rnjhk->rnhij", kc, kc)
    lower = torch.ones(c, c, dtype=torch.bool, device=kc.device).tril(-1)
    decay = _masked_decay(gc, lower)  # [R, NT, HV, i, j]
    a = (kk * decay * bc.permute(0, 1, 3, 2).unsqueeze(-1)).masked_fill(~lower, 0.0)
    return a + torch.eye(c, device=kc.device)


def wy_repr(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """w = A (beta k exp2(g)), u = A (beta v) with A = (I + strictly_lower(beta k k^T exp2(g_i - g_j)))^-1."""
    t, hv, c = k.shape[1], v.shape[2], chunk
    kc = _chunks(repeat_heads(k, hv), c)  # [R, NT, C, HV, K]
    vc, gc, bc = _chunks(v, c), _chunks(g, c, gate=True), _chunks(beta, c)
    a = _unit_lower(kc, gc, bc)
    kb = (kc * (bc * torch.exp2(gc)).unsqueeze(-1)).permute(0, 1, 3, 2, 4)  # [R, NT, HV, C, K]
    vb = (vc * bc.unsqueeze(-1)).permute(0, 1, 3, 2, 4)
    w = torch.linalg.solve_triangular(a, kb, upper=False, unitriangular=True)
    u = torch.linalg.solve_triangular(a, vb, upper=False, unitriangular=True)
    unchunk = lambda x: x.permute(0, 1, 3, 2, 4).flatten(1, 2)[:, :t]  # noqa: E731
    return unchunk(w), unchunk(u)


def chunk_inverse(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """What FLA's kkt + solve kernel writes: row t of its 64-token chunk's (I + strictly_lower(beta k k^T
    exp2(g_i - g_j)))^-1, [R, T, HV, 64] (columns past the row's own token zero); k [R, T, H, K]."""
    t, c = k.shape[1], CHUNK
    k = repeat_heads(k, beta.shape[2])
    a = _unit_lower(_chunks(k, c), _chunks(g, c, gate=True), _chunks(beta, c))
    eye = torch.eye(c, device=k.device).expand_as(a)
    inverse = torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)  # [R, NT, HV, C, C]
    return inverse.permute(0, 1, 3, 2, 4).flatten(1, 2)[:, :t]


def wy_from_inverse(k, v, g, beta, a_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, u) = (A_inv (beta k exp2(g)), A_inv (beta v)) per 64-token chunk, given `chunk_inverse`'s A_inv."""
    t, c = k.shape[1], CHUNK
    ac = _chunks(a_inv, c).permute(0, 1, 3, 2, 4)  # [R, NT, HV, i, j]
    kb = _chunks(k * (beta * torch.exp2(g)).unsqueeze(-1), c)
    vb = _chunks(v * beta.unsqueeze(-1), c)
    return tuple(torch.einsum("rnhij,rnjhd->rnihd", ac, x).flatten(1, 2)[:, :t] for x in (kb, vb))


def state_scan(k, w, u, g, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
               chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The state scan with a row-buffer initial state: (h entering each chunk, v_new, the final state when
    `output_final_state`, else None: the last chunk's update feeds only it)."""
    (r, t, hv, vd), c = u.shape, chunk
    kc, wc, uc, gc = _chunks(repeat_heads(k, hv), c), _chunks(w, c), _chunks(u, c), _chunks(g, c, gate=True)
    # never updated in place
    h = torch.zeros(r, hv, k.shape[-1], vd, device=k.device) if initial_state is None else initial_state.float()
    hs, vnew = [], []
    for n in range(kc.shape[1]):
        hs.append(h)
        v_c = uc[:, n] - torch.einsum("rihk,rhkv->rihv", wc[:, n], h)
        vnew.append(v_c)
        if n + 1 == kc.shape[1] and not output_final_state:
            break
        g_c, g_last = gc[:, n], gc[:, n, -1]  # [R, C, HV], [R, HV]
        valid = (torch.arange(c, device=k.device) + n * c < t).float()[None, :, None]
        v_c = v_c * (torch.exp2(g_last.unsqueeze(1) - g_c) * valid).unsqueeze(-1)
        h = h * torch.exp2(g_last)[..., None, None] + torch.einsum("rihk,rihv->rhkv", kc[:, n], v_c)
    v_new = torch.stack(vnew, 1).flatten(1, 2)[:, :t]
    return torch.stack(hs, 1), v_new, (h if output_final_state else None)


def bank_rows(index: torch.Tensor, rows: int, index_stride: int | None = None) -> torch.Tensor:
    """The rows' bank slots: element r * index_stride of `index` (a column of an upload buffer)."""
    stride = index.stride(0) if index_stride is None else index_stride
    return index.as_strided((rows,), (stride,)).long()


def chunk_output(q, k, v_new, h, g, scale: float, chunk: int = CHUNK) -> torch.Tensor:
    """o = scale * (q h exp2(g) + causal(q k^T exp2(g_i - g_j)) v_new): [R, T, HV, V]."""
    t, hv, c = q.shape[1], v_new.shape[2], chunk
    qc, kc = _chunks(repeat_heads(q, hv), c), _chunks(repeat_heads(k, hv), c)
    vc, gc = _chunks(v_new, c), _chunks(g, c, gate=True)
    inter = torch.einsum("rnihk,rnhkv->rnihv", qc, h) * torch.exp2(gc).unsqueeze(-1)
    qk = torch.einsum("rnihk,rnjhk->rnhij", qc, kc)
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = _masked_decay(gc, causal)
    intra = torch.einsum("rnhij,rnjhv->rnihv", (qk * decay).masked_fill(~causal, 0.0), vc)
    return ((inter + intra) * scale).flatten(1, 2)[:, :t]


def chunk_gated_delta_rule(q, k, v, g, beta, scale: float | None = None, initial_state=None,
                           output_final_state: bool = False, use_qk_l2norm: bool = True, chunk: int = CHUNK):
    """The whole forward: (o [R, T, HV, V] fp32, final state or None). `g` is the natural-log decay."""
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    gc = chunk_cumsum(g, chunk)
    w, u = wy_repr(k, v.float(), gc, beta.float(), chunk)
    h, v_new, final = state_scan(k, w, u, gc, initial_state, output_final_state, chunk)
    return chunk_output(q, k, v_new, h, gc, scale, chunk), final


def gate_decay(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """The DeltaNet log decay of each token and value head: -exp(A_log) * softplus(a + dt_bias), [R, T, HV]."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())


def branch_wy(q, k, v, g, beta, a_inv: torch.Tensor, bank: torch.Tensor, index: torch.Tensor,
              index_stride: int | None = None) -> torch.Tensor:
    """The stages after the solve, with the fused kernel's interface (`kevscore.kernels.branch_wy`): g the
    chunk-local cumulative gate (log2), a_inv as `chunk_inverse` gives it, row r starting from
    `bank[index[r * index_stride]]` (never written). Returns o [R, T, HV, V] in v's dtype."""
    q, k = (repeat_heads(x, v.shape[2]).float() for x in (q, k))
    g, beta, a_inv = g.float(), beta.float(), a_inv.float()
    w, u = wy_from_inverse(k, v.float(), g, beta, a_inv)
    h, v_new, _ = state_scan(k, w, u, g, bank[bank_rows(index, v.shape[0], index_stride)])  # the states copied out
    return chunk_output(q, k, v_new, h, g, q.shape[-1] ** -0.5).to(v.dtype)
