"""Run under TRITON_INTERPRET=1: the decay gate's chunk cumsum (kernels/gate.py) against gdr_ref on the CPU, on
rows of equal length and on packed documents, with `a` read in place from a wider projection output."""
import math

import torch

from kevscore.kernels import gdr_ref
from kevscore.kernels.gate import gate_cumsum

LOG2E = 1 / math.log(2)
worst = 0.0
gen = torch.Generator().manual_seed(0)
H = 6
A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H, generator=gen)
for rows, t in ((3, 5), (2, 64), (1, 130)):
    proj = torch.randn(rows, t, 3 * H + 5, generator=gen) * 3
    a = proj[..., 2 * H: 3 * H]  # strided: a slice of the projection output
    ref = gdr_ref.chunk_cumsum(gdr_ref.gate_decay(a, A_log, dt_bias), 64)
    out = gate_cumsum(a, A_log, dt_bias, 64, LOG2E)
    assert out.shape == ref.shape and out.is_contiguous() and out.dtype == torch.float32
    worst = max(worst, ((out - ref).abs().max() / ref.abs().max()).item())
lens = [5, 64, 65, 130, 1]
proj = torch.randn(1, sum(lens), 3 * H + 5, generator=gen) * 3
a = proj[..., 2 * H: 3 * H]
cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
chunks = torch.tensor([[d, c] for d, n in enumerate(lens) for c in range(-(-n // 64))])
out = gate_cumsum(a, A_log, dt_bias, 64, LOG2E, cu, chunks)
for d, n in enumerate(lens):
    doc = a[:, cu[d]: cu[d + 1]]
    ref = gdr_ref.chunk_cumsum(gdr_ref.gate_decay(doc, A_log, dt_bias), 64)
    worst = max(worst, ((out[:, cu[d]: cu[d + 1]] - ref).abs().max() / ref.abs().max()).item())
assert worst < 1e-5, worst
print(f"max |gate cumsum - gdr_ref| / max |gdr_ref| {worst:.2e}")
