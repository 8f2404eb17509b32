"""Launch configurations of our Triton kernels at the Kev-4B scoring shape (96 rows x 64 tokens), each timed
alone with CUDA events (triton.testing.do_bench median), against the kernel it replaces and a copy of the same
bytes (the memory floor). Prints a table and writes JSON; the defaults in kevscore/kernels/ come from here.

    python benchmarks/bench_kernels.py --json benchmarks/results/kernels-kev-4b-h200.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from kevscore.measure import environment

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # fla_oracles: FLA's own ops

DEV = "cuda"
KERNELS = ["swiglu", "conv", "prefill conv", "qk norm+rope", "attention", "decay", "fused wy", "prefill wy",
           "kkt solve", "gemm"]
# the fused WY kernel's launches (kernels/branch_wy.py's keywords), its defaults first (BV 128 or 64 by tiles)
WY_LAUNCHES = ({}, dict(block_v=64), dict(block_v=64, tiles=(16, 64)), dict(block_v=128, tiles=(16, 64)),
               dict(block_v=64, num_warps=8), dict(block_v=128, num_warps=8), dict(block_v=32, num_warps=8),
               dict(maxnreg=168))  # at T <= 64 (BV 128): 168 registers, 24 B spilled, 3 programs an SM (NOTES 89)


def timed(fn) -> float | None:
    try:
        fn()
        torch.cuda.synchronize()
        return do_bench(fn, warmup=10, rep=50, return_mode="median")
    except (triton.runtime.errors.OutOfResources, RuntimeError) as err:  # a config that does not fit
        print(f"    skipped: {str(err)[:80]}")
        return None


def copy_ms(traffic: int) -> float:
    """The memory floor for a kernel that reads and writes `traffic` bytes in all: a copy of half of them."""
    src = torch.empty(traffic // 4, dtype=torch.bfloat16, device=DEV)
    dst = torch.empty_like(src)
    return do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--t", type=int, default=64)
    ap.add_argument("--doc-len", type=int, default=1024)
    ap.add_argument("--prefill-tokens", type=int, default=65536, help="tokens of the prefill conv's packed documents")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", nargs="+", choices=KERNELS, default=KERNELS, help="kernels to measure (default: all)")
    ap.add_argument("--defaults", action="store_true",
                    help="only the first variant of each sweep, our kernels' defaults (for Nsight Compute)")
    args = ap.parse_args()
    sweep = (lambda variants: list(variants)[:1]) if args.defaults else list

    import fla_oracles

    from kevscore.kernels import fla_ops
    from kevscore.kernels.branch_attn import branch_attention
    from kevscore.kernels.branch_conv import branch_conv
    from kevscore.kernels.elementwise import qk_norm_rope, swiglu_rows
    from kevscore.model.config import FULL, LINEAR, SHAPES
    from kevscore.model.layers.common import Rotary

    cfg = SHAPES["kev-4b"]
    r, t = args.rows, args.t
    n = r * t
    gen = torch.Generator(DEV).manual_seed(0)
    rand = lambda *s: torch.randn(*s, device=DEV, generator=gen).to(torch.bfloat16)  # noqa: E731
    results: list[dict] = []
    env = environment(torch.device(DEV))

    def save(**extra) -> None:  # after every measurement, so a run cut short keeps what it measured
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"environment": env, "rows": r, "t": t, "results": results} | extra,
                                            indent=1))

    def record(kernel: str, variant: str, ms: float | None, per_call: int, floor: float | None = None):
        results.append(dict(kernel=kernel, variant=variant, ms=ms, per_call=per_call, floor_ms=floor))
        save()
        total = f"{ms * per_call:8.2f}" if ms is not None else "     n/a"
        print(f"{kernel:<14}{variant:<34}{(ms or 0) * 1000:>9.1f} us{total} ms/call"
              + (f"   floor {floor * 1000:.1f} us" if floor else ""))

    layers, attn_layers = len(cfg.layer_types), cfg.layer_types.count(FULL)
    delta_layers = cfg.layer_types.count(LINEAR)
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    c = 2 * hk * dk + hv * dv
    proj = rand(r, t, c + hv * dv + 2 * hv)  # the DeltaNet projection output: q|k|v, z, b, a

    if "swiglu" in args.only:
        # SwiGLU over the gate|up projection output
        inner = cfg.intermediate_size
        gate_up = rand(r, t, 2 * inner)
        floor = copy_ms(n * 3 * inner * 2)  # read 2I, write I
        record("swiglu", "fla swiglu_fwd", timed(lambda: fla_oracles.swiglu(gate_up)), layers, floor)
        for br, bc, w in itertools.product((1, 2, 4, 8), (1024, 2048), (4, 8)):
            record("swiglu", f"rows {br} cols {bc} warps {w}",
                   timed(lambda: swiglu_rows(gate_up, br, bc, w)), layers, floor)

    if "conv" in args.only:
        # the fused branch conv (+ SiLU, split, l2norm of q and k)
        x = proj[..., :c]
        w = rand(c, cfg.linear_conv_kernel_dim)
        bank_conv = rand(16, c, cfg.linear_conv_kernel_dim - 1)
        slots = torch.arange(r, device=DEV) % 16
        floor = copy_ms(n * c * 2 * 2)
        record("conv", "fla causal_conv1d (+gather)",
               timed(lambda: fla_oracles.conv_branch(x, w, bank_conv.index_select(0, slots))), delta_layers, floor)
        launches = ((4, 1, 1), (8, 1, 1), (8, 2, 1), (16, 2, 1), (8, 1, 2), (8, 1, 4), (8, 1, 8), (16, 2, 4))
        b = proj[..., c + cfg.value_dim: c + cfg.value_dim + hv]  # the layer's b columns
        for bt, wp, tiles in sweep(launches):  # the default first
            record("conv", f"ours block_t {bt} warps {wp} tiles {tiles}", timed(lambda: branch_conv(
                x, w, bank_conv, slots, hk, dk, hv, dv, b=b, block_t=bt, num_warps=wp, tiles=tiles)), delta_layers,
                floor)
        record("conv", "ours default without beta", timed(lambda: branch_conv(
            x, w, bank_conv, slots, hk, dk, hv, dv)), delta_layers, floor)
        record("conv", "ours at the launch before NOTES 10 (32, 4 warps)", timed(lambda: branch_conv(
            x, w, bank_conv, slots, hk, dk, hv, dv, block_t=32, num_warps=4)), delta_layers, floor)

    if "prefill conv" in args.only:
        # the packed conv of prefill: --prefill-tokens tokens of 1,700-token documents, against FLA's varlen
        # conv + split copies (what prefill ran before) and the memory floor
        from kevscore.kernels.branch_conv import packed_conv

        m = args.prefill_tokens
        big = rand(1, m, c + hv * dv + 2 * hv)
        x, b = big[..., :c], big[..., c + cfg.value_dim: c + cfg.value_dim + hv]
        w = rand(c, cfg.linear_conv_kernel_dim)
        lens = [1700] * (m // 1700) + ([m % 1700] if m % 1700 else [])
        cu = torch.tensor([0, *lens], device=DEV).cumsum(0)
        pos = torch.cat([torch.arange(n_, device=DEV) for n_ in lens])
        floor = copy_ms(m * c * 2 * 2)
        record("prefill conv", "fla causal_conv1d + copies", timed(lambda: [
            t_.contiguous() for t_ in fla_oracles.conv_prefill(x, w, cu).split([hk * dk, hk * dk, hv * dv], -1)]),
            delta_layers, floor)
        for bt, wp, tiles in sweep(((8, 2, 1), (4, 1, 1), (8, 1, 1), (16, 4, 1), (32, 4, 1), (8, 1, 4))):
            record("prefill conv", f"ours block_t {bt} warps {wp} tiles {tiles}", timed(lambda: packed_conv(
                x, w, pos, hk, dk, hv, dv, b=b, block_t=bt, num_warps=wp, tiles=tiles)), delta_layers, floor)

    if "qk norm+rope" in args.only:
        # q/k RMSNorm + rotary
        nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv = rand(r, t, (2 * nh + 2 * nkv) * d)
        q = qkv[..., : 2 * nh * d].reshape(r, t, nh, 2 * d)[..., :d]
        k = qkv[..., 2 * nh * d: (2 * nh + nkv) * d].reshape(r, t, nkv, d)
        scale = torch.ones(d, device=DEV)
        cos, sin = Rotary(cfg.rotary_dim, cfg.rope_theta).to(DEV).cos_sin(torch.arange(n, device=DEV).view(r, t))
        floor = copy_ms(n * (nh + nkv) * d * 2 * 2)
        record("qk norm+rope", "torch rotary + fla rms_norm", timed(lambda: [
            _torch_rotary(fla_ops.rms_norm(x_, s_, 1e-6), cos, sin) for x_, s_ in ((q, scale), (k, scale))]),
            attn_layers, floor)
        for bt, wp in itertools.product((8, 16, 32), (4, 8)):
            record("qk norm+rope", f"ours block_t {bt} warps {wp}", timed(lambda: (
                qk_norm_rope(q, scale, cos, sin, 1e-6, bt, wp), qk_norm_rope(k, scale, cos, sin, 1e-6, bt, wp))),
                attn_layers, floor)

    if "attention" in args.only:
        # branch attention over 16 documents in the pool, with the output gate
        nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qa = rand(r, t, nh, d)
        ka, va = rand(r, t, nkv, d), rand(r, t, nkv, d)
        gate = rand(r, t, nh, 2 * d)[..., d:]
        pool = rand(2, 16 * args.doc_len, nkv, d)
        starts = (torch.arange(r, device=DEV) // 6) * args.doc_len
        lens = torch.full((r,), args.doc_len, device=DEV)
        flops = 4 * r * t * nh * (args.doc_len + t / 2) * d
        configs = [(128, 32, 8, 3), (64, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 4), (64, 64, 4, 2)]
        for bm, bn, wp, st in sweep(configs):  # the default first
            ms = timed(lambda: branch_attention(qa, ka, va, pool[0], pool[1], starts, lens, gate=gate, block_m=bm,
                                                block_n=bn, num_warps=wp, num_stages=st))
            record("attention", f"bm {bm} bn {bn} warps {wp} stages {st}", ms, attn_layers, flops / 760e12 * 1000)

    if "decay" in args.only:
        # the DeltaNet decay: our gate + cumsum, FLA's, and torch's chain + FLA's cumsum
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2

        from kevscore.kernels import gdr_ref

        a = proj[..., -hv:]
        g_args = (a, torch.randn(hv, device=DEV), torch.randn(hv, device=DEV))
        record("decay", "torch decay + fla cumsum", timed(lambda: chunk_local_cumsum(
            gdr_ref.gate_decay(*g_args), chunk_size=64, scale=RCP_LN2)), delta_layers)
        from fla.ops.gated_delta_rule.gate import gdn_gate_chunk_cumsum

        record("decay", "fla gdn_gate_chunk_cumsum (on a copy)", timed(lambda: gdn_gate_chunk_cumsum(
            a.contiguous(), g_args[1], chunk_size=64, scale=RCP_LN2, dt_bias=g_args[2])), delta_layers)
        record("decay", "ours, in place (kernels/gate.py)", timed(lambda: fla_ops.gate_cumsum(g_args)), delta_layers)

    if "fused wy" in args.only:
        bench_fused_wy(record, sweep, cfg, r, (t, 85), gen)

    if "prefill wy" in args.only:
        bench_prefill_wy(record, sweep, cfg, args.prefill_tokens, gen)

    if "kkt solve" in args.only:
        bench_kkt_solve(record, sweep, cfg, (r, 88), args.prefill_tokens, gen)

    if "gemm" in args.only:
        bench_gemms(record, cfg, args.prefill_tokens, gen)

    best = {}
    for res in results:
        if res["ms"] is not None and (res["kernel"] not in best or res["ms"] < best[res["kernel"]]["ms"]):
            best[res["kernel"]] = res
    print("\nbest per kernel:")
    for kern, res in best.items():
        print(f"  {kern:<14}{res['variant']:<34}{res['ms'] * 1000:9.1f} us  {res['ms'] * res['per_call']:6.2f} ms/call")
    save(best=best)


def bench_gemms(record, cfg, m: int, gen: torch.Generator) -> None:
    """Prefill's weight GEMMs at m tokens, each distinct (N, K) once: torch's cuBLAS call as the model makes it,
    then the fastest of the algorithms cuBLASLt offers for it (torch's TunableOp, which times them all and keeps
    the default among them), against its FLOPs at the floor's rate (bench_score's `MatmulRate`, 8192^3). Whether
    cuBLAS's own pick leaves time on the table at these shapes (NOTES 65: prefill's GEMMs at ~92% of that rate)."""
    import statistics
    import tempfile

    import torch.nn.functional as F
    from bench_score import MatmulRate  # benchmarks/, this script's directory

    from kevscore.kernels import fla_ops
    from kevscore.model.kev import KevModel

    with torch.device("meta"):
        model = KevModel(cfg, fla_ops)
    counts: dict[tuple[int, int], int] = {}
    for name, param in model.layers.named_parameters():
        if param.dim() == 2 and "conv" not in name:
            counts[tuple(param.shape)] = counts.get(tuple(param.shape), 0) + 1
    rate = statistics.median(MatmulRate().samples(20, warmup=3)) * 1e12
    print(f"gemm          8192^3 at {rate / 1e12:.0f} TFLOP/s; prefill's GEMMs at {m} tokens:")
    cases = []
    for (n, k), per_call in sorted(counts.items()):
        x, w = (torch.randn(*shape, device=DEV, generator=gen).to(torch.bfloat16) for shape in ((m, k), (n, k)))
        floor = 2 * m * n * k / rate * 1e3
        record("gemm", f"{n} x {k} cuBLAS", timed(lambda: F.linear(x, w)), per_call, floor)
        cases.append((n, k, per_call, x, w, floor))
    tunable = torch.cuda.tunable
    tunable.set_filename(str(Path(tempfile.mkdtemp()) / "tunableop.csv"))
    tunable.enable(True)
    tunable.tuning_enable(True)
    try:
        for n, k, per_call, x, w, floor in cases:
            F.linear(x, w)  # tunes this shape: every algorithm timed, the fastest kept
            record("gemm", f"{n} x {k} TunableOp", timed(lambda: F.linear(x, w)), per_call, floor)
    finally:
        tunable.tuning_enable(False)
        tunable.enable(False)


def branch_case(cfg, r: int, t: int, gen: torch.Generator) -> tuple:
    """A DeltaNet layer's branch inputs at r rows x t tokens, as the conv leaves them (bf16, q and k
    l2-normalized, `a` a strided slice of the projection output): q, k, v, gate, beta, bank, slots (16 entries,
    each the state of r / 16 rows)."""
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    rand = lambda *s: torch.randn(*s, device=DEV, generator=gen).to(torch.bfloat16)  # noqa: E731
    qs, ks = (torch.nn.functional.normalize(rand(r, t, hk, dk).float(), dim=-1).to(torch.bfloat16) for _ in range(2))
    vs = rand(r, t, hv, dv)
    beta = torch.rand(r, t, hv, device=DEV, generator=gen).to(torch.bfloat16)
    a = rand(r, t, 3 * hv)[..., hv: 2 * hv]
    gate = (a, torch.randn(hv, device=DEV), torch.randn(hv, device=DEV))
    bank = torch.randn(16, hv, dk, dv, device=DEV, generator=gen)
    return qs, ks, vs, gate, beta, bank, torch.arange(r, device=DEV) % 16


def bench_fused_wy(record, sweep, cfg, r: int, lengths: tuple[int, ...], gen: torch.Generator) -> None:
    """The solve, then one kernel for w/u, the state read by index and the output (kernels/branch_wy.py),
    against the stages they replace (gate cumsum, FLA's kkt + solve and w/u, FLA's scan on the gathered states,
    FLA's output), per DeltaNet layer: "fused wy T" the whole branch path (gate + solve + kernel) at each
    launch, "wy parts T" each kernel alone; the floor is the fused kernel's HBM traffic (each bank entry read
    once). FLA's kernels run at the oracles' pins for this GPU (tests/fla_oracles.py)."""
    import fla_oracles

    from kevscore.kernels import fla_ops
    from kevscore.kernels.branch_wy import branch_wy, chunks_wy
    from kevscore.model.config import LINEAR

    layers = cfg.layer_types.count(LINEAR)
    for tt in lengths:
        q, k, v, gate, beta, bank, slots = branch_case(cfg, r, tt, gen)
        hv = v.shape[2]
        traffic = 2 * (2 * q.numel() + 2 * v.numel() + r * tt * hv * (64 + 1)) + 4 * r * tt * hv
        floor = copy_ms(traffic + 4 * bank.numel())
        gc = fla_ops.gate_cumsum(gate)
        a_inv = fla_ops.solve_chunks(k, gc, beta)

        def fused_path(launch: dict) -> torch.Tensor:
            g = fla_ops.gate_cumsum(gate)
            return branch_wy(q, k, v, g, beta, fla_ops.solve_chunks(k, g, beta), bank, slots, **launch)

        record(f"fused wy {tt}", "stages (gate, WY, scan, output)", timed(lambda: fla_oracles.gdr_branch(
            q, k, v, gate, beta, bank, slots, "indexed")), layers)
        record(f"wy parts {tt}", "gate cumsum", timed(lambda: fla_ops.gate_cumsum(gate)), layers)
        record(f"wy parts {tt}", "kkt + solve", timed(lambda: fla_ops.solve_chunks(k, gc, beta)), layers)
        for launch in sweep(WY_LAUNCHES):
            name = str(launch)[1:-1].replace("'", "") or "default"
            record(f"wy parts {tt}", f"fused wy {name}", timed(lambda: branch_wy(
                q, k, v, gc, beta, a_inv, bank, slots, **launch)), layers, floor)
            record(f"fused wy {tt}", f"gate + solve + fused wy {name}", timed(lambda: fused_path(launch)), layers)
        for launch in sweep(ROWS_WY_LAUNCHES):  # the chunk loop (TMA tiles) in place of the two-chunk kernel
            name = str(launch)[1:-1].replace("'", "") or "default"
            record(f"wy parts {tt}", f"chunk loop {name}", timed(lambda: chunks_wy(
                q, k, v, gc, beta, a_inv, bank, slots, **launch)), layers, floor)


# the chunk loop's launches on branches (chunks_wy), as bench_fused_wy sets them beside the two-chunk kernel
ROWS_WY_LAUNCHES = ({}, dict(num_stages=1), dict(block_v=128, num_warps=8), dict(block_v=128), dict(num_warps=8))

# the chunk loop's launches: the default (2 stages) first; maxnreg 168: 3 programs an SM by registers (NOTES 89)
PREFILL_WY_LAUNCHES = ({}, dict(num_stages=1), dict(num_stages=3), dict(num_warps=8), dict(block_v=128, num_warps=8),
                      dict(block_v=128), dict(maxnreg=168, num_stages=1))


def bench_prefill_wy(record, sweep, cfg, m: int, gen: torch.Generator) -> None:
    """Prefill's gated delta rule after the solve on m tokens of 1,700-token documents, per DeltaNet layer:
    FLA's w/u, state scan and output kernels (at a job's pins) against the fused kernel at each launch
    (`branch_wy.chunks_wy`); the floor is the fused kernel's HBM traffic (q, k read once per value head)."""
    import types

    import fla_oracles

    from kevscore.kernels import fla_ops
    from kevscore.kernels.branch_wy import chunks_wy
    from kevscore.model.config import LINEAR

    layers = cfg.layer_types.count(LINEAR)
    lens = [1700] * (m // 1700) + ([m % 1700] if m % 1700 else [])
    cu = torch.tensor([0, *lens], device=DEV).cumsum(0)
    chunks = torch.tensor([(d, c) for d, n in enumerate(lens) for c in range(-(-n // 64))], device=DEV)
    q, k, v, gate, beta, _, _ = branch_case(cfg, 1, m, gen)
    gc = fla_ops.decay_cumsum(*gate, 64, fla_ops.RCP_LN2, cu, chunks)
    a_inv = fla_ops.solve_chunks(k, gc, beta, None, cu, chunks)
    hv = v.shape[2]
    floor = copy_ms(2 * (2 * hv // q.shape[2] * q.numel() + 2 * v.numel() + m * hv * 65) + 4 * m * hv
                    + 4 * len(lens) * hv * q.shape[3] * v.shape[3])
    slots = torch.arange(len(lens), device=DEV)
    bank = torch.empty(len(lens), hv, q.shape[3], v.shape[3], device=DEV)
    ctx = types.SimpleNamespace(cu_seqlens_long=cu, chunk_indices=chunks, slots=slots)
    record("prefill wy", "FLA stages (gate, solve, w/u, scan, output)", timed(lambda: fla_oracles.gdr_prefill(
        q, k, v, gate, beta, ctx, bank)), layers)
    record("prefill wy", "gate + solve", timed(lambda: fla_ops.solve_chunks(
        k, fla_ops.decay_cumsum(*gate, 64, fla_ops.RCP_LN2, cu, chunks), beta, None, cu, chunks)), layers)
    for launch in sweep(PREFILL_WY_LAUNCHES):
        name = str(launch)[1:-1].replace("'", "") or "default"
        record("prefill wy", f"fused {name}", timed(
            lambda: chunks_wy(q, k, v, gc, beta, a_inv, bank, slots, cu_seqlens=cu, **launch)), layers, floor)


# FLA's kkt + solve kernel: its own list of configurations (BK x warps), at 2 and 3 stages; the H200's pin first
KKT_CONFIGS = [(64, 1, 3)] + [(bk, w, st) for bk in (32, 64) for w in (1, 2, 4) for st in (2, 3)
                              if (bk, w, st) != (64, 1, 3)]


def bench_kkt_solve(record, sweep, cfg, branch: tuple[int, int], m: int, gen: torch.Generator) -> None:
    """The solve (`kernels/kkt_solve.py`) at 1, 2 and 4 warps against FLA's kkt + solve kernel at each
    configuration of its autotuner's list (tests/fla_oracles.solve_chunks; the oracles' pin is its
    autotuner's choice), per DeltaNet layer: on a scoring batch of branch = (rows, tokens) and on prefill's m
    tokens of 1,700-token documents, each row of ours named with its distance from FLA's output. The floor: k,
    beta and the gate read, (I + A)^-1 written."""
    import fla_oracles

    from kevscore.kernels import fla_ops
    from kevscore.kernels.kkt_solve import solve_chunks
    from kevscore.model.config import LINEAR

    tuner = fla_oracles.autotuner(fla_oracles.chunk_gated_delta_rule_fwd_kkt_solve_kernel)
    layers = cfg.layer_types.count(LINEAR)
    pinned = tuner.configs
    r, t = branch
    lens = [1700] * (m // 1700) + ([m % 1700] if m % 1700 else [])
    cu = torch.tensor([0, *lens], device=DEV).cumsum(0)
    chunks = torch.tensor([(d, c) for d, n in enumerate(lens) for c in range(-(-n // 64))], device=DEV)
    cases = {f"kkt solve {r}x{t}": (branch_case(cfg, r, t, gen), None, None),
             "kkt solve prefill": (branch_case(cfg, 1, m, gen), cu, chunks)}
    try:
        for name, ((_, k, _, gate, beta, _, _), cu_, chunks_) in cases.items():
            gc = fla_ops.decay_cumsum(*gate, 64, fla_ops.RCP_LN2, cu_, chunks_)
            hv = beta.shape[2]
            floor = copy_ms(k.numel() * 2 + beta.numel() * 6 + k.shape[0] * k.shape[1] * hv * 64 * 2)
            fla = fla_oracles.solve_chunks(k, gc, beta, None, cu_, chunks_)
            for warps in sweep((1, 2, 4)):
                rel = fla_oracles.lower_distance(solve_chunks(k, gc, beta, None, cu_, chunks_, num_warps=warps), fla, cu_)
                record(name, f"ours warps {warps} (rel {rel:.1e})", timed(
                    lambda: solve_chunks(k, gc, beta, None, cu_, chunks_, num_warps=warps)), layers, floor)
            for bk, warps, stages in sweep(KKT_CONFIGS):
                tuner.configs = [triton.Config({"BK": bk}, num_warps=warps, num_stages=stages)]
                tuner.cache.clear()
                record(name, f"FLA BK {bk} warps {warps} stages {stages}", timed(
                    lambda: fla_oracles.solve_chunks(k, gc, beta, None, cu_, chunks_)), layers, floor)
    finally:
        tuner.configs = pinned
        tuner.cache.clear()


def _torch_rotary(x, cos, sin):
    """The rotary the model ran before the fused kernel: bf16 cos/sin, torch slices and concatenations."""
    dim, half = cos.shape[-1], cos.shape[-1] // 2
    cos, sin = cos.to(x.dtype).unsqueeze(-2), sin.to(x.dtype).unsqueeze(-2)
    rot, rest = x[..., :dim], x[..., dim:]
    return torch.cat([rot * cos + torch.cat([-rot[..., half:], rot[..., :half]], -1) * sin, rest], -1)


if __name__ == "__main__":
    main()
