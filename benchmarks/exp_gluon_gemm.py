"""Experiment (not kept in the package): warp-specialized Hopper GEMMs in Gluon against cuBLAS at the job's shapes.

    python benchmarks/exp_gluon_gemm.py [--json out.json]      # on the GPU: correctness, then TFLOP/s
    python benchmarks/exp_gluon_gemm.py --compile-only         # anywhere: compile each variant for sm_90a

C = A W^T, bf16 in and out, fp32 accumulation; persistent programs, one per SM, tiles grouped along M. Variants:
- pingpong: two consumer warpgroups on alternate tiles (one in the default partition, one a worker) and a
  one-warp TMA loader; a consumer's epilogue overlaps the other's main loop.
- coop: one 8-warp consumer on a [BM, BN] tile and the loader; the epilogue's TMA store overlaps the next tile.
"""


import argparse
import json

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.core import _aggregate as aggregate


@aggregate
class Shared:
    a_desc: tma.tensor_descriptor
    w_desc: tma.tensor_descriptor
    c_desc: tma.tensor_descriptor
    a_bufs: gl.shared_memory_descriptor
    w_bufs: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    done: gl.shared_memory_descriptor
    GROUP_M: gl.constexpr
    CONSUMERS: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, a_desc, w_desc, c_desc, a_bufs, w_bufs, ready, empty, done, GROUP_M, CONSUMERS):
        self.a_desc, self.w_desc, self.c_desc = a_desc, w_desc, c_desc
        self.a_bufs, self.w_bufs, self.ready, self.empty, self.done = a_bufs, w_bufs, ready, empty, done
        self.GROUP_M, self.CONSUMERS = gl.constexpr(GROUP_M), gl.constexpr(CONSUMERS)


@gluon.jit
def _tile(p, i):
    """The program's i-th output tile (its M and N offsets), tiles grouped by GROUP_M rows of tiles."""
    BM: gl.constexpr = p.a_desc.block_type.shape[0]
    BN: gl.constexpr = p.w_desc.block_type.shape[0]
    tiles_m = gl.cdiv(p.a_desc.shape[0], BM)
    tiles_n = gl.cdiv(p.w_desc.shape[0], BN)
    tile = gl.program_id(0) + i * gl.num_programs(0)
    per_group = p.GROUP_M * tiles_n
    first_m = (tile // per_group) * p.GROUP_M
    rows = min(tiles_m - first_m, p.GROUP_M)
    return (first_m + (tile % per_group) % rows) * BM, ((tile % per_group) // rows) * BN


@gluon.jit
def _my_tiles(p):
    BM: gl.constexpr = p.a_desc.block_type.shape[0]
    BN: gl.constexpr = p.w_desc.block_type.shape[0]
    total = gl.cdiv(p.a_desc.shape[0], BM) * gl.cdiv(p.w_desc.shape[0], BN)
    return gl.cdiv(total - gl.program_id(0), gl.num_programs(0))


@gluon.jit
def _loader(p, role: gl.constexpr, num_warps: gl.constexpr):
    BK: gl.constexpr = p.a_desc.block_type.shape[1]
    STAGES: gl.constexpr = p.a_bufs.shape[0]
    steps = gl.cdiv(p.a_desc.shape[1], BK)
    for i in range(_my_tiles(p)):
        off_m, off_n = _tile(p, i)
        for kk in range(steps):
            g = i * steps + kk
            s = g % STAGES
            mbarrier.wait(p.empty.index(s), ((g // STAGES) & 1) ^ 1)
            bar = p.ready.index(s)
            mbarrier.expect(bar, p.a_desc.block_type.nbytes + p.w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(p.a_desc, [off_m, kk * BK], bar, p.a_bufs.index(s))
            tma.async_copy_global_to_shared(p.w_desc, [off_n, kk * BK], bar, p.w_bufs.index(s))


@gluon.jit
def _consumer(p, role: gl.constexpr, num_warps: gl.constexpr):
    """Tiles role, role + CONSUMERS, ... of the program's list: main loop, then the epilogue through its own
    shared buffer and a TMA store left in flight until its next epilogue. Two consumers take turns at the main
    loop (tile i's starts once tile i - 1's has ended: `done`), so every load before a tile's own has been
    consumed when its consumer waits on a stage, and each wait's parity names one phase."""
    BM: gl.constexpr = p.a_desc.block_type.shape[0]
    BN: gl.constexpr = p.w_desc.block_type.shape[0]
    BK: gl.constexpr = p.a_desc.block_type.shape[1]
    STAGES: gl.constexpr = p.a_bufs.shape[0]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    c_smem = gl.allocate_shared_memory(p.c_desc.dtype, p.c_desc.block_type.shape, p.c_desc.layout)
    steps = gl.cdiv(p.a_desc.shape[1], BK)
    for i in range(role, _my_tiles(p), p.CONSUMERS):
        off_m, off_n = _tile(p, i)
        if p.CONSUMERS == 2:  # the other consumer's main loop of tile i - 1 (its (i - 1) // 2-th tile) has ended
            mbarrier.wait(p.done.index(1 - role), ((i - 1) // 2) & 1, pred=i > 0)
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
        prev = 0
        for kk in range(steps):
            g = i * steps + kk
            s = g % STAGES
            mbarrier.wait(p.ready.index(s), (g // STAGES) & 1)
            acc = warpgroup_mma(p.a_bufs.index(s), p.w_bufs.index(s).permute((1, 0)), acc, use_acc=kk > 0,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(p.empty.index(prev), pred=kk > 0)
            prev = s
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(p.empty.index(prev))
        mbarrier.arrive(p.done.index(role))
        out = acc.to(p.c_desc.dtype)
        tma.store_wait(pendings=0)
        c_smem.store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(p.c_desc, [off_m, off_n], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def gemm_ws_kernel(a_desc, w_desc, c_desc, STAGES: gl.constexpr, GROUP_M: gl.constexpr, CONSUMERS: gl.constexpr,
                   CONSUMER_WARPS: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for c in gl.static_range(2):
        mbarrier.init(done.index(c), count=1)
    p = Shared(a_desc, w_desc, c_desc, a_bufs, w_bufs, ready, empty, done, GROUP_M, CONSUMERS)
    if CONSUMERS == 2:
        gl.warp_specialize([(_consumer, (p, 0, num_warps)), (_consumer, (p, 1, CONSUMER_WARPS)),
                            (_loader, (p, 0, 1))], [CONSUMER_WARPS, 1], [CONSUMER_REGS, 40])
    else:
        gl.warp_specialize([(_consumer, (p, 0, num_warps)), (_loader, (p, 0, 1))], [1], [40])


# name -> (BM, BN, BK, STAGES, consumers, warps per consumer, registers a worker consumer gets, maxnreg)
VARIANTS = {
    "pingpong 128x128 s4": (128, 128, 64, 4, 2, 4, 232, 168),
    "pingpong 128x128 s5": (128, 128, 64, 5, 2, 4, 232, 168),
    "pingpong 64x256 s4": (64, 256, 64, 4, 2, 4, 232, 168),
    "coop 128x256 s3": (128, 256, 64, 3, 1, 8, 0, None),
    "coop 128x256 s4 bk32": (128, 256, 32, 4, 1, 8, 0, None),
}
SHAPES = {  # name -> (M, N, K): ragged edges, prefill's K = 2,560 GEMMs at a 65,536-token group, scoring's, the roof's
    "ragged 1000": (1000, 776, 328),
    "in_proj 65536": (65536, 12352, 2560),
    "gate|up 65536": (65536, 18432, 2560),
    "gate|up 8448": (8448, 18432, 2560),
    "down 65536": (65536, 2560, 9216),
    "8192^3": (8192, 8192, 8192),
}


def descriptors(a, w, c, bm, bn, bk):
    layout = gl.NVMMASharedLayout.get_default_for
    return (TensorDescriptor.from_tensor(a, [bm, bk], layout([bm, bk], gl.bfloat16)),
            TensorDescriptor.from_tensor(w, [bn, bk], layout([bn, bk], gl.bfloat16)),
            TensorDescriptor.from_tensor(c, [bm, bn], layout([bm, bn], gl.bfloat16)))


def launch(variant, a, w, c, programs):
    bm, bn, bk, stages, consumers, cwarps, cregs, maxnreg = VARIANTS[variant]
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    gemm_ws_kernel[(programs,)](*descriptors(a, w, c, bm, bn, bk), STAGES=stages, GROUP_M=8, CONSUMERS=consumers,
                                CONSUMER_WARPS=cwarps, CONSUMER_REGS=cregs, num_warps=cwarps, **extra)


def ptxas_report(compiled) -> str:
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(compiled.asm["ptx"])
        out = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(Path(tmp) / "k.ptx"), "-o",
                              str(Path(tmp) / "k.o")], capture_output=True, text=True).stderr
    regs = re.findall(r"Used (\d+) registers", out)
    spills = re.findall(r"(\d+) bytes spill", out)
    return f"registers {regs}, spill bytes {spills}" if regs else out[-600:]


def compile_only() -> None:
    """Each variant compiled for sm_90a without a GPU: shared memory and registers, or the error."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    m, n, k = SHAPES["gate|up 65536"]
    for name, (bm, bn, bk, stages, consumers, cwarps, cregs, maxnreg) in VARIANTS.items():
        a, w, c = (torch.empty(r, cols, dtype=torch.bfloat16) for r, cols in ((m, k), (n, k), (m, n)))
        descs = descriptors(a, w, c, bm, bn, bk)
        fn = gemm_ws_kernel
        sig = {"a_desc": mangle_type(descs[0]), "w_desc": mangle_type(descs[1]), "c_desc": mangle_type(descs[2])}
        consts = dict(STAGES=stages, GROUP_M=8, CONSUMERS=consumers, CONSUMER_WARPS=cwarps, CONSUMER_REGS=cregs,
                      num_warps=cwarps)
        sig.update({key: "constexpr" for key in consts})
        src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(key),): v for key, v in consts.items()})
        options = {"num_warps": cwarps, "num_stages": 1, **({} if maxnreg is None else {"maxnreg": maxnreg})}
        try:
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
            print(f"{name:24} ok: shared {compiled.metadata.shared} B, {ptxas_report(compiled)}")
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"{name:24} FAILED: {type(exc).__name__}: {str(exc)[:2000]}")


def bench(json_path, variants) -> None:
    torch.manual_seed(0)
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    results = {}
    for shape, (m, n, k) in SHAPES.items():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        ref = a @ w.T
        row = {}
        for name in ("cublas", *variants):
            c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

            def run(name=name, c=c):
                if name == "cublas":
                    torch.matmul(a, w.T, out=c)
                else:
                    launch(name, a, w, c, programs)
            try:
                run()
                torch.cuda.synchronize()
                err = (c.float() - ref.float()).abs().max().item()
                for _ in range(3):
                    run()
                times = []
                for _ in range(10):
                    start.record()
                    run()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                ms = sorted(times)[len(times) // 2]
                row[name] = {"ms": ms, "tflops": 2 * m * n * k / ms / 1e9, "max_abs_err": err}
            except Exception as exc:  # noqa: BLE001 - one variant's failure is a result too
                row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
        results[shape] = row
    print(f"{'shape':16} " + " ".join(f"{v[:22]:>22}" for v in ("cublas", *variants)))
    for shape, row in results.items():
        cells = []
        for name in ("cublas", *variants):
            r = row[name]
            cells.append(f"{'error':>22}" if "error" in r else f"{r['tflops']:8.1f} TF err {r['max_abs_err']:.1e}")
        print(f"{shape:16} " + " ".join(f"{cell:>22}" for cell in cells))
    for shape, row in results.items():
        for name, r in row.items():
            if "error" in r:
                print(f"{shape} {name}: {r['error']}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names from VARIANTS")
    args = ap.parse_args()
    compile_only() if args.compile_only else bench(args.json, args.variants.split(","))
