"""Run under TRITON_INTERPRET=1: the chunk-loop kernel of `branch_wy` in both its modes, on the CPU in fp32
(Triton 3.8's interpreter multiplies bf16 dot operands as their raw bits).

Prefill (`chunks_wy` with `cu_seqlens`: every chunk of each packed document from a zero state, its final state
out), after our varlen gate cumsum and our varlen kkt + solve kernel (`kkt_solve.solve_chunks`), against
`gdr_ref.chunk_gated_delta_rule` run on each document alone: outputs and final states. Documents of 1 to 200
tokens (one partial chunk, exact chunks, a partial last chunk), value heads narrower than the 64-column block
(masked) and two blocks of them. Rows (`chunks_wy` without: branches longer than `branch_wy`'s two chunks, each
from a bank entry read by index) against `gdr_ref.branch_wy`, the bank never written. On both, our kkt + solve
kernel against FLA's on the same inputs."""
import sys
import time
from pathlib import Path

import torch
import triton
from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_kkt_solve_kernel

from kevscore.kernels import gdr_ref
from kevscore.kernels.branch_wy import chunks_wy
from kevscore.kernels.gate import gate_cumsum
from kevscore.kernels.kkt_solve import solve_chunks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for fla_oracles
from fla_oracles import lower_distance  # noqa: E402

SOLVE = chunk_gated_delta_rule_fwd_kkt_solve_kernel.fn.fn  # under FLA's heuristics and autotuner: no driver here
solve_distance = 0.0  # our solve's largest distance from FLA's kernel


def chunk_indices(lengths: list[int]) -> torch.Tensor:
    """FLA's (document, chunk within it) pairs of every 64-token chunk."""
    return torch.tensor([(d, c) for d, n in enumerate(lengths) for c in range(triton.cdiv(n, 64))], dtype=torch.int64)


start = time.perf_counter()
worst = 0.0
for (h, hv, dk, dv, launch), lengths in [((2, 4, 32, 32, {}), (1, 17, 64, 130)),
                                        ((1, 2, 64, 128, dict(block_v=64, num_warps=8)), (65, 200, 3))]:
    n = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    chunks = chunk_indices(list(lengths))
    gen = torch.Generator().manual_seed(dk + n)
    q = gdr_ref.l2norm(torch.randn(1, n, h, dk, generator=gen))
    k = gdr_ref.l2norm(torch.randn(1, n, h, dk, generator=gen))
    v = torch.randn(1, n, hv, dv, generator=gen)
    beta = torch.rand(1, n, hv, generator=gen)
    a = torch.randn(1, n, hv, generator=gen) * 2
    A_log, dt_bias = torch.randn(hv, generator=gen) * 0.5, torch.randn(hv, generator=gen)
    gc = gate_cumsum(a, A_log, dt_bias, 64, gdr_ref.RCP_LN2, cu, chunks)
    # only the lower triangles of valid rows are written and read
    a_inv = solve_chunks(k, gc, beta, torch.full((1, n, hv, 64), float("nan")), cu, chunks)
    fla = torch.full((1, n, hv, 64), float("nan"))
    SOLVE[(chunks.shape[0], hv)](k=k, g=gc, beta=beta, A=fla, cu_seqlens=cu, chunk_indices=chunks, T=n, H=h, HV=hv,
                                 K=dk, BT=64, BC=16, BK=32, USE_G=True, IS_VARLEN=True)
    solve_distance = max(solve_distance, lower_distance(a_inv, fla, cu))
    bank = torch.full((len(lengths) + 2, hv, dk, dv), float("nan"))  # each document's entry, two left alone
    slots = torch.randperm(len(lengths) + 2, generator=gen)[:len(lengths)]
    out = chunks_wy(q, k, v, gc, beta, a_inv, bank, slots, cu_seqlens=cu, **launch)
    final = bank[slots]
    assert out.shape == v.shape and bank.isnan().sum() == 2 * hv * dk * dv  # no entry but the documents' written
    decay = -A_log.exp() * torch.nn.functional.softplus(a + dt_bias)  # the gate kernel's natural-log decay
    errors = []
    for d, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ref, ref_final = gdr_ref.chunk_gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], decay[:, s:e], beta[:, s:e],
                                                        output_final_state=True, use_qk_l2norm=False)
        errors += [((out[:, s:e] - ref).norm() / ref.norm()).item(),
                   ((final[d] - ref_final[0]).norm() / ref_final[0].norm()).item()]
    print(f"K {dk} V {dv} {launch} documents {lengths}: relative error {max(errors):.3g}")
    worst = max(worst, *errors)
for rows, t, hv, d in [(3, 129, 2, 32), (2, 200, 4, 64)]:
    gen = torch.Generator().manual_seed(t)
    q, k = (gdr_ref.l2norm(torch.randn(rows, t, 1, d, generator=gen)) for _ in range(2))
    v = torch.randn(rows, t, hv, d, generator=gen)
    beta = torch.rand(rows, t, hv, generator=gen)
    gc = gate_cumsum(torch.randn(rows, t, hv, generator=gen), torch.randn(hv, generator=gen) * 0.5,
                     torch.randn(hv, generator=gen), 64, gdr_ref.RCP_LN2)
    a_inv = solve_chunks(k, gc, beta, torch.full((rows, t, hv, 64), float("nan")))
    fla = torch.full((rows, t, hv, 64), float("nan"))
    SOLVE[(triton.cdiv(t, 64), rows * hv)](k=k, g=gc, beta=beta, A=fla, cu_seqlens=None, chunk_indices=None, T=t,
                                           H=1, HV=hv, K=d, BT=64, BC=16, BK=32, USE_G=True, IS_VARLEN=False)
    solve_distance = max(solve_distance, lower_distance(a_inv, fla))
    bank = torch.randn(5, hv, d, d, generator=gen) * 0.3
    snapshot = bank.clone()
    upload = torch.randint(0, 5, (rows, 3), generator=gen)
    out = chunks_wy(q, k, v, gc, beta, a_inv, bank, upload[:, 1], upload.stride(0))
    ref = gdr_ref.branch_wy(q, k, v, gc, beta, gdr_ref.chunk_inverse(k, gc, beta), bank, upload[:, 1], upload.stride(0))
    assert torch.equal(bank, snapshot)
    error = ((out - ref).norm() / ref.norm()).item()
    print(f"rows {rows} x {t} tokens, V {d}: relative error {error:.3g}")
    worst = max(worst, error)
print(f"kkt + solve against FLA's: relative distance {solve_distance:.3g}")
print(f"max relative error {worst:.3g} in {time.perf_counter() - start:.1f} s")
assert worst < 1e-4 and solve_distance < 1e-5, (worst, solve_distance)
