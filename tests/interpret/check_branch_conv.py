"""Run under TRITON_INTERPRET=1: the fused branch conv kernel against the torch ops on the CPU."""
import torch
import torch.nn.functional as F

from kevscore.kernels import torch_ops
from kevscore.kernels.branch_conv import branch_conv

torch.manual_seed(0)
W = 4
worst = 0.0
# heads of one width (masks along time only) and of two widths (channel masks too)
for (hk, dk, hv, dv), (rows, t) in [((2, 64, 4, 64), (3, 1)), ((2, 64, 4, 64), (2, 5)), ((2, 64, 4, 64), (3, 37)),
                                    ((2, 64, 4, 32), (3, 37))]:
    C = 2 * hk * dk + hv * dv
    x = torch.randn(rows, t, C + 100)[..., :C]  # a strided slice, as the projection output gives it
    w = torch.randn(C, W) * 0.5
    bank = torch.randn(6, C, W - 1)
    slots = torch.randint(0, 6, (rows, 5))[:, 2]  # a strided column, as the upload buffer gives it
    q, k, v = branch_conv(x, w, bank, slots, hk, dk, hv, dv)
    # other tile sizes, programs of several tiles, and tiles that skip the bank read (split_halo): the same bits
    for bt, tiles in ((2, 1), (16, 1), (4, 3), (16, 2)):
        other = branch_conv(x, w, bank, slots, hk, dk, hv, dv, block_t=bt, split_halo=bt == 16, tiles=tiles)
        assert all(torch.equal(a, b) for a, b in zip((q, k, v), other)), bt
    ref = torch_ops.conv_branch(x, w, bank.index_select(0, slots))
    rq, rk, rv = ref.split([hk * dk, hk * dk, hv * dv], -1)
    expect = (F.normalize(rq.reshape(rows, t, hk, dk), dim=-1), F.normalize(rk.reshape(rows, t, hk, dk), dim=-1),
              rv.reshape(rows, t, hv, dv))
    for ours, ref_ in zip((q, k, v), expect):
        assert ours.is_contiguous()
        worst = max(worst, (ours - ref_).abs().max().item())
print(f"max abs diff {worst:.3g}")
assert worst < 1e-5, worst
