"""The MLP's gate|up projection with SwiGLU in its epilogue: one Triton GEMM in place of cuBLAS's and a SwiGLU.

The weight's gate and up rows are interleaved in blocks of HALF rows (`interleave`), so each output tile of
x W^T, BN = 2 HALF columns wide, holds a block of gate columns and the same block of up columns; the epilogue
writes silu(gate) * up, HALF columns, and the projection output never goes to memory. Gate and up are rounded
to the output dtype before SwiGLU's fp32 arithmetic, as `swiglu_rows` reads them from cuBLAS's output, so the two
forms differ only by the GEMMs' order of summation. Persistent programs, one per SM, walk the output tiles in
groups of GROUP_M rows of tiles (each weight tile read from L2 by the group), x and the weight through TMA
descriptors. Torch reference: `torch_ops.swiglu_proj`; `benchmarks/bench_gemm_epilogue.py` times it against
cuBLAS + `swiglu_rows`.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

HALF = 128  # gate rows (and up rows) per block of the interleaved weight: half an output tile


def interleave(gate: torch.Tensor, up: torch.Tensor, half: int = HALF) -> torch.Tensor:
    """[2 I, K]: each block of `half` gate rows followed by the same block of up rows (I a multiple of half)."""
    inner, k = gate.shape
    blocks = [w.reshape(inner // half, half, k) for w in (gate, up)]
    return torch.stack(blocks, 1).reshape(2 * inner, k)


@triton.jit(do_not_specialize=["M", "PROGRAMS"])
def _swiglu_gemm_kernel(x_desc, w_desc, o_desc, M, N, K, PROGRAMS, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, GROUP_M: tl.constexpr, SWIGLU: tl.constexpr):
    """SWIGLU: the tile's silu(gate) * up; else x W^T itself (the plain GEMM that bench_gemm_epilogue.py puts
    against cuBLAS's)."""
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GROUP_M * tiles_n
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True):
        first_m = (tile // per_group) * GROUP_M
        rows = min(tiles_m - first_m, GROUP_M)
        i_m, i_n = first_m + (tile % per_group) % rows, (tile % per_group) // rows
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            acc = tl.dot(x_desc.load([i_m * BM, i_k * BK]), w_desc.load([i_n * BN, i_k * BK]).T, acc)
        if SWIGLU:
            gate, up = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
            gate, up = gate.to(o_desc.dtype).to(tl.float32), up.to(o_desc.dtype).to(tl.float32)
            o_desc.store([i_m * BM, i_n * (BN // 2)], (gate * tl.sigmoid(gate) * up).to(o_desc.dtype))
        else:
            o_desc.store([i_m * BM, i_n * BN], acc.to(o_desc.dtype))


@functools.cache
def _programs(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def swiglu_gemm(x: torch.Tensor, weight: torch.Tensor, half: int = HALF, swiglu: bool = True, block_m: int = 128,
                block_k: int = 64, num_stages: int = 3, num_warps: int = 8, persistent: bool = True) -> torch.Tensor:
    """silu(x gate^T) * (x up^T) [..., I] for x [..., K] and `weight` gate|up interleaved by `half` rows
    [2 I, K] (`interleave`), in x's dtype (swiglu False: x weight^T [..., 2 I]). The launch's defaults:
    bench_gemm_epilogue.py's fastest (NOTES 68); persistent False: a program per output tile."""
    k, n = x.shape[-1], weight.shape[0]
    rows = x.reshape(-1, k).contiguous()
    width = n // 2 if swiglu else n
    out = torch.empty(rows.shape[0], width, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        tiles = triton.cdiv(rows.shape[0], block_m) * triton.cdiv(n, 2 * half)
        programs = min(tiles, _programs(x.device)) if persistent else tiles
        blocks = ((rows, [block_m, block_k]), (weight, [2 * half, block_k]), (out, [block_m, half if swiglu else 2 * half]))
        descriptors = [TensorDescriptor.from_tensor(t, block) for t, block in blocks]
        _swiglu_gemm_kernel[(programs,)](*descriptors, rows.shape[0], n, k, programs, BM=block_m, BN=2 * half,
                                         BK=block_k, GROUP_M=8, SWIGLU=swiglu, num_stages=num_stages,
                                         num_warps=num_warps)
    return out.reshape(*x.shape[:-1], width)
