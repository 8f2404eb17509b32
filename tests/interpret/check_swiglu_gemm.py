"""Run under TRITON_INTERPRET=1: the gate|up GEMM with SwiGLU in its epilogue against the torch ops, in fp32 (the
interpreter's bf16 TMA loads are wrong, an interpreter fault: the H200 checks bf16, tests/test_cuda.py), over
row counts off the tile, several tiles in both directions and several tiles per program; and its plain form."""
import torch
import torch.nn.functional as F

from kevscore.kernels import torch_ops
from kevscore.kernels.swiglu_gemm import interleave, swiglu_gemm

worst = 0.0
for lead, inner, k, half in (((3, 70), 64, 32, 16), ((5,), 96, 48, 32), ((1, 2, 9), 32, 16, 16)):
    gen = torch.Generator().manual_seed(inner + k)
    x = torch.randn(*lead, k, generator=gen)
    gate, up = torch.randn(inner, k, generator=gen), torch.randn(inner, k, generator=gen)
    ref = torch_ops.swiglu(F.linear(x, torch.cat([gate, up])))
    out = swiglu_gemm(x, interleave(gate, up, half), half, block_m=16, block_k=16, num_stages=1, num_warps=4)
    assert out.shape == ref.shape and out.is_contiguous()
    worst = max(worst, (out - ref).abs().max().item())
    plain = swiglu_gemm(x, torch.cat([gate, up]), half, swiglu=False, block_m=16, block_k=16, num_stages=1,
                        num_warps=4, persistent=False)  # the plain GEMM, a program per tile (the benchmark's)
    worst = max(worst, (plain - F.linear(x, torch.cat([gate, up]))).abs().max().item())
w = torch.arange(8.0)[:, None].expand(8, 3)  # gate rows 0-3, up rows 4-7, in blocks of 2
assert interleave(w[:4], w[4:], 2)[:, 0].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
print(f"swiglu_gemm: max |out - ref| {worst:.2e}")
assert worst < 1e-3, worst
