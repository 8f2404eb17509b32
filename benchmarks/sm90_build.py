"""Compile our Triton kernels for the H200 (sm_90a) on any machine, GPU or not, and report each variant's
registers, spills and shared memory from ptxas: a compile error or a register-bound launch configuration
shows up here before it costs device time. Prints a table and writes JSON.

    python benchmarks/sm90_build.py [--json out.json]

Shapes: the Kev-4B scoring call (96 rows x 64 tokens); pointers and row strides are marked 16-aligned,
as Triton specializes them at launch.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
# the fused WY kernel's ((first, second chunk's token tiles), BV, warps): the defaults at T <= 16, 32, 64, 65-80, 81-96 and
# 97-128, then bench_kernels.py's other launches at T = 64 and 85 (tiles of 64 rows only: 64 + 64)
WY_LAUNCHES = ((128, 4), (64, 8), (128, 8), (32, 8))
WY_DEFAULTS = (((16, 0), 128, 4), ((32, 0), 64, 4), ((64, 0), 128, 4), ((64, 16), 128, 4), ((64, 32), 128, 4),
               ((64, 64), 64, 4))
WY_VARIANTS = WY_DEFAULTS + tuple((tiles, bv, wp) for tiles in ((64, 0), (64, 64)) for bv, wp in WY_LAUNCHES) + (
    ((64, 32), 64, 4), ((32, 0), 128, 4))


def _kernel(fn):
    from triton.runtime.jit import JITFunction

    while not isinstance(fn, JITFunction):  # through autotuners and heuristics
        fn = fn.fn
    return fn


def build(fn, types: dict[str, str], consts: dict, num_warps: int, num_stages: int, aligned=()) -> dict:
    """Compile `fn` with argument types (Triton signature strings), constexprs and 16-aligned arguments;
    returns ptxas' registers, spill bytes, the kernel's shared memory and Triton's compile seconds (0 when its
    cache held the kernel: run with an empty TRITON_CACHE_DIR to time them all)."""
    fn = _kernel(fn)
    names = fn.arg_names
    sig = {n: types.get(n, "constexpr") for n in names}
    missing = [n for n in names if n not in types and n not in consts]
    assert not missing, f"{fn.__name__}: no type for {missing}"
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    t0 = time.perf_counter()
    compiled = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    seconds = time.perf_counter() - t0
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        out = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    spill = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", out))
    code = re.sub(r"^\s*\.file\b.*$", "", compiled.asm["ptx"].split("\t.section\t.debug")[0], flags=re.M)
    return {"registers": regs, "spill_bytes": spill, "shared": compiled.metadata.shared, "compile_s": round(seconds, 2),
            "ptx_sha256": hashlib.sha256(code.encode()).hexdigest()}  # the code: no source paths, no debug info


def variants() -> list[tuple[str, object, dict, dict, int, int, tuple]]:
    """(name, kernel, types, constexprs, warps, stages, aligned) for our kernels at their defaults and the
    variants under study."""
    from kevscore.kernels.branch_attn import _branch_attn_kernel
    from kevscore.kernels.branch_conv import L2_EPS, _branch_conv_kernel
    from kevscore.kernels.branch_wy import _chunks_wy_kernel

    out = []
    # the chunk-loop kernel of prefill and long branches: both modes at the default launch, 2 stages and BV 128
    for packed, bv, stages in ((True, 64, 2), (False, 64, 2), (True, 64, 1), (True, 128, 2)):
        out.append((f"chunks packed {packed} BV {bv} warps 4 stages {stages}", _chunks_wy_kernel, chunks_types(bv),
                    dict(H=16, HV=32, K=128, V=128, BV=bv, PACKED=packed, STAGES=stages), 4, stages, CHUNKS_ALIGNED))
    for bm, bn, wp, st in ((128, 32, 8, 3), (128, 64, 8, 2), (64, 32, 4, 3)):
        out.append((f"attention bm {bm} bn {bn} warps {wp} stages {st}", _branch_attn_kernel, attention_types(bm, bn),
                    dict(NKV=4, G=4, D=256, BM=bm, BN=bn, HAS_GATE=True), wp, st, ATTENTION_ALIGNED))
    conv_t = {n: "*bf16" for n in ("x", "w", "conv", "q", "k", "v", "b", "beta")} | {"slots": "*i64", "T": "i32",
                                                                                   "pos": "*i64"}
    conv_t |= {s: "i32" for s in ("sx_r", "sx_t", "s_conv", "s_slot", "sb_r", "sb_t")}
    for bt, wp, tiles, packed in ((4, 1, 1, False), (8, 1, 1, False), (16, 2, 1, False), (8, 1, 8, False),
                                  (4, 1, 1, True), (16, 4, 1, True)):
        out.append((f"conv{' packed' * packed} block_t {bt} warps {wp} tiles {tiles}", _branch_conv_kernel, conv_t,
                    dict(QK=2048, NQK=16, KD=128, VD=128, C=8192, W=4, BT=bt, BD=128, EPS=L2_EPS, EVEN=True,
                         TILES=tiles, NCB=64, HB=32, BH=32, PACKED=packed), wp, 1,
                    ("x", "w", "conv", "q", "k", "v", "b", "beta", "pos", "sx_r", "sx_t", "sb_r", "sb_t")))
    from kevscore.kernels.branch_wy import _branch_wy_kernel

    wy_t = {n: "*bf16" for n in ("q", "k", "v", "beta", "a_inv", "o")} | {"g": "*fp32", "bank": "*fp32", "index": "*i64",
                                                                          "index_stride": "i32", "bank_stride": "i64",
                                                                          "T": "i32", "scale": "fp32"}
    wy_aligned = ("q", "k", "v", "g", "beta", "a_inv", "bank", "index", "o")
    for (bt1, bt2), bv, wp in WY_VARIANTS:
        out.append((f"wy T tiles {bt1}+{bt2} bv {bv} warps {wp}", _branch_wy_kernel, wy_t,
                    dict(H=16, HV=32, K=128, V=128, BV=bv, BT1=bt1, BT2=bt2), wp, 1, wy_aligned))
    out.append(("wy fp32 demo", _branch_wy_kernel, wy_t | {n: "*fp32" for n in ("q", "k", "v", "beta", "a_inv", "o")},
                dict(H=2, HV=4, K=64, V=64, BV=64, BT1=64, BT2=64), 4, 1, wy_aligned))
    from kevscore.kernels.kkt_solve import _kkt_solve_kernel

    kkt_t = {"k": "*bf16", "g": "*fp32", "beta": "*bf16", "A": "*bf16", "cu_seqlens": "*i64", "chunk_indices": "*i64",
             "T": "i32"}
    for packed in (False, True):
        out.append((f"kkt solve packed {packed} warps 1", _kkt_solve_kernel, kkt_t,
                    dict(H=16, HV=32, G=2, K=128, IS_VARLEN=packed, PRECISION="tf32"), 1, 1, ("k", "g", "beta", "A")))
    from kevscore.kernels.elementwise import _rms_norm_kernel

    norm_t = {"x": "*bf16", "y": "*bf16", "w": "*fp32", "n_rows": "i32", "eps": "fp32"}
    out.append(("rms norm", _rms_norm_kernel, norm_t, dict(D=2560, BD=4096, BR=4), 8, 3, ("x", "w", "y")))
    from kevscore.kernels.swiglu_gemm import HALF, _swiglu_gemm_kernel

    gemm_t = {"x_desc": "tensordesc<bf16[128, 64]>", "w_desc": f"tensordesc<bf16[{2 * HALF}, 64]>", "M": "i32",
              "N": "i32", "K": "i32", "PROGRAMS": "i32"}
    for swiglu in (True, False):
        out.append((f"swiglu gemm{' plain' * (not swiglu)} 128 x {2 * HALF} x 64 warps 8 stages 3", _swiglu_gemm_kernel,
                    gemm_t | {"o_desc": f"tensordesc<bf16[128, {HALF if swiglu else 2 * HALF}]>"},
                    dict(BM=128, BN=2 * HALF, BK=64, GROUP_M=8, SWIGLU=swiglu), 8, 3, ()))
    return out


CHUNKS_ALIGNED = ("g", "beta", "bank", "index", "o")


def chunks_types(bv: int, dtype: str = "bf16") -> dict[str, str]:
    """The chunk loop's argument types at the Kev-4B shape: q, k, v and a_inv by TMA descriptor."""
    tiles = {"q": 128, "k": 128, "v": bv, "a_inv": 64}
    return {n: f"tensordesc<{dtype}[64, {cols}]>" for n, cols in tiles.items()} | {
        "beta": f"*{dtype}", "o": f"*{dtype}", "g": "*fp32", "bank": "*fp32", "index": "*i64", "cu_seqlens": "*i64",
        "index_stride": "i32", "bank_stride": "i64", "T": "i32", "scale": "fp32"}


ATTENTION_STRIDES = ("sk_r", "sk_t", "sv_r", "sv_t", "so_r", "so_t", "sg_r", "sg_t", "sg_h", "s_start", "s_len")
ATTENTION_ALIGNED = ("k", "v", "o", "gate") + ATTENTION_STRIDES[:-2]


def attention_types(bm: int, bn: int, dtype: str = "bf16") -> dict[str, str]:
    """Branch attention's argument types at the Kev-4B shape: the query tile's and the pool's TMA descriptors."""
    types = {n: f"*{dtype}" for n in ("k", "v", "o", "gate")} | {s: "i32" for s in ATTENTION_STRIDES}
    return types | {"q": f"tensordesc<{dtype}[1, {bm // 4}, 4, 256]>", "pool_k": f"tensordesc<{dtype}[{bn}, 256]>",
                    "pool_v": f"tensordesc<{dtype}[{bn}, 256]>", "kv_start": "*i64", "kv_len": "*i64", "T": "i32",
                    "qk_scale": "fp32"}


def fp32_variants() -> list[tuple]:
    """What an fp32 model (--dtype fp32) launches at the Kev-4B shape, compiled with its dots in 3xTF32 (main):
    our branch attention at its fp32 tiles, the chunk loop at 1 stage and our solve, FLA's kernels as `fla_variants`."""
    from kevscore.kernels.branch_attn import _branch_attn_kernel
    from kevscore.kernels.fla_ops import ATTN_FP32 as a32
    attn, chunks, kkt = (next(v for v in variants() if v[0].startswith(name))
                         for name in ("attention bm", "chunks packed", "kkt solve packed False"))
    f32 = lambda types: {n: "*fp32" if t == "*bf16" else t for n, t in types.items()}  # noqa: E731
    return [("fp32 attention", _branch_attn_kernel, attention_types(a32["block_m"], a32["block_n"], "fp32"),
             attn[3] | {"BM": a32["block_m"], "BN": a32["block_n"]}, a32["num_warps"], a32["num_stages"], attn[6]),
            ("fp32 chunks packed, 1 stage", chunks[1], chunks_types(64, "fp32"), chunks[3] | {"STAGES": 1}, 4, 1,
             chunks[6]),
            ("fp32 kkt solve", kkt[1], f32(kkt[2]), kkt[3] | {"PRECISION": "tf32x3"}, 1, 1, kkt[6]),
            *((f"fp32 fla {name}", *rest) for name, *rest in fla_variants("*fp32"))]


def fla_variants(act: str) -> list[tuple]:
    """FLA's four gated-delta-rule kernels of a scoring call at the Kev-4B shape, with activations of type `act`
    at the launch configurations the oracles pin on the H200 (tests/fla_oracles.PINS); in fp32, the copy of its
    (I + A)^-1 kernel with 3xTF32 merges that the cuda tests' oracle runs (tests/fla_oracles.kkt_solve_fp32)."""
    import importlib
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from fla_oracles import PINS, kkt_solve_fp32

    shape, v = dict(H=16, HV=32, K=128, BT=64), dict(V=128)
    per_kernel = {  # kernel -> (argument types, constexprs besides the pin's, 16-aligned arguments)
        "chunk_gated_delta_rule_fwd_kkt_solve_kernel": (
            {"k": act, "g": "*fp32", "beta": act, "A": act, "T": "i32"},
            dict(cu_seqlens=None, chunk_indices=None, **shape, BC=16, USE_G=True, IS_VARLEN=False)),
        "recompute_w_u_fwd_kernel": (
            {**{n: act for n in ("k", "v", "beta", "w", "u", "A")}, "g": "*fp32", "T": "i32"},
            dict(cu_seqlens=None, chunk_indices=None, **shape, **v, BK=64, BV=64, USE_G=True, IS_VARLEN=False)),
        "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": (
            {**{n: act for n in ("k", "v", "w", "v_new", "h")}, "g": "*fp32", "h0": "*fp32", "T": "i32"},
            dict(gk=None, ht=None, cu_seqlens=None, chunk_offsets=None, **shape, **v, USE_G=True, USE_GK=False,
                 USE_INITIAL_STATE=True, STORE_FINAL_STATE=False, SAVE_NEW_VALUE=True, STATE_V_FIRST=False,
                 IS_VARLEN=False)),
        "chunk_fwd_kernel_o": (
            {**{n: act for n in ("q", "k", "v", "h", "o")}, "g": "*fp32", "scale": "fp32", "T": "i32"},
            dict(g_gamma=None, cu_seqlens=None, chunk_indices=None, **shape, **v, USE_G=True, USE_G_GAMMA=False,
                 STATE_V_FIRST=False, IS_VARLEN=False)),
    }
    out = []
    for (module, name), pin in PINS["H200"].items():
        types, consts = per_kernel[name]
        launch = {k: pin[k] for k in ("num_warps", "num_stages")}
        consts = consts | {k: x for k, x in pin.items() if k not in launch}
        aligned = tuple(n for n, t in types.items() if t.startswith("*"))
        short = name.removeprefix("chunk_gated_delta_rule_fwd_").removesuffix("_kernel")
        kernel = getattr(importlib.import_module(module), name)
        if act == "*fp32" and short == "kkt_solve":
            kernel = kkt_solve_fp32()
        out.append((short, kernel, types, consts, launch["num_warps"], launch["num_stages"], aligned))
    return out


@contextlib.contextmanager
def f32_dots(precision: str | None):
    """Triton's precision of the dots of fp32 operands that name none, while compiling (None: as it is)."""
    before = os.environ.get("TRITON_F32_DEFAULT")
    if precision:
        os.environ["TRITON_F32_DEFAULT"] = precision
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_F32_DEFAULT", None)
        else:
            os.environ["TRITON_F32_DEFAULT"] = before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", help="variants whose name starts with this (several: comma-separated)")
    args = ap.parse_args()
    rows = []
    fla = [(f"fla {name}", *rest) for name, *rest in fla_variants("*bf16")]
    for name, fn, types, consts, wp, st, aligned in variants() + fla + fp32_variants():
        if args.only and not name.startswith(tuple(args.only.split(","))):
            continue
        with f32_dots("tf32x3" if name.startswith("fp32 ") else None):  # as cuda_runner.process_settings sets
            res = build(fn, types, consts, wp, st, aligned)
        rows.append({"variant": name} | res)
        print(f"{name:<44}{res['registers']:>5} regs {res['spill_bytes']:>7} B spilled {res['shared']:>8} B shared"
              f"{res['compile_s']:>7.2f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
