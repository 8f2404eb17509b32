"""Experiment (NOTES 121): the RMSNorm and gated norm kernels' launch configurations against HBM bandwidth.

    python benchmarks/exp_norm_launch.py --json out.json

Prefill's RMSNorm (`elementwise.rms_norm_rows`, 64 launches a group) measured ~45 ms per 131k tokens on Kev-4B
(RESULTS v39), ~1.9 TB/s of reads and writes; the gated norm ~20 ms. This times each kernel on a prefill group's
activations ([tokens, hidden] bf16; the gated norm on [tokens, value heads, 128] with its gate a strided slice, as
DeltaNet reads it) at every launch configuration of a small grid, beside a copy of the same bytes (`clone`, the
bandwidth the GPU gives such a pass) and torch's own `rms_norm`. Medians of 20 after 5 warm-up calls, CUDA events.
Prints each kernel's default and best configuration with their TB/s; writes every point to JSON.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--model", default="kev-4b")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import torch

    from kevscore.kernels.elementwise import gated_rms_norm_heads, rms_norm_rows
    from kevscore.measure import events_ms
    from kevscore.model.config import SHAPES

    cfg = SHAPES[args.model]
    dev, n, h = torch.device("cuda"), args.tokens, cfg.hidden_size
    x = torch.randn(n, h, device=dev, dtype=torch.bfloat16)
    w = torch.rand(h, device=dev)
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    o = torch.randn(n, hv, dv, device=dev, dtype=torch.bfloat16)
    z = torch.randn(n, 2 * hv * dv, device=dev, dtype=torch.bfloat16)[:, : hv * dv].view(n, hv, dv)
    gw = torch.rand(dv, device=dev)

    def ms(fn) -> float:
        return statistics.median(events_ms(fn, reps=20, warmup=5))

    points = []

    def record(kernel: str, config: str, t: float, nbytes: int) -> None:
        points.append({"kernel": kernel, "config": config, "ms": t, "tb_per_s": nbytes / t / 1e9})

    norm_bytes, gated_bytes = 2 * x.numel() * 2, 3 * o.numel() * 2
    record("copy", "clone [tokens, hidden]", ms(lambda: x.clone()), norm_bytes)
    record("copy", "clone [tokens, hv, dv]", ms(lambda: o.clone()), 2 * o.numel() * 2)
    record("torch rms_norm", "F.rms_norm", ms(lambda: torch.nn.functional.rms_norm(x, (h,), w.bfloat16(), 1e-6)),
           norm_bytes)
    for rows, warps in itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8, 16)):
        if rows * triton_next_pow2(h) // (32 * warps) > 256:  # more than 256 values a thread: spills
            continue
        record("rms_norm", f"rows {rows} warps {warps}",
               ms(lambda: rms_norm_rows(x, w, 1e-6, block_rows=rows, num_warps=warps)), norm_bytes)
    for block_t, warps in itertools.product((4, 8, 16, 32, 64), (1, 2, 4, 8)):
        record("gated norm", f"block_t {block_t} warps {warps}",
               ms(lambda: gated_rms_norm_heads(o, z, gw, 1e-6, block_t=block_t, num_warps=warps)), gated_bytes)

    defaults = {"rms_norm": "rows 4 warps 8", "gated norm": "block_t 16 warps 4"}
    print(f"{args.model}: {n} tokens, hidden {h}, value heads {hv} x {dv}")
    print(f"{'kernel':>16} {'config':>24} {'ms':>8} {'TB/s':>6}")
    for p in points:
        if p["kernel"] in ("copy", "torch rms_norm"):
            print(f"{p['kernel']:>16} {p['config']:>24} {p['ms']:8.3f} {p['tb_per_s']:6.2f}")
    for kernel, default in defaults.items():
        mine = [p for p in points if p["kernel"] == kernel]
        best = min(mine, key=lambda p: p["ms"])
        base = next(p for p in mine if p["config"] == default)
        for label, p in (("default", base), ("best", best)):
            print(f"{kernel:>16} {label + ': ' + p['config']:>24} {p['ms']:8.3f} {p['tb_per_s']:6.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, "tokens": n, "points": points}, indent=1))


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


if __name__ == "__main__":
    main()
