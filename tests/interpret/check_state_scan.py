"""Run under TRITON_INTERPRET=1: the indexed state scan against the torch reference on the CPU, its bank
indices a strided upload-buffer column with repeated entries; with and without the last chunk's update
(which only feeds the final state it never writes) it gives the same bits."""
import torch
import triton

from kevscore.kernels import gdr_ref
from kevscore.kernels.state_scan import state_scan_indexed

h, hv, dk, dv, entries = 2, 4, 64, 32, 5
config = triton.Config({"BV": 16}, num_warps=4, num_stages=1)
worst = 0.0
for rows, t in ((1, 1), (3, 17), (2, 64), (3, 129)):
    gen = torch.Generator().manual_seed(rows * 1000 + t)
    k = gdr_ref.l2norm(torch.randn(rows, t, h, dk, generator=gen))
    v = torch.randn(rows, t, hv, dv, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(rows, t, hv, generator=gen))
    beta = torch.rand(rows, t, hv, generator=gen)
    gc = gdr_ref.chunk_cumsum(g)
    w, u = gdr_ref.wy_repr(k, v, gc, beta)
    bank = torch.randn(entries, hv, dk, dv, generator=gen)
    snapshot = bank.clone()
    upload = torch.randint(0, 100, (rows, 7), generator=gen)
    upload[:, 4] = torch.tensor([(3 * r) % entries if r % 2 else 2 for r in range(rows)])
    index = upload[:, 4]
    args = (k.contiguous(), w.contiguous(), u.contiguous(), gc.contiguous(), bank, index, index.stride(0), config)
    out_h, out_v = state_scan_indexed(*args)
    full_h, full_v = state_scan_indexed(*args, final_update=True)
    assert torch.equal(out_h, full_h) and torch.equal(out_v, full_v), (rows, t)
    assert torch.equal(bank, snapshot)
    ref_h, ref_v = gdr_ref.state_scan_indexed(k, w, u, gc, bank, index, index.stride(0))
    assert out_h.shape == ref_h.shape and out_v.shape == ref_v.shape
    worst = max(worst, ((out_h - ref_h).norm() / ref_h.norm()).item(), ((out_v - ref_v).norm() / ref_v.norm()).item())
print(f"max relative error {worst:.3g}")
assert worst < 1e-4, worst
