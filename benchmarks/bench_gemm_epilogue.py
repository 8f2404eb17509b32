"""Can a GEMM of our own carry prefill's elementwise work? A Triton TMA GEMM against cuBLAS at prefill's shapes.

NOTES 67: cuBLAS's GEMMs are 658 ms of an 819 ms prefill group, and the elementwise kernels around them can only
go by folding them into a GEMM's epilogue (SwiGLU into the gate|up GEMM: its 25 ms a group). That pays only if
our GEMM runs at cuBLAS's rate. This times, at a prefill group's and a scoring batch's rows: cuBLAS
(`F.linear`) and `kernels/swiglu_gemm.py`'s Triton GEMM (persistent or a program per tile, TMA descriptors)
over a few launch configurations, and for the gate|up shape cuBLAS + our SwiGLU kernel against that GEMM with
SwiGLU in its epilogue. Each checked against torch in fp32 first.

    python benchmarks/bench_gemm_epilogue.py --json OUT.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from kevscore.kernels.elementwise import swiglu_rows
from kevscore.kernels.swiglu_gemm import interleave, swiglu_gemm
from kevscore.measure import environment

# (BM, BN, BK, stages, warps); a configuration that does not fit in shared memory is reported and skipped
CONFIGS = ((128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 4, 4), (256, 128, 64, 3, 8),
           (128, 128, 128, 3, 8), (128, 256, 64, 4, 8))
SHAPES = ((18432, 2560, "gate|up"), (2560, 9216, "down"), (12352, 2560, "DeltaNet in_proj"))


def gemm(a: torch.Tensor, b: torch.Tensor, config, persistent: bool = True, swiglu: bool = False) -> torch.Tensor:
    """a b^T through `swiglu_gemm`'s kernel at launch `config` (its SwiGLU epilogue with swiglu)."""
    bm, bn, bk, stages, warps = config
    return swiglu_gemm(a, b, bn // 2, swiglu, block_m=bm, block_k=bk, num_stages=stages, num_warps=warps,
                       persistent=persistent)


def timed(fn) -> float | None:
    try:
        fn()
        torch.cuda.synchronize()
        return do_bench(fn, warmup=10, rep=60, return_mode="median")
    except Exception as err:  # noqa: BLE001 - a configuration that does not fit: reported, skipped
        print(f"    skipped: {type(err).__name__}: {str(err).splitlines()[0][:90]}")
        return None


def bench_shape(m: int, n: int, k: int, name: str, gen: torch.Generator, record) -> None:
    """cuBLAS and every Triton launch at one shape; the gate|up shape also with SwiGLU after it and in it."""
    a = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    b = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(torch.bfloat16)
    flops = 2 * m * n * k
    ref = F.linear(a[:512].float(), b.float())
    record(name, "cuBLAS F.linear", timed(lambda: F.linear(a, b)), flops)
    for config in CONFIGS:
        for persistent in (True, False):
            try:
                err = (gemm(a, b, config, persistent)[:512].float() - ref).abs().max().item()
            except Exception as exc:  # noqa: BLE001 - a launch that does not fit: reported, skipped
                print(f"    {config}: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}")
                continue
            label = f"Triton {'persistent' if persistent else 'one tile a program'} {config}"
            record(name, label, timed(lambda: gemm(a, b, config, persistent)), flops, err)
    if name != "gate|up":
        return
    ref_swiglu = F.silu(ref[:, : n // 2]) * ref[:, n // 2:]
    record(name, "cuBLAS + swiglu_rows", timed(lambda: swiglu_rows(F.linear(a, b))), flops)
    for config in CONFIGS:
        b_mixed = interleave(*b.chunk(2), config[1] // 2)
        for persistent in (True, False):
            try:
                out = gemm(a, b_mixed, config, persistent, swiglu=True)
                err = (out[:512].float() - ref_swiglu).abs().max().item()
            except Exception as exc:  # noqa: BLE001
                print(f"    swiglu {config}: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}")
                continue
            label = f"Triton {'persistent' if persistent else 'one tile a program'} + SwiGLU {config}"
            record(name, label, timed(lambda: gemm(a, b_mixed, config, persistent, swiglu=True)), flops, err)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[65536, 5440],
                    help="GEMM rows: a prefill group's tokens, a scoring batch's (64 rows x 85 tokens)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for m in args.tokens:
        def record(shape: str, what: str, ms: float | None, flops: float, err: float | None = None) -> None:
            rate = flops / ms / 1e9 if ms else None
            rows.append({"tokens": m, "shape": shape, "variant": what, "ms": ms, "tflops": rate, "max_err": err})
            print(f"{m:>6} {shape:<17}{what:<50}" + (f"{ms * 1000:9.1f} us {rate:5.0f} TFLOP/s" if ms else " failed")
                  + (f"  err {err:.1e}" if err is not None else ""))

        for n, k, name in SHAPES:
            bench_shape(m, n, k, name, gen, record)
            torch.cuda.empty_cache()

    print("\nbest per shape (ms, TFLOP/s; against cuBLAS):")
    for m in args.tokens:
        for _, _, name in SHAPES:
            mine = [r for r in rows if r["tokens"] == m and r["shape"] == name and r["ms"]]
            cublas = next((r for r in mine if r["variant"] == "cuBLAS F.linear"), None)
            ours = min((r for r in mine if r["variant"].startswith("Triton") and "SwiGLU" not in r["variant"]),
                       key=lambda r: r["ms"], default=None)
            if cublas and ours:
                print(f"  {m:>6} {name:<17}cuBLAS {cublas['ms']:.3f} ({cublas['tflops']:.0f}); Triton {ours['ms']:.3f} "
                      f"({ours['tflops']:.0f}) = {cublas['ms'] / ours['ms']:.3f}x cuBLAS's rate, {ours['variant']}")
            pair = next((r for r in mine if r["variant"] == "cuBLAS + swiglu_rows"), None)
            fused = min((r for r in mine if "SwiGLU" in r["variant"]), key=lambda r: r["ms"], default=None)
            if pair and fused:
                print(f"  {'':>6} {'':<17}cuBLAS + SwiGLU {pair['ms']:.3f}; fused {fused['ms']:.3f} "
                      f"({pair['ms'] - fused['ms']:+.3f} ms a layer saved), {fused['variant']}")
    if args.json:
        args.json.write_text(json.dumps({"environment": environment(torch.device("cuda")), "results": rows}, indent=1))


if __name__ == "__main__":
    main()
