"""Can a GEMM of our own carry prefill's elementwise work? A Triton TMA GEMM against cuBLAS at prefill's shapes.

NOTES 67: cuBLAS's GEMMs are 658 ms of an 819 ms prefill group, and the elementwise kernels around them can only
go by folding them into a GEMM's epilogue (SwiGLU into the gate|up GEMM: its 25 ms a group). That pays only if
our GEMM runs at cuBLAS's rate. This times, at 65,536 tokens: cuBLAS (`F.linear`), a persistent Triton GEMM
with TMA descriptors over a few launch configurations, and for the gate|up shape cuBLAS + our SwiGLU kernel
against the Triton GEMM with SwiGLU in its epilogue (the weight's gate and up rows interleaved in blocks of half
a tile, so that each output tile holds a block of both). Each checked against torch in fp32 first.

    python benchmarks/bench_gemm_epilogue.py --json OUT.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

from kevscore.kernels.elementwise import swiglu_rows
from kevscore.measure import environment

# (BM, BN, BK, stages, warps); a configuration that does not fit in shared memory is reported and skipped
CONFIGS = ((128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 4, 4), (256, 128, 64, 3, 8),
           (128, 128, 128, 3, 8), (128, 256, 64, 4, 8))
SHAPES = ((18432, 2560, "gate|up"), (2560, 9216, "down"), (12352, 2560, "DeltaNet in_proj"))


@triton.jit(do_not_specialize=["M", "PROGRAMS"])
def _gemm_kernel(a_desc, b_desc, c_desc, M, N, K, PROGRAMS, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr, SWIGLU: tl.constexpr):
    """C = A B^T for A [M, K], B [N, K]; tiles in groups of GROUP_M rows of tiles (L2 reuse of B), each program
    taking every PROGRAMS-th tile. SWIGLU: B's rows hold gate and up in alternate blocks of BN / 2, and the
    tile's output is silu(gate) * up, [BM, BN / 2] at column pid_n * BN / 2."""
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GROUP_M * tiles_n
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True):
        first_m = (tile // per_group) * GROUP_M
        rows = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % rows
        pid_n = (tile % per_group) // rows
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BK)):
            a = a_desc.load([pid_m * BM, ki * BK])
            b = b_desc.load([pid_n * BN, ki * BK])
            acc = tl.dot(a, b.T, acc)
        if SWIGLU:
            gate, up = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
            c_desc.store([pid_m * BM, pid_n * (BN // 2)], (gate * tl.sigmoid(gate) * up).to(c_desc.dtype))
        else:
            c_desc.store([pid_m * BM, pid_n * BN], acc.to(c_desc.dtype))


def gemm(a: torch.Tensor, b: torch.Tensor, config, persistent: bool = True, swiglu: bool = False) -> torch.Tensor:
    bm, bn, bk, stages, warps = config
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty(m, n // 2 if swiglu else n, dtype=a.dtype, device=a.device)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    programs = min(tiles, torch.cuda.get_device_properties(a.device).multi_processor_count) if persistent else tiles
    _gemm_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(b, [bn, bk]),
        TensorDescriptor.from_tensor(c, [bm, bn // 2 if swiglu else bn]), m, n, k, programs, BM=bm, BN=bn, BK=bk, GROUP_M=8,
        SWIGLU=swiglu, num_stages=stages, num_warps=warps)
    return c


def interleaved(gate_up: torch.Tensor, half: int) -> torch.Tensor:
    """gate|up rows [2 I, K] reordered as alternate blocks of `half` gate rows and `half` up rows."""
    inner = gate_up.shape[0] // 2
    gate, up = gate_up[:inner].view(inner // half, half, -1), gate_up[inner:].view(inner // half, half, -1)
    return torch.stack([gate, up], 1).reshape(gate_up.shape).contiguous()


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
        b_mixed = interleaved(b, config[1] // 2)
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
