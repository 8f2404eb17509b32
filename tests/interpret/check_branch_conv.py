"""Run under TRITON_INTERPRET=1: the fused branch conv kernel (and its beta programs) against the torch ops
on the CPU."""
import torch
import torch.nn.functional as F

from kevscore.kernels import torch_ops
from kevscore.kernels.branch_conv import branch_conv, packed_conv

torch.manual_seed(0)
W = 4
worst = 0.0
# heads of one width (masks along time only) and of two widths (channel masks too)
for (hk, dk, hv, dv), (rows, t) in [((2, 64, 4, 64), (3, 1)), ((2, 64, 4, 64), (2, 5)), ((2, 64, 4, 64), (3, 37)),
                                    ((2, 64, 4, 32), (3, 37))]:
    C = 2 * hk * dk + hv * dv
    proj = torch.randn(rows, t, C + 100)
    x, b = proj[..., :C], proj[..., C + 7: C + 7 + hv]  # strided slices, as the projection output gives them
    w = torch.randn(C, W) * 0.5
    bank = torch.randn(6, C, W - 1)
    slots = torch.randint(0, 6, (rows, 5))[:, 2]  # a strided column, as the upload buffer gives it
    q, k, v, beta = branch_conv(x, w, bank, slots, hk, dk, hv, dv, b=b)
    assert beta.is_contiguous() and (beta - torch.sigmoid(b)).abs().max() < 1e-6
    # other tile sizes (so other tiles that read the bank) and programs of several tiles, with and without
    # the beta programs: the same bits
    for bt, tiles in ((2, 1), (16, 1), (4, 3), (16, 2)):
        *other, other_beta = branch_conv(x, w, bank, slots, hk, dk, hv, dv, b=b, block_t=bt, tiles=tiles)
        assert all(torch.equal(a, c) for a, c in zip((q, k, v, beta), (*other, other_beta))), bt
    *plain, none = branch_conv(x, w, bank, slots, hk, dk, hv, dv)
    assert none is None and all(torch.equal(a, c) for a, c in zip((q, k, v), plain))
    ref = torch_ops.conv_branch(x, w, bank.index_select(0, slots))
    rq, rk, rv = ref.split([hk * dk, hk * dk, hv * dv], -1)
    expect = (F.normalize(rq.reshape(rows, t, hk, dk), dim=-1), F.normalize(rk.reshape(rows, t, hk, dk), dim=-1),
              rv.reshape(rows, t, hv, dv))
    for ours, ref_ in zip((q, k, v), expect):
        assert ours.is_contiguous()
        worst = max(worst, (ours - ref_).abs().max().item())
# packed documents (prefill): each document from a zero state, boundaries from the tokens' positions
for (hk, dk, hv, dv), lens in [((2, 64, 4, 64), (1, 2, 7, 37)), ((2, 64, 4, 32), (5, 3, 40))]:
    C, n = 2 * hk * dk + hv * dv, sum(lens)
    proj = torch.randn(1, n, C + 100)
    x, b = proj[..., :C], proj[..., C + 7: C + 7 + hv]
    w = torch.randn(C, W) * 0.5
    positions = torch.cat([torch.arange(m) for m in lens])
    cu = torch.tensor([0, *lens]).cumsum(0)
    q, k, v, beta = packed_conv(x, w, positions, hk, dk, hv, dv, b=b)
    for bt, tiles in ((2, 1), (16, 2)):
        other = packed_conv(x, w, positions, hk, dk, hv, dv, b=b, block_t=bt, tiles=tiles)
        assert all(torch.equal(a, c) for a, c in zip((q, k, v, beta), other)), bt
    assert (beta - torch.sigmoid(b)).abs().max() < 1e-6
    ref = torch_ops.conv_prefill(x, w, cu)
    rq, rk, rv = ref.split([hk * dk, hk * dk, hv * dv], -1)
    expect = (F.normalize(rq.reshape(1, n, hk, dk), dim=-1), F.normalize(rk.reshape(1, n, hk, dk), dim=-1),
              rv.reshape(1, n, hv, dv))
    for ours, ref_ in zip((q, k, v), expect):
        worst = max(worst, (ours - ref_).abs().max().item())
print(f"max abs diff {worst:.3g}")
assert worst < 1e-5, worst
