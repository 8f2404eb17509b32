"""Experiment (not in the package): prefill's chunk loop warp-specialized in Gluon, against `branch_wy.chunks_wy`.

    python benchmarks/exp_gluon_chunk.py [--tokens 65536] [--json out.json]   # on the GPU
    python benchmarks/exp_gluon_chunk.py --compile-only                       # anywhere: build for sm_90a

`chunks_wy` (packed documents) runs each (document, value head, value block) as one chain of six dots a chunk at
two programs an SM. Here three partitions share a program: a one-warp loader brings each chunk's q, k, v and
(I + A)^-1 tiles through TMA into a two-stage ring; the chain (4 warps) computes v_new and the state update
(three dots) and hands each chunk's entering state and v_new to the output partition (4 warps) through shared
memory, which computes the chunk's output (three dots) off the chain. Same arithmetic as `chunks_wy`: v_new =
A_inv (beta (v - exp2(g) k h)), o = scale (exp2(g) q h + causal(q k^T exp2(g_i - g_j)) v_new), h' = exp2(g_last) h
+ k^T (v_new exp2(g_last - g)), the dots' operands in bf16, the state in fp32.
"""
import argparse
import json
import os
import sys
from pathlib import Path

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

CHUNK = 64
BT = gl.constexpr(CHUNK)  # the chunk, in the kernels


@aggregate
class Chunks:
    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    a_desc: tma.tensor_descriptor
    q_bufs: gl.shared_memory_descriptor
    k_bufs: gl.shared_memory_descriptor
    v_bufs: gl.shared_memory_descriptor
    a_bufs: gl.shared_memory_descriptor
    h_bufs: gl.shared_memory_descriptor
    vn_bufs: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    h_ready: gl.shared_memory_descriptor
    h_empty: gl.shared_memory_descriptor
    vn_ready: gl.shared_memory_descriptor
    vn_empty: gl.shared_memory_descriptor
    g: gl.tensor
    o: gl.tensor
    bos: gl.tensor
    T: gl.tensor
    i_h: gl.tensor
    i_v: gl.tensor
    HV: gl.constexpr
    H: gl.constexpr
    V: gl.constexpr
    MODE: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, q_desc, k_desc, v_desc, a_desc, q_bufs, k_bufs, v_bufs, a_bufs, h_bufs, vn_bufs, ready, empty,
                 h_ready, h_empty, vn_ready, vn_empty, g, o, bos, T, i_h, i_v, HV, H, V, MODE):
        self.q_desc, self.k_desc, self.v_desc, self.a_desc = q_desc, k_desc, v_desc, a_desc
        self.q_bufs, self.k_bufs, self.v_bufs, self.a_bufs = q_bufs, k_bufs, v_bufs, a_bufs
        self.h_bufs, self.vn_bufs = h_bufs, vn_bufs
        self.ready, self.empty, self.h_ready, self.h_empty = ready, empty, h_ready, h_empty
        self.vn_ready, self.vn_empty = vn_ready, vn_empty
        self.g, self.o, self.bos, self.T, self.i_h, self.i_v = g, o, bos, T, i_h, i_v
        self.HV, self.H, self.V, self.MODE = gl.constexpr(HV), gl.constexpr(H), gl.constexpr(V), gl.constexpr(MODE)


@gluon.jit
def _key_col(p):
    K: gl.constexpr = p.k_desc.block_type.shape[1]
    return (p.i_h // (p.HV // p.H)) * K


@gluon.jit
def _loader(p, scale: gl.constexpr, which: gl.constexpr, num_warps: gl.constexpr):
    BV: gl.constexpr = p.v_desc.block_type.shape[1]
    STAGES: gl.constexpr = p.q_bufs.shape[0]
    nbytes: gl.constexpr = (p.q_desc.block_type.nbytes + p.k_desc.block_type.nbytes + p.v_desc.block_type.nbytes
                            + p.a_desc.block_type.nbytes)
    col_k = _key_col(p)
    for c in range(gl.cdiv(p.T, BT)):
        s = c % STAGES
        mbarrier.wait(p.empty.index(s), ((c // STAGES) & 1) ^ 1)
        bar = p.ready.index(s)
        mbarrier.expect(bar, nbytes)
        row = p.bos + c * BT
        tma.async_copy_global_to_shared(p.q_desc, [row, col_k], bar, p.q_bufs.index(s))
        tma.async_copy_global_to_shared(p.k_desc, [row, col_k], bar, p.k_bufs.index(s))
        tma.async_copy_global_to_shared(p.v_desc, [row, p.i_h * p.V + p.i_v * BV], bar, p.v_bufs.index(s))
        tma.async_copy_global_to_shared(p.a_desc, [row, p.i_h * BT], bar, p.a_bufs.index(s))


@gluon.jit
def _row_gates(p, c, rows_layout: gl.constexpr):
    """Chunk c's cumulative gate along `rows_layout` (0 past the document and past its last chunk)."""
    o_t = c * BT + gl.arange(0, BT, layout=rows_layout)
    return gl.load(p.g + (p.bos + o_t).to(gl.int64) * p.HV + p.i_h, mask=o_t < p.T, other=0.0)


@gluon.jit
def _output(p, scale: gl.constexpr, which: gl.constexpr, num_warps: gl.constexpr):
    """The output of chunks which, which + 2, ... (stage and buffers `which`) from their q, k, entering state
    and v_new: three dots off the chain. The gates of the next chunk load while a chunk's dots run."""
    BV: gl.constexpr = p.v_desc.block_type.shape[1]
    L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
    LS: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L, k_width=2)
    dt: gl.constexpr = p.q_desc.dtype
    o_i = gl.arange(0, BT, layout=gl.SliceLayout(1, LS))
    o_j = gl.arange(0, BT, layout=gl.SliceLayout(0, LS))
    o_c = p.i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, L))
    g_i, g_j = _row_gates(p, which, gl.SliceLayout(1, LS)), _row_gates(p, which, gl.SliceLayout(0, LS))
    for c in range(which, gl.cdiv(p.T, BT), 2):
        s = which
        b = which
        mbarrier.wait(p.ready.index(s), (c // 2) & 1)
        if p.MODE == 1:  # diagnosis: the chain alone (this partition only hands buffers back)
            mbarrier.wait(p.h_ready.index(b), (c // 2) & 1)
            mbarrier.arrive(p.h_empty.index(b))
            mbarrier.arrive(p.empty.index(s))
            mbarrier.wait(p.vn_ready.index(b), (c // 2) & 1)
            mbarrier.arrive(p.vn_empty.index(b))
        else:
            s_qk = warpgroup_mma(p.q_bufs.index(s), p.k_bufs.index(s).permute((1, 0)),
                                 gl.zeros([BT, BT], gl.float32, LS), use_acc=False, is_async=True)
            m_low = (o_j[None, :] <= o_i[:, None]) & (c * BT + o_i < p.T)[:, None]
            decay = gl.exp2(gl.where(m_low, g_i[:, None] - g_j[None, :], 0.0))
            g_o = gl.convert_layout(g_i, gl.SliceLayout(1, L))
            g_i, g_j = _row_gates(p, c + 2, gl.SliceLayout(1, LS)), _row_gates(p, c + 2, gl.SliceLayout(0, LS))
            s_qk = warpgroup_mma_wait(num_outstanding=0, deps=(s_qk, ))
            s_op = gl.convert_layout(gl.where(m_low, s_qk * decay, 0.0).to(dt), A_OP)
            mbarrier.wait(p.h_ready.index(b), (c // 2) & 1)
            o_h = warpgroup_mma(p.q_bufs.index(s), p.h_bufs.index(b), gl.zeros([BT, BV], gl.float32, L), use_acc=False)
            fence_async_shared()
            mbarrier.arrive(p.h_empty.index(b))
            mbarrier.arrive(p.empty.index(s))  # q and k: done with this stage
            acc = o_h * gl.exp2(g_o)[:, None]
            mbarrier.wait(p.vn_ready.index(b), (c // 2) & 1)
            acc = warpgroup_mma(s_op, p.vn_bufs.index(b), acc)
            fence_async_shared()
            mbarrier.arrive(p.vn_empty.index(b))
            o_r = c * BT + gl.arange(0, BT, layout=gl.SliceLayout(1, L))
            ptr = p.o + ((p.bos + o_r).to(gl.int64) * p.HV + p.i_h)[:, None] * p.V + o_c[None, :]
            gl.store(ptr, (acc * scale).to(dt), mask=(o_r < p.T)[:, None])


@gluon.jit
def _chain(p, beta, bank, slot, bank_stride, VN_LAYOUT: gl.constexpr, num_warps: gl.constexpr):
    """v_new and the state from chunk to chunk; publishes each chunk's entering state and v_new; writes the
    document's final state (fp32) into its bank entry. Chunk c + 1's gates and betas load while chunk c's dots
    run, and (I + A)^-1 and v are read from shared memory while k h runs."""
    K: gl.constexpr = p.k_desc.block_type.shape[1]
    BV: gl.constexpr = p.v_desc.block_type.shape[1]
    STAGES: gl.constexpr = p.q_bufs.shape[0]
    L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
    LA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L, k_width=2)
    dt: gl.constexpr = p.q_desc.dtype
    x_smem = gl.allocate_shared_memory(dt, [BT, BV], VN_LAYOUT)
    h = gl.zeros([K, BV], gl.float32, L)
    o_ia = gl.arange(0, BT, layout=gl.SliceLayout(1, LA))
    o_ja = gl.arange(0, BT, layout=gl.SliceLayout(0, LA))
    o_i = gl.arange(0, BT, layout=gl.SliceLayout(1, L))
    g = _row_gates(p, 0, gl.SliceLayout(1, L))
    b_b = gl.load(beta + (p.bos + o_i).to(gl.int64) * p.HV + p.i_h, mask=o_i < p.T, other=0.0)
    g_last = gl.load(p.g + (p.bos + gl.minimum(BT, p.T) - 1).to(gl.int64) * p.HV + p.i_h)
    for c in range(gl.cdiv(p.T, BT)):
        s = c % STAGES
        b = c % 2
        mbarrier.wait(p.ready.index(s), (c // STAGES) & 1)
        if p.MODE == 2:  # diagnosis: the output partition alone (the chain only hands buffers over)
            mbarrier.wait(p.h_empty.index(b), ((c // 2) & 1) ^ 1)
            mbarrier.arrive(p.h_ready.index(b))
            mbarrier.wait(p.vn_empty.index(b), ((c // 2) & 1) ^ 1)
            mbarrier.arrive(p.vn_ready.index(b))
        else:
            # the entering state, for this chain's dot and the output partition's
            mbarrier.wait(p.h_empty.index(b), ((c // 2) & 1) ^ 1)
            p.h_bufs.index(b).store(h.to(dt))
            fence_async_shared()
            mbarrier.arrive(p.h_ready.index(b))
            kh = warpgroup_mma(p.k_bufs.index(s), p.h_bufs.index(b), gl.zeros([BT, BV], gl.float32, L), use_acc=False,
                               is_async=True)
            # (I + A)^-1 on its valid lower triangle (rows past the document are the next one's), and v
            m_low = (o_ja[None, :] <= o_ia[:, None]) & (c * BT + o_ia < p.T)[:, None]
            a = gl.convert_layout(gl.where(m_low, p.a_bufs.index(s).load(LA), 0.0).to(dt), A_OP)
            v = p.v_bufs.index(s).load(L).to(gl.float32)
            eg, bf, gl_c, dl = gl.exp2(g), b_b.to(gl.float32), gl.exp2(g_last), gl.exp2(g_last - g)
            n_t = (c + 1) * BT + o_i
            g = _row_gates(p, c + 1, gl.SliceLayout(1, L))
            b_b = gl.load(beta + (p.bos + n_t).to(gl.int64) * p.HV + p.i_h, mask=n_t < p.T, other=0.0)
            g_last = gl.load(p.g + (p.bos + gl.minimum((c + 2) * BT, p.T) - 1).to(gl.int64) * p.HV + p.i_h)
            kh = warpgroup_mma_wait(num_outstanding=0, deps=(kh, ))
            x_smem.store(((v - kh * eg[:, None]) * bf[:, None]).to(dt))
            fence_async_shared()
            vn = warpgroup_mma(a, x_smem, gl.zeros([BT, BV], gl.float32, L), use_acc=False)
            mbarrier.wait(p.vn_empty.index(b), ((c // 2) & 1) ^ 1)
            p.vn_bufs.index(b).store(vn.to(dt))
            x_smem.store((vn * dl[:, None]).to(dt))
            fence_async_shared()
            mbarrier.arrive(p.vn_ready.index(b))
            h = warpgroup_mma(p.k_bufs.index(s).permute((1, 0)), x_smem, h * gl_c)
        mbarrier.arrive(p.empty.index(s))  # k, v and A_inv: done with this stage
    o_k = gl.arange(0, K, layout=gl.SliceLayout(1, L))
    o_c = p.i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, L))
    gl.store(bank + slot * bank_stride + p.i_h * K * p.V + o_k[:, None] * p.V + o_c[None, :], h)


@gluon.jit
def chunks_ws_kernel(q_desc, k_desc, v_desc, a_desc, g, beta, o, cu_seqlens, bank, index, bank_stride,
                     scale: gl.constexpr, H: gl.constexpr, HV: gl.constexpr, V: gl.constexpr, STAGES: gl.constexpr,
                     OUT_REGS: gl.constexpr, H_LAYOUT: gl.constexpr, VN_LAYOUT: gl.constexpr, MODE: gl.constexpr,
                     num_warps: gl.constexpr):
    K: gl.constexpr = k_desc.block_type.shape[1]
    BV: gl.constexpr = v_desc.block_type.shape[1]
    dt: gl.constexpr = q_desc.dtype
    i_v, i_nh = gl.program_id(0), gl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    bos = gl.load(cu_seqlens + i_n).to(gl.int32)
    T = gl.load(cu_seqlens + i_n + 1).to(gl.int32) - bos
    slot = gl.load(index + i_n).to(gl.int64)

    gl.static_assert(STAGES == 2, "each output partition owns one stage")
    q_bufs = gl.allocate_shared_memory(dt, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dt, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dt, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    a_bufs = gl.allocate_shared_memory(dt, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    h_bufs = gl.allocate_shared_memory(dt, [2, K, BV], H_LAYOUT)
    vn_bufs = gl.allocate_shared_memory(dt, [2, BT, BV], VN_LAYOUT)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    h_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    h_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    vn_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    vn_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # the chain and the output partition
    for i in gl.static_range(2):
        for bar in gl.static_range(4):
            mbarrier.init((h_ready, h_empty, vn_ready, vn_empty)[bar].index(i), count=1)
    p = Chunks(q_desc, k_desc, v_desc, a_desc, q_bufs, k_bufs, v_bufs, a_bufs, h_bufs, vn_bufs, ready, empty,
               h_ready, h_empty, vn_ready, vn_empty, g, o, bos, T, i_h, i_v, HV, H, V, MODE)
    gl.warp_specialize([(_chain, (p, beta, bank, slot, bank_stride, VN_LAYOUT, num_warps)), (_output, (p, scale, 0, 4)),
                        (_output, (p, scale, 1, 4)), (_loader, (p, scale, 0, 1))], [4, 4, 1], [OUT_REGS, OUT_REGS, 40])


def descriptors(q, k, v, a_inv, bv):
    n = q.shape[0] * q.shape[1]
    out = []
    for x, cols in ((q, q.shape[3]), (k, k.shape[3]), (v, bv), (a_inv, CHUNK)):
        width = x.shape[2] * x.shape[3]
        layout = gl.NVMMASharedLayout.get_default_for([CHUNK, cols], gl.bfloat16)
        out.append(TensorDescriptor(x, [n, width], [width, 1], [CHUNK, cols], layout))
    return out


def layouts(kd, bv):
    get = gl.NVMMASharedLayout.get_default_for
    return {"H_LAYOUT": get([kd, bv], gl.bfloat16), "VN_LAYOUT": get([CHUNK, bv], gl.bfloat16)}


def chunks_ws(q, k, v, g, beta, a_inv, bank, index, cu_seqlens, block_v=64, stages=2, out_regs=152, maxnreg=128,
              mode=0):
    """`chunks_wy`'s packed mode: the output; each document's final state into bank[index[d]]."""
    h, kd, hv, vd = q.shape[2], q.shape[3], v.shape[2], v.shape[3]
    o = torch.empty_like(v)
    docs = cu_seqlens.shape[0] - 1
    chunks_ws_kernel[(vd // block_v, docs * hv)](
        *descriptors(q, k, v, a_inv, block_v), g, beta, o, cu_seqlens, bank, index, bank.stride(0), kd ** -0.5,
        H=h, HV=hv, V=vd, STAGES=stages, OUT_REGS=out_regs, **layouts(kd, block_v), MODE=mode, num_warps=4,
        maxnreg=maxnreg)
    return o


def compile_only() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    n, h, hv, kd, vd = 4096, 16, 32, 128, 128
    q, k = (torch.empty(1, n, h, kd, dtype=torch.bfloat16) for _ in range(2))
    v = torch.empty(1, n, hv, vd, dtype=torch.bfloat16)
    a_inv = torch.empty(1, n, hv, CHUNK, dtype=torch.bfloat16)
    fn = chunks_ws_kernel
    descs = descriptors(q, k, v, a_inv, 64)
    sig = {name: mangle_type(d) for name, d in zip(("q_desc", "k_desc", "v_desc", "a_desc"), descs)}
    sig.update(g="*fp32", beta="*bf16", o="*bf16", cu_seqlens="*i64", bank="*fp32", index="*i64", bank_stride="i32",
               scale="constexpr")
    consts = dict(scale=kd ** -0.5, H=h, HV=hv, V=vd, STAGES=2, OUT_REGS=152, **layouts(kd, 64),
                  MODE=int(os.environ.get("MODE", 0)), num_warps=4)
    sig.update({key: "constexpr" for key in consts})
    src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(key),): val for key, val in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 1, "maxnreg": 128})
    sys.path.insert(0, str(Path(__file__).parent))
    from exp_gluon_gemm import ptxas_report
    print(f"ok: shared {compiled.metadata.shared} B, {ptxas_report(compiled)}")


def bench(tokens: int, json_path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_kernels import branch_case, timed

    from kevscore.kernels import fla_ops
    from kevscore.kernels.branch_wy import chunks_wy
    from kevscore.model.config import SHAPES

    cfg = SHAPES["kev-4b"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    lens = [1700] * (tokens // 1700) + ([tokens % 1700] if tokens % 1700 else [])
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0)
    chunks = torch.tensor([(d, c) for d, n in enumerate(lens) for c in range(-(-n // 64))], device="cuda")
    q, k, v, gate, beta, _, _ = branch_case(cfg, 1, tokens, gen)
    gc = fla_ops.decay_cumsum(*gate, 64, fla_ops.RCP_LN2, cu, chunks)
    a_inv = fla_ops.solve_chunks(k, gc, beta, None, cu, chunks)
    hv = v.shape[2]
    slots = torch.arange(len(lens), device="cuda")
    bank_ref = torch.zeros(len(lens), hv, q.shape[3], v.shape[3], device="cuda")
    bank_ws = torch.zeros_like(bank_ref)
    ref = chunks_wy(q, k, v, gc, beta, a_inv, bank_ref, slots, cu_seqlens=cu)
    results = {"tokens": tokens, "documents": len(lens)}
    for name, launch in (("ws bv64 2 outputs", {}), ("ws 2 outputs regs 144", dict(out_regs=144)),
                         ("chain alone", dict(mode=1)), ("outputs alone", dict(mode=2))):
        try:
            out = chunks_ws(q, k, v, gc, beta, a_inv, bank_ws, slots, cu, **launch)
            torch.cuda.synchronize()
            diff = (out.float() - ref.float()).abs().max().item()
            sdiff = (bank_ws - bank_ref).abs().max().item()
            us = timed(lambda: chunks_ws(q, k, v, gc, beta, a_inv, bank_ws, slots, cu, **launch))
            results[name] = {"us": None if us is None else us * 1e3, "max_out_diff": diff, "max_state_diff": sdiff}
        except Exception as exc:  # noqa: BLE001 - one launch's failure is a result
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:800]}"}
    results["chunks_wy default"] = {"us": timed(lambda: chunks_wy(q, k, v, gc, beta, a_inv, bank_ref, slots,
                                                                  cu_seqlens=cu)) * 1e3}
    ref_scale = ref.float().abs().max().item()
    print(f"{tokens} tokens, {len(lens)} documents; output magnitude {ref_scale:.3g}")
    for name, r in results.items():
        if isinstance(r, dict):
            print(f"  {name:22} {r}")
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--json")
    args = ap.parse_args()
    compile_only() if args.compile_only else bench(args.tokens, args.json)
