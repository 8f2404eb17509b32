"""Run under TRITON_INTERPRET=1: the fused short-branch gated delta rule against its torch reference and against
`torch_ops.gdr_branch` (both paths) on the CPU, for one and two chunks (T up to 128, the second chunk partly
masked), the decay input a strided slice of a projection output, bank slots a strided upload-buffer column
with repeated entries; the bank is never written, and the gathered form (the rows' states copied out, an
identity index) gives the indexed bits. fp32 only: Triton 3.8's interpreter multiplies bf16 dot operands as their
raw bits (the bf16 rounding points are checked on the GPU, tests/test_cuda_branch_gdr.py)."""
import time

import torch

from kevscore.kernels import gdr_ref, torch_ops
from kevscore.kernels.branch_gdr import branch_gdr

entries = 5
start = time.perf_counter()
worst = 0.0
# the launcher's defaults (one key and one value block here), then key and value columns in two blocks each
for (h, hv, dk, dv, blocks), lengths in [((2, 4, 32, 32, {}), (1, 17, 64, 65, 100, 128)),
                                        ((1, 2, 64, 64, dict(block_k=32, block_v=32)), (33, 128))]:
    for t in lengths:
        rows = 3
        gen = torch.Generator().manual_seed(100 * dk + t)
        q = gdr_ref.l2norm(torch.randn(rows, t, h, dk, generator=gen))
        k = gdr_ref.l2norm(torch.randn(rows, t, h, dk, generator=gen))
        v = torch.randn(rows, t, hv, dv, generator=gen)
        beta = torch.rand(rows, t, hv, generator=gen)
        proj = torch.randn(rows, t, 3 * hv + 5, generator=gen) * 2
        gate = (proj[..., hv + 3: 2 * hv + 3], torch.randn(hv, generator=gen) * 0.5, torch.randn(hv, generator=gen))
        bank = torch.randn(entries, hv, dk, dv, generator=gen) * 0.3
        snapshot = bank.clone()
        upload = torch.randint(0, 100, (rows, 7), generator=gen)
        upload[:, 4] = torch.tensor([(3 * r) % entries if r % 2 else 2 for r in range(rows)])
        index = upload[:, 4]

        out = branch_gdr(q, k, v, gate, beta, bank, index, index.stride(0), **blocks)
        assert torch.equal(bank, snapshot) and out.shape == v.shape and out.dtype == v.dtype
        gathered = branch_gdr(q, k, v, gate, beta, bank.index_select(0, index), torch.arange(rows), **blocks)
        assert torch.equal(out, gathered), (dk, t)
        ref = gdr_ref.branch_gdr(q, k, v, gate, beta, bank, index, index.stride(0))
        errors = [((out - ref).norm() / ref.norm()).item()]
        for path in ("indexed", "gathered"):  # the ops' l2 norm of q and k changes them by 5e-7 only
            ops = torch_ops.gdr_branch(q, k, v, gate, beta, bank, index, path)
            errors.append(((out - ops).norm() / ops.norm()).item())
        print(f"K {dk} V {dv} {blocks} T {t}: relative error {max(errors):.3g}")
        worst = max(worst, *errors)
print(f"max relative error {worst:.3g} in {time.perf_counter() - start:.1f} s")
assert worst < 1e-4, worst
