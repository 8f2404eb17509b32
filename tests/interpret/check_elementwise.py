"""Run under TRITON_INTERPRET=1: the row-tiled SwiGLU, the fused q/k RMSNorm + rotary, the gated output norms
against the torch ops on the CPU, with q and the gates read in place from a projection output (strided)."""
import torch

from kevscore.kernels import torch_ops
from kevscore.kernels.elementwise import gated_rms_norm_heads, qk_norm_rope, rms_norm_rows, sigmoid_gate, swiglu_rows
from kevscore.model.layers.common import Rotary

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
for rows, t, hv, dv in ((3, 5, 4, 32), (1, 19, 2, 48)):
    gen = torch.Generator().manual_seed(t)
    proj = torch.randn(rows, t, 3 * hv * dv + 5, generator=gen) * 2
    z = proj[..., hv * dv: 2 * hv * dv].reshape(rows, t, hv, dv)  # the gate, a slice of the projection output
    o = torch.randn(rows, t, hv, dv, generator=gen)
    w = 1 + torch.randn(dv, generator=gen) * 0.1
    ref = torch_ops.gated_rms_norm(o, z, w, 1e-6)
    out = gated_rms_norm_heads(o, z, w, 1e-6, block_t=4)
    worst = max(worst, (out - ref).abs().max().item())

for shape, d in (((3, 5), 40), ((7,), 100), ((1, 1), 8)):
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(*shape, d, generator=gen) * 2
    scale = 1 + torch.randn(d, generator=gen) * 0.1
    out = rms_norm_rows(x, scale, 1e-6, block_rows=2)
    worst = max(worst, (out - torch_ops.rms_norm(x, scale, 1e-6)).abs().max().item())

for docs, longest, h, d in ((3, 7, 2, 24), (1, 5, 3, 16)):  # attention prefill's output gate
    gen = torch.Generator().manual_seed(docs)
    lens = torch.randint(1, longest + 1, (docs,), generator=gen)
    lens[0] = longest
    n = int(lens.sum())
    proj = torch.randn(1, n, h * 2 * d + 3, generator=gen) * 3
    gate = proj[..., : h * 2 * d].reshape(1, n, h, 2 * d)[..., d:]  # the gate half of q|gate, per head
    padded = torch.randn(docs, h, longest, d, generator=gen).transpose(1, 2)  # SDPA's [B, L, H, D], strided
    place = torch.cat([b * longest + torch.arange(int(lens[b])) for b in range(docs)])
    ref = padded.flatten(0, 1)[place][None] * torch.sigmoid(gate)
    out = sigmoid_gate(padded, gate, place, block_t=4)
    assert out.shape == gate.shape and out.is_contiguous()
    worst = max(worst, (out - ref).abs().max().item())
    packed = torch.randn(1, n, h, d, generator=gen)
    worst = max(worst, (sigmoid_gate(packed, gate[0]) - packed[0] * torch.sigmoid(gate[0])).abs().max().item())

print(f"max abs error {worst:.3g}")
assert worst < 1e-4, worst
