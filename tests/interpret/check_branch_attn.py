"""Run under TRITON_INTERPRET=1: the branch attention kernel against the torch ops on the CPU (fp32, the
launches of both models), with the document start and length as strided upload-buffer columns."""
import torch

from kevscore.kernels import torch_ops
from kevscore.kernels.branch_attn import branch_attention
from kevscore.kernels.fla_ops import ATTN_FP32
from kevscore.model.layers.common import BranchContext

nh, nkv, d, rows = 4, 2, 64, 5
worst = 0.0
for t in (1, 17, 70):
    gen = torch.Generator().manual_seed(t)
    q = torch.randn(rows, t, nh, d, generator=gen)
    kv = torch.randn(rows, t, 2 * nkv, d, generator=gen)
    k, v = kv[:, :, :nkv], kv[:, :, nkv:]
    pool = torch.randn(2, 3000, nkv, d, generator=gen)
    for gap in (slice(1, 100), slice(700, 2000), slice(2999, None)):  # past each document: a tile's rows to mask
        pool[:, gap] = float("nan")
    upload = torch.randint(0, 3000, (rows, 7), generator=gen)
    upload[:, 3] = torch.tensor([0, 100, 700, 2000, 100])
    upload[:, 5] = torch.tensor([1, 600, 0, 999, 600])
    start, plen = upload[:, 3], upload[:, 5]
    steps = torch.arange(1024)
    mask = steps[None] < plen[:, None]
    ctx = BranchContext(positions=None, slots=None, kv_index=torch.where(mask, start[:, None] + steps, 0),
                        kv_mask=mask, kv_start=None, kv_len=None, path="indexed")
    ref = torch_ops.attn_branch(q, k, v, None, pool, ctx)
    out = branch_attention(q, k, v, pool[0], pool[1], start, plen)
    worst = max(worst, ((out - ref).norm() / ref.norm()).nan_to_num(float("inf")).item())
    gate = torch.randn(rows, t, nh, 2 * d, generator=gen)[..., d:]  # the gate half of the q|gate projection
    ref = torch_ops.attn_branch(q, k, v, gate, pool, ctx)
    out = branch_attention(q, k, v, pool[0], pool[1], start, plen, gate=gate, block_m=32)
    worst = max(worst, ((out - ref).norm() / ref.norm()).nan_to_num(float("inf")).item())
    out = branch_attention(q, k, v, pool[0], pool[1], start, plen, gate=gate, **ATTN_FP32)  # the fp32 model's tiles
    worst = max(worst, ((out - ref).norm() / ref.norm()).nan_to_num(float("inf")).item())
print(f"max relative error {worst:.3g}")
assert worst < 1e-5, worst
