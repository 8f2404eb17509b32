"""Run under TRITON_INTERPRET=1: the WY representation of an fp32 model (tests/fla_oracles.wy_repr: the copy of
FLA's (I + A)^-1 kernel with its merges in 3xTF32 that fla_ops.solve_chunks launches, then FLA's w/u kernel)
against the torch reference on the CPU, on packed documents (its prefill) and on rows of one length (its branches)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for fla_oracles
import fla_oracles  # noqa: E402

from kevscore.kernels import gdr_ref  # noqa: E402

fla_oracles.pin_for("NVIDIA H200")  # FLA's w/u kernel with one configuration: nothing to time in the interpreter
torch.cuda.is_current_stream_capturing = lambda: False  # (a CPU build of torch has no CUDA to ask)
h, hv, dk, dv = 2, 4, 64, 32
worst = 0.0
for lens in ([1], [129], [17, 64, 129], [64, 5]):
    gen = torch.Generator().manual_seed(sum(lens))
    t = sum(lens)
    k = gdr_ref.l2norm(torch.randn(1, t, h, dk, generator=gen))
    v = torch.randn(1, t, hv, dv, generator=gen)
    beta = torch.rand(1, t, hv, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(1, t, hv, generator=gen))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    chunks = torch.tensor([[d, c] for d, n in enumerate(lens) for c in range(-(-n // 64))])
    docs = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    gc = torch.cat([gdr_ref.chunk_cumsum(g[:, s:e]) for s, e in docs], 1).contiguous()
    ref = [gdr_ref.wy_repr(k[:, s:e], v[:, s:e], gc[:, s:e], beta[:, s:e]) for s, e in docs]
    want = [torch.cat([r[i] for r in ref], 1) for i in (0, 1)]
    got = [fla_oracles.wy_repr(k, v, gc, beta, cu, chunks)]
    if len(lens) == 1:  # one row: the branch path (no cu_seqlens)
        got.append(fla_oracles.wy_repr(k, v, gc, beta))
    for pair in got:
        worst = max([worst] + [((x - y).norm() / y.norm()).item() for x, y in zip(pair, want)])
print(f"max relative error {worst:.3g}")
assert worst < 1e-4, worst
