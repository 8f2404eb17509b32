"""Run under TRITON_INTERPRET=1: the fused WY kernel (w/u, the state read by index, v_new, output; second
chunk masked) after our kkt + solve kernel, on the CPU in fp32: the solve gives `gdr_ref.chunk_inverse`
on the lower triangles it writes; the three kernels (our gate cumsum, the solve, ours) give
`torch_ops.gdr_branch` on both paths and `gdr_ref.branch_wy`; rows share bank entries, the slots are a strided
upload-buffer column, the bank is never written, and the gathered form (the rows' states copied out, an
identity index) gives the indexed bits. fp32 only: Triton 3.8's interpreter multiplies bf16 dot operands as
their raw bits."""
import time

import torch

from kevscore.kernels import gdr_ref, torch_ops
from kevscore.kernels.branch_wy import branch_wy
from kevscore.kernels.gate import gate_cumsum
from kevscore.kernels.kkt_solve import solve_chunks

entries, rows = 5, 4
start = time.perf_counter()
worst = 0.0
# the launcher's defaults (one value block here; token tiles of 16, 32 or 64: T 17 one of 32, 85 64 + 32), then
# value columns in four blocks and tiles of 16 or 64 tokens only (T 20: one of 64; 85 and 100: 64 + 64)
for (h, hv, dk, dv, launch), lengths in [((2, 4, 32, 32, {}), (1, 17, 64, 65, 85, 128)),
                                        ((1, 2, 64, 64, dict(block_v=16, num_warps=8, tiles=(16, 64))),
                                         (20, 85, 100))]:
    for t in lengths:
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
        upload[:, 4] = torch.tensor([(3 * r) % entries if r % 2 else 2 for r in range(rows)])  # rows 0, 2 share
        index = upload[:, 4]

        gc = gate_cumsum(*gate, 64, gdr_ref.RCP_LN2)
        a_inv = solve_chunks(k, gc, beta, torch.full((rows, t, hv, 64), float("nan")))  # lower triangles written
        ref_inv = gdr_ref.chunk_inverse(k, gc, beta)
        low = (torch.arange(64) <= (torch.arange(t) % 64)[:, None])[None, :, None, :]
        assert (a_inv - ref_inv).where(low, 0.0).abs().max() < 1e-5, t

        out = branch_wy(q, k, v, gc, beta, a_inv, bank, index, index.stride(0), **launch)
        assert torch.equal(bank, snapshot) and out.shape == v.shape and out.dtype == v.dtype
        gathered = branch_wy(q, k, v, gc, beta, a_inv, bank.index_select(0, index), torch.arange(rows), **launch)
        assert torch.equal(out, gathered), (dk, t)
        ref = gdr_ref.branch_wy(q, k, v, gc, beta, ref_inv, bank, index, index.stride(0))
        errors = [((out - ref).norm() / ref.norm()).item()]
        for path in ("indexed", "gathered"):
            ops = torch_ops.gdr_branch(q, k, v, gate, beta, bank, index, path)
            errors.append(((out - ops).norm() / ops.norm()).item())
        print(f"K {dk} V {dv} {launch} T {t}: relative error {max(errors):.3g}")
        worst = max(worst, *errors)
print(f"max relative error {worst:.3g} in {time.perf_counter() - start:.1f} s")
assert worst < 1e-4, worst
