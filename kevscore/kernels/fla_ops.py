"""The GPU backend of the layer ops: our Triton kernels, on flash-linear-attention's (fla-core 0.5.2) helpers.

Our kernels (the fused conv front end, the gated delta rule's gate cumsum, solve and fused WY, branch
attention, norms, the MLP's fused GEMM) and flash attention over packed documents for prefill; same functions
as `kevscore.kernels.torch_ops`. The gated delta rule runs the gate cumsum (`kernels/gate.py`), the solve
(`kernels/kkt_solve.py`), then one kernel (`kernels/branch_wy.py`) for the WY representation, the state scan
and the output. For branches the two paths differ only in where that kernel reads each row's initial state:
`indexed` from the bank by slot, `gathered` from the rows' states copied out of it. Prefill passes the chunk
indices computed on the host (`runner.prefill_inputs`), so no stage synchronizes with the GPU to derive them.
FLA's own ops (its conv, its solve, w/u, scan and output kernels, its whole `chunk_gated_delta_rule`), which
these kernels replace, are the oracles of the cuda tests and the A/B of the benchmarks: tests/fla_oracles.py.
"""
from __future__ import annotations

import os

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # always FLA's own Triton kernels

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# FLA's modules, not its packages' whole imports (several seconds, `fla_packages`)
from fla.ops.utils.constant import RCP_LN2  # noqa: E402

from kevscore.kernels.branch_attn import branch_attention  # noqa: E402
from kevscore.kernels.branch_conv import branch_conv, packed_conv  # noqa: E402
from kevscore.kernels.branch_wy import MAX_T, branch_wy, chunks_wy  # noqa: E402
from kevscore.kernels.elementwise import gated_rms_norm_heads, qk_norm_rope, rms_norm_rows, sigmoid_gate, swiglu_rows  # noqa: E402
from kevscore.kernels.gate import gate_cumsum as decay_cumsum  # noqa: E402
from kevscore.kernels.gdr_ref import CHUNK  # noqa: E402
from kevscore.kernels.kkt_solve import solve_chunks  # noqa: E402
from kevscore.kernels.swiglu_gemm import HALF, interleave, swiglu_gemm  # noqa: E402

# the MLP's gate|up GEMM with SwiGLU in its epilogue (`kernels/swiglu_gemm.py`) for bf16 models, where the GPU
# has TMA (compute capability 9 and newer); KEVSCORE_FUSED_MLP=0 keeps cuBLAS and `swiglu_rows` (for A/B runs)
FUSED_MLP = (os.environ.get("KEVSCORE_FUSED_MLP", "1") != "0" and torch.cuda.is_available()
             and torch.cuda.get_device_capability()[0] >= 9)
NAME = "fla_ops+fused_mlp" if FUSED_MLP else "fla_ops"  # kevscore.model.layers.ops.Ops: the backend in model
# fingerprints (the fused MLP's bank entries differ from cuBLAS's by the GEMMs' rounding)
GATHERS_KV = False  # attn_branch reads each row's document K/V in place (kernels/branch_attn.py)
PREFILL_CONV = {"block_t": 8, "num_warps": 2}  # the packed conv's launch: bench_kernels.py --only 'prefill conv'
# kernels/branch_wy.py's launches (its keywords): branches of up to 128 tokens with FUSED_WY_LAUNCH
# (bench_kernels.py --only 'fused wy'), longer ones and prefill with CHUNKS_WY_LAUNCH ('prefill wy')
FUSED_WY_LAUNCH: dict = {}
CHUNKS_WY_LAUNCH: dict = {}
# An fp32 model's Triton dots run in 3xTF32, fp32's precision on tensor cores (TRITON_F32_DEFAULT, set by
# cuda_runner.process_settings). Its branch attention's tiles: the bf16 defaults' would take 512 KB of shared memory at
# head dim 256, over the H200's 227 KB; these take 192 KB (benchmarks/sm90_build.py)
ATTN_FP32 = {"block_m": 64, "block_n": 32, "num_warps": 8, "num_stages": 1}


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """FLA's RMSNorm arithmetic in a kernel compiled once for every token count (`elementwise.rms_norm_rows`)."""
    return rms_norm_rows(x.contiguous(), scale, eps)


def proj_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The projection added into the residual stream in place by cuBLAS's epilogue (beta = 1: the fp32 sum
    rounded once), so no projection output is written for the next norm to read beside the stream."""
    residual.view(-1, residual.shape[-1]).addmm_(x.reshape(-1, x.shape[-1]), weight.t())
    return residual


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reads the gate (z, a slice of the DeltaNet projection output, heads packed) in place; x is the gated
    delta rule's contiguous output, or its rows at the scored positions. FLA's `rms_norm_gated`, which copies
    the gate first, is the oracle in the tests."""
    return gated_rms_norm_heads(x, gate, weight, eps)


def gate_up_weight(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate|up interleaved by blocks (`swiglu_gemm.interleave`) where `swiglu_proj` runs the fused GEMM, else
    stacked."""
    return interleave(gate, up) if _fused_mlp(gate.dtype, gate.shape[0]) else torch.cat([gate, up])


def swiglu_proj(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x's gate|up projection: one GEMM with SwiGLU in its epilogue, or cuBLAS and
    `swiglu_rows` (FLA's `swiglu_fwd` arithmetic in a row-tiled kernel)."""
    if _fused_mlp(gate_up.dtype, gate_up.shape[0] // 2):
        return swiglu_gemm(x, gate_up)
    return swiglu_rows(F.linear(x, gate_up))


def _fused_mlp(dtype: torch.dtype, inner: int) -> bool:
    return FUSED_MLP and dtype == torch.bfloat16 and inner % HALF == 0


def qk_norm_rotary(q: torch.Tensor | None, k: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor | None, torch.Tensor]:
    """RMSNorm of each q and k head, then partial NeoX rotary (cos/sin fp32 [..., rotary_dim]); one kernel
    per tensor, reading q out of the q|gate projection in place. Returns packed [..., heads, head_dim] (q None:
    k alone)."""
    return None if q is None else qk_norm_rope(q, q_scale, cos, sin, eps), qk_norm_rope(k, k_scale, cos, sin, eps)


def branch_front(x: torch.Tensor, weight: torch.Tensor, bank_conv: torch.Tensor, slots: torch.Tensor,
                 hk: int, dk: int, hv: int, dv: int, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(q, k, v, beta = sigmoid(b)) of the branch conv: one kernel reads the conv states from the bank in place,
    normalizes q and k and computes beta (`kernels/branch_conv.py`)."""
    return branch_conv(x, weight, bank_conv, slots, hk, dk, hv, dv, b=b)


def prefill_front(x: torch.Tensor, weight: torch.Tensor, ctx, hk: int, dk: int, hv: int, dv: int,
                  b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(q, k, v, beta = sigmoid(b)) of packed documents, q and k l2-normalized: one kernel reads the projection
    output in place and writes them contiguous (`branch_conv.packed_conv`)."""
    return packed_conv(x, weight, ctx.positions, hk, dk, hv, dv, b=b, **PREFILL_CONV)


def gdr_prefill(q, k, v, gate, beta, ctx, bank: torch.Tensor) -> torch.Tensor:
    """Packed documents from zero states (q and k l2-normalized, as `prefill_front` leaves them): the output;
    one kernel after the solve writes each document's final state into its bank entry `bank[ctx.slots[d]]`
    (`branch_wy.chunks_wy`). gate = (a, A_log, dt_bias): the decay -exp(A_log) * softplus(a + dt_bias)."""
    cu, chunks = ctx.cu_seqlens_long, ctx.chunk_indices
    gc = gate_cumsum(gate, cu, chunks)
    return chunks_wy(q, k, v, gc, beta, solve_chunks(k, gc, beta, None, cu, chunks), bank, ctx.slots, cu_seqlens=cu,
                     **CHUNKS_WY_LAUNCH)


def gate_cumsum(gate, cu_seqlens=None, chunk_indices=None) -> torch.Tensor:
    """The per-chunk cumulative log2 decay from gate = (a, A_log, dt_bias) (of packed documents with
    `cu_seqlens` and `chunk_indices`): FLA's gate + cumsum arithmetic in our kernel (`kernels/gate.py`), reading
    `a` in place."""
    return decay_cumsum(*gate, CHUNK, RCP_LN2, cu_seqlens, chunk_indices)


def gdr_branch(q, k, v, gate, beta, bank: torch.Tensor, slots: torch.Tensor, path: str) -> torch.Tensor:
    """gate = (a, A_log, dt_bias); q and k l2-normalized, as `branch_front` leaves them. The gate cumsum,
    the solve, then one kernel that reads each row's state from the bank by slot (`branch_wy` for branches of
    up to 128 tokens, `chunks_wy` beyond); `gathered` gives it the rows' states copied out and an identity index,
    so both paths compute alike to the bit."""
    gc = gate_cumsum(gate)
    if path == "gathered":
        bank, slots = bank.index_select(0, slots), torch.arange(slots.shape[0], device=slots.device)
    short = q.shape[1] <= MAX_T
    return (branch_wy if short else chunks_wy)(q, k, v, gc, beta, solve_chunks(k, gc, beta), bank, slots,
                                               slots.stride(0), **(FUSED_WY_LAUNCH if short else CHUNKS_WY_LAUNCH))


def sdpa_causal(q, k, v):
    """Causal attention of [B, L, H, D] queries over [B, L, Hkv, D] keys and values, through torch's SDPA."""
    fp32 = q.dtype == torch.float32  # memory-efficient attention then (no flash, no cuDNN), which may not take
    if fp32:  # grouped heads (SDPA would fall back to its math, O(L^2) memory): each KV head repeated instead
        k, v = (t.repeat_interleave(q.shape[2] // k.shape[2], 2) for t in (k, v))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not fp32).transpose(1, 2)


def attn_prefill(q, k, v, gate, ctx) -> torch.Tensor:
    """Causal attention within each packed document, times sigmoid(gate). Documents of similar lengths (the
    host computed `pad_index`) go through SDPA (cuDNN) as a right-padded [D, L] batch, gathered and scattered
    by host-computed indices (no copy at all when they are equally long); others through flash attention
    over the packed tokens (`cu_seqlens`); in fp32, which flash attention does not take, SDPA per document
    (the runner groups documents of similar lengths, so this is the rare case). The gate and the unpadding are one
    kernel, `elementwise.sigmoid_gate`."""
    unpad = None  # the output's gate reads each token's output where the attention leaves it (`sigmoid_gate`)
    if ctx.pad_index is None and q.dtype == torch.float32:
        bounds = ctx.cu_seqlens.tolist()
        out = torch.cat([sdpa_causal(q[:, s:e], k[:, s:e], v[:, s:e]) for s, e in zip(bounds[:-1], bounds[1:])], 1)
    elif q.dtype != torch.float32 and ctx.pad_index is None:
        out = torch.ops.aten._flash_attention_forward(q[0], k[0], v[0], ctx.cu_seqlens, ctx.cu_seqlens,
                                                      ctx.max_len, ctx.max_len, 0.0, True, False)[0][None]
    elif ctx.pad_index.numel() == q.shape[1]:  # equal lengths: the packed tokens are the batch
        out = sdpa_causal(*(t.view(ctx.pad_index.shape[0], ctx.max_len, *t.shape[2:]) for t in (q, k, v)))
    else:
        out, unpad = sdpa_causal(q[0][ctx.pad_index], k[0][ctx.pad_index], v[0][ctx.pad_index]), ctx.unpad_index
    return sigmoid_gate(out, gate, unpad)


def attn_branch(q, k, v, gate, kv: torch.Tensor, ctx) -> torch.Tensor:
    """Reads the document K/V in place from the pool `kv` [2, tokens, Hkv, D] (no per-row gather); the
    output gate sigmoid(gate) is applied in the kernel's epilogue."""
    return branch_attention(q, k, v, kv[0], kv[1], ctx.kv_start, ctx.kv_len, gate=gate,
                            **(ATTN_FP32 if q.dtype == torch.float32 else {}))
