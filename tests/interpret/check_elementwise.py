"""Run under TRITON_INTERPRET=1: the row-tiled SwiGLU and the fused q/k RMSNorm + rotary kernels against the
torch ops on the CPU, with q read in place from a q|gate projection output (strided heads)."""
import torch

from kevscore.kernels import torch_ops
from kevscore.kernels.elementwise import qk_norm_rope, swiglu_rows
from kevscore.layers.common import Rotary

worst = 0.0
for shape, inner in (((3, 5), 40), ((7,), 1100), ((1, 2, 3), 8)):
    gate_up = torch.randn(*shape, 2 * inner, generator=torch.Generator().manual_seed(inner))
    ref = torch_ops.swiglu(gate_up)
    out = swiglu_rows(gate_up, block_cols=512)
    assert out.shape == ref.shape and out.is_contiguous()
    worst = max(worst, (out - ref).abs().max().item())

for rows, t, nh, d, rot in ((3, 5, 4, 64, 16), (1, 19, 2, 32, 32), (2, 1, 3, 48, 12)):
    gen = torch.Generator().manual_seed(t)
    proj = torch.randn(rows, t, nh * 2 * d + 7, generator=gen) * 3
    q = proj[..., : nh * 2 * d].reshape(rows, t, nh, 2 * d)[..., :d]  # the q half of q|gate, per head
    scale = 1 + torch.randn(d, generator=gen) * 0.1
    positions = torch.randint(0, 5000, (rows, t), generator=gen)
    rotary = Rotary(rot, 1e6)
    cos, sin = rotary.cos_sin(positions)
    ref = torch_ops.rotary(torch_ops.rms_norm(q, scale, 1e-6), cos, sin)
    out = qk_norm_rope(q, scale, cos, sin, 1e-6, block_t=4)
    assert out.shape == ref.shape and out.is_contiguous()
    worst = max(worst, (out - ref).abs().max().item())
    flat = qk_norm_rope(q[0], scale, cos[0], sin[0], 1e-6)  # no row dim: leading dims [T]
    worst = max(worst, (flat - ref[0]).abs().max().item())
print(f"max abs error {worst:.3g}")
assert worst < 1e-4, worst
