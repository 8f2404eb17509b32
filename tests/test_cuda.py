"""GPU tests (marked `cuda`): long branches read from the bank by index, graphs against eager, model parity."""

import math

import pytest
import torch
from conftest import both_paths, branch_inputs, gpu_engine, reference_scores, relative, synthetic, with_oracle

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"


LONG_TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 1e-2}  # as tests/test_cuda_branch_wy.py's, and why


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [129, 200])
@pytest.mark.parametrize("dims", [(16, 32, 128, 128), (2, 4, 64, 64)], ids=["kev4b", "demo"])
def test_long_branches_read_the_bank_by_index(dims, t, dtype):
    """Branches past the two-chunk kernel (`branch_wy.chunks_wy`): indexed equals gathered to the bit, the bank
    is never written, and both are close to FLA's stages on the gathered states (tests/fla_oracles.py)."""
    import fla_oracles

    from kevscore.kernels import fla_ops

    q, k, v, gate, beta, bank, slots = branch_inputs(8, t, *dims, dtype, seed=t)
    assert slots.stride(0) == 9  # a column of the upload buffer, not a contiguous index tensor
    snapshot = bank.clone()
    out = {p: fla_ops.gdr_branch(q, k, v, gate, beta, bank, slots, p) for p in ("indexed", "gathered")}
    assert torch.equal(out["indexed"], out["gathered"]) and torch.equal(bank, snapshot)
    stages = fla_oracles.gdr_branch(q, k, v, gate, beta, bank, slots, "indexed")
    assert relative(out["indexed"], stages) < LONG_TOLERANCE[dtype], relative(out["indexed"], stages)


def test_long_branches_follow_new_slots_between_graph_replays():
    from kevscore.kernels import fla_ops

    q, k, v, gate, beta, bank, slots = branch_inputs(8, 150, 16, 32, 128, 128, torch.bfloat16, seed=3)
    upload = torch.zeros(8, 5, dtype=torch.long, device=DEV)
    index = upload[:, 2]
    fla_ops.gdr_branch(q, k, v, gate, beta, bank, index, "indexed")  # compiles the kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fla_ops.gdr_branch(q, k, v, gate, beta, bank, index, "indexed")
    for new in ([0, 1, 2, 3, 4, 5, 6, 0], [6, 6, 6, 2, 2, 0, 5, 6], [3] * 8):
        upload[:, 2] = torch.tensor(new, device=DEV)
        graph.replay()
        ref = fla_ops.gdr_branch(q, k, v, gate, beta, bank, index.clone(), "gathered")
        assert torch.equal(out, ref), new


@pytest.mark.parametrize("dims", [(16, 32, 128, 128), (2, 4, 64, 64)], ids=["kev4b", "demo"])
def test_wy_repr_equals_fla(dims):
    """fla_oracles.wy_repr (FLA's intra-chunk stage, called kernel by kernel): w and u are FLA's to the bit, call
    after call with new inputs, at two shapes."""
    import fla_oracles
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    h, hv, dk, dv = dims
    for seed, (rows, t) in enumerate([(3, 64), (5, 129), (3, 64), (5, 129), (1, 17)]):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        k = torch.nn.functional.normalize(torch.randn(rows, t, h, dk, generator=gen, device=DEV), dim=-1).bfloat16()
        v = torch.randn(rows, t, hv, dv, generator=gen, device=DEV).bfloat16()
        g = -torch.nn.functional.softplus(torch.randn(rows, t, hv, generator=gen, device=DEV))
        gc = chunk_local_cumsum(g, chunk_size=64, scale=RCP_LN2)
        beta = torch.rand(rows, t, hv, generator=gen, device=DEV).bfloat16()
        w, u = fla_oracles.wy_repr(k, v, gc, beta)
        w_ref, u_ref, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=gc, beta=beta, chunk_size=64)
        assert torch.equal(w, w_ref) and torch.equal(u, u_ref), (rows, t)


CASES = {
    "shared": dict(doc_lens=[40, 90, 130], branch_lens=[5, 9, 17, 30, 40, 64], max_rows=64),
    "padded": dict(doc_lens=[64] * 13, branch_lens=[11], max_rows=16),  # 13 rows in a bucket of 16
    "large": dict(doc_lens=[20 + 7 * i for i in range(96)], branch_lens=[24], max_rows=96),
    "long-branch": dict(doc_lens=[100, 300], branch_lens=[256, 400, 512], max_rows=8),
    "long-state": dict(doc_lens=[2048, 1500], branch_lens=[3, 64], max_rows=8),
}


@pytest.mark.parametrize("case", list(CASES))
def test_graph_replay_equals_eager(tiny, case):
    spec = dict(CASES[case])
    max_rows = spec.pop("max_rows")
    enc = synthetic(**spec)
    results = {}
    for eager in (True, False):
        engine = gpu_engine(tiny, enc.prefixes, eager=eager, max_rows=max_rows, max_tokens=1 << 16)
        results[eager] = {p: engine.run(enc, p).probs for p in ("indexed", "gathered")}
        if not eager:  # the first batch of each bucket ran eagerly before its capture; a second run replays all
            assert engine.runner.graphs, "no graph was captured"
            captured = len(engine.runner.graphs)
            again = engine.run(enc, "indexed").probs
            assert len(engine.runner.graphs) == captured
            for a, b in zip(results[False]["indexed"], again):
                assert a == pytest.approx(b, abs=1e-4)
    for path in ("indexed", "gathered"):  # cuBLAS may pick other GEMM kernels under capture: last-bit rounding
        for a, b in zip(results[True][path], results[False][path]):
            assert a == pytest.approx(b, abs=1e-4)
    for eager in (True, False):  # within a mode, the two paths agree to the bit
        assert results[eager]["indexed"] == results[eager]["gathered"]


def test_a_batch_of_eager_size_runs_without_a_graph(tiny):
    """A batch planned at its exact shape (weight-matmul work a layer of `plan.EAGER_LAYER_FLOPS` or more: for the
    tiny model, tokens set lower) runs eagerly on the graph runner: no graph captured, its scores the eager
    runner's to the bit on both paths, and within last-bit rounding of the same rows replayed in their padded
    graph bucket."""
    from kevscore.engine import plan

    enc = synthetic(doc_lens=[40, 90, 130, 200], branch_lens=list(range(65, 106, 2)))  # 84 rows of 65-105 tokens
    engines = {eager: gpu_engine(tiny, enc.prefixes, eager=eager, max_rows=96, max_tokens=1 << 16)
               for eager in (True, False)}
    model = engines[False].runner.model
    layer_weights = sum(p.numel() for p in model.layers.parameters() if p.dim() == 2) / len(model.layers)
    assert engines[False].runner.exact_from == plan.eager_tokens(layer_weights) > 96 * 112  # the tiny model: graphs
    for engine in engines.values():
        engine.runner.exact_from = 64 * 128
    batch, = plan.plan_batches(list(range(len(enc))), [len(b) for b in enc.branches], [200] * len(enc), 96, 1 << 16,
                               exact_from=64 * 128)
    assert batch.exact and (batch.size, batch.length) == (84, 106)
    got = {eager: {p: e.run(enc, p).probs for p in ("indexed", "gathered")} for eager, e in engines.items()}
    assert not engines[False].runner.graphs
    assert got[False] == got[True] and got[False]["indexed"] == got[False]["gathered"]
    engines[False].runner.exact_from = math.inf  # the same rows in a graph of 96 x 112
    padded = engines[False].run(enc, "indexed").probs
    assert list(engines[False].runner.graphs) == [(96, 112, 1, "indexed")]
    for a, b in zip(got[False]["indexed"], padded):
        assert a == pytest.approx(b, abs=1e-4)


def test_a_capture_keeps_the_allocators_cache(tiny):
    """A bucket's capture neither empties the caching allocator (as `torch.cuda.graph` does on entry, after
    synchronizing) nor changes the scores: the memory a prefill group freed stays reserved for the next one."""
    enc = synthetic(doc_lens=[40, 90, 130], branch_lens=[5, 9, 17, 30, 40, 64])
    engine = gpu_engine(tiny, enc.prefixes, max_rows=64, max_tokens=1 << 16)
    eager = gpu_engine(tiny, enc.prefixes, eager=True, max_rows=64, max_tokens=1 << 16).run(enc, "indexed").probs
    torch.empty(256 << 20, dtype=torch.uint8, device=DEV)  # freed at once: 256 MB cached, not in use
    reserved = torch.cuda.memory_reserved()
    probs = engine.run(enc, "indexed").probs
    assert engine.runner.graphs and torch.cuda.memory_reserved() >= reserved
    for a, b in zip(eager, probs):
        assert a == pytest.approx(b, abs=1e-4)


def test_model_paths_bitwise_and_bank_unchanged(tiny):
    enc = synthetic([1, 63, 64, 65, 300], [1, 17, 64, 65, 130])
    out = both_paths(gpu_engine(tiny, enc.prefixes, max_rows=7), enc)
    assert out["indexed"].probs == out["gathered"].probs
    flips = sum(max(range(2), key=a.__getitem__) != max(range(2), key=b.__getitem__)
                for a, b in zip(out["indexed"].probs, out["gathered"].probs))
    assert flips == 0


def test_fused_bf16_close_to_fp32_reference(tiny):
    """The fused bf16 path is as close to the fp32 reference as transformers itself is in bf16."""
    from kevscore.reference import reference_model

    enc = synthetic([1, 63, 64, 65, 300], [1, 17, 64, 65, 130])
    fused = gpu_engine(tiny, enc.prefixes, max_rows=8).run(enc, "indexed")
    ref32, ref16 = reference_model(tiny), reference_model(tiny, device=DEV, dtype=torch.bfloat16)
    ours = theirs = 0.0
    for r in range(len(enc)):
        args = (enc.prefixes[enc.row_prefix[r]], enc.branches[r], enc.label_ids[r])
        p32, p16 = reference_scores(ref32, *args)[0], reference_scores(ref16, *args)[0]
        ours = max(ours, max(abs(a - b) for a, b in zip(p32, fused.probs[r])))
        theirs = max(theirs, max(abs(a - b) for a, b in zip(p32, p16)))
    print(f"max |p - p_fp32|: kevscore fused bf16 {ours:.4g}, transformers bf16 {theirs:.4g}")
    assert ours <= 2 * theirs + 0.01


def test_label_mass_close_to_fp32_reference(demo):
    """label_mass on the GPU (bf16 model, log-sum-exp over the vocabulary) against transformers in fp32, on
    labels where it is material (conftest.material_masses): relatively as close as transformers' bf16."""
    from conftest import material_masses

    from kevscore.reference import reference_model

    enc, reference = material_masses(demo)
    ours = gpu_engine(demo, enc.prefixes, max_rows=4).run(enc, "indexed").label_mass
    ref16 = reference_model(demo, device=DEV, dtype=torch.bfloat16)
    worst_ours = worst_theirs = 0.0
    for r, (_, mass) in enumerate(reference):
        theirs = reference_scores(ref16, enc.prefixes[enc.row_prefix[r]], enc.branches[r], enc.label_ids[r])[1]
        worst_ours = max(worst_ours, abs(ours[r] / mass - 1))
        worst_theirs = max(worst_theirs, abs(theirs / mass - 1))
    print(f"label mass, max relative error against fp32: kevscore {worst_ours:.4g}, transformers bf16 {worst_theirs:.4g}")
    assert worst_ours <= 2 * worst_theirs + 0.02


def test_prefill_states_close_to_cpu(tiny):
    """The GPU prefill (packed varlen, bf16) writes entries close to the CPU fp32 prefill's."""
    from conftest import cpu_engine

    from kevscore.engine.pipeline import Scores

    enc = synthetic([1, 5, 64, 65, 200], [4])
    gpu, cpu = gpu_engine(tiny, enc.prefixes), cpu_engine(tiny, docs=enc.prefixes)
    for engine in (gpu, cpu):
        engine.prefill_wave(enc, list(range(5)), Scores.empty(0).stats)
    a, b = gpu.runner.bank.state[:, :5].cpu(), cpu.runner.bank.state[:, :5]
    assert ((a - b).norm() / b.norm()).item() < 0.05
    a, b = gpu.runner.bank.conv[:, :5].float().cpu(), cpu.runner.bank.conv[:, :5]
    assert ((a - b).norm() / b.norm()).item() < 0.02
    n = cpu.runner.bank.used_tokens
    a, b = gpu.runner.bank.kv[:, :, :n].float().cpu(), cpu.runner.bank.kv[:, :, :n]
    assert ((a - b).norm() / b.norm()).item() < 0.02


def test_cli_runs_on_cuda(tmp_path):
    import shutil
    from pathlib import Path

    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from kevscore.cli import app

    src = Path(__file__).parent.parent / "examples" / "questions.parquet"
    shutil.copy(src, tmp_path / "q.parquet")
    res = {}
    for path in ("indexed", "gathered"):
        out = tmp_path / f"{path}.parquet"
        result = CliRunner().invoke(app, ["run", str(tmp_path / "q.parquet"), "--device", "cuda", "--path", path,
                                          "-o", str(out)])
        assert result.exit_code == 0, result.output
        res[path] = pq.read_table(out).column("probs").to_pylist()
    assert res["indexed"] == res["gathered"]
    assert all(abs(sum(p) - 1) < 1e-9 for p in res["indexed"])


# one W1-sized GEMM (96 branches x 64 tokens, Kev-4B's DeltaNet in-projection) profiled in a fresh process:
# printed, the memsets the GPU ran for it
GEMM_MEMSETS = """
import sys, torch
if sys.argv[1] == "runner":
    from kevscore.engine.cuda_runner import process_settings
    process_settings(torch.bfloat16)
x = torch.randn(6144, 2560, device="cuda", dtype=torch.bfloat16)
w = torch.randn(8192, 2560, device="cuda", dtype=torch.bfloat16)
x @ w.T
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    x @ w.T
    torch.cuda.synchronize()
print(sum("memset" in e.name.lower() for e in prof.events()))
"""


def test_gemms_run_without_cublas_memsets():
    """A process that builds a GPU runner runs cuBLAS without a workspace (`process_settings`): its GEMMs
    need no memset (a graph node each in a captured scoring call); a process that does not, for contrast."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    memsets = {mode: subprocess.run([sys.executable, "-c", GEMM_MEMSETS, mode], capture_output=True, text=True,
                                    env=env, check=True).stdout.split()[-1] for mode in ("default", "runner")}
    assert memsets["runner"] == "0", memsets


@pytest.mark.parametrize("dims", [(16, 4, 256), (4, 2, 64)], ids=["kev4b", "demo"])
@pytest.mark.parametrize("t", [1, 17, 64, 130])
def test_branch_attention_matches_gathered_sdpa(dims, t):
    from kevscore.kernels import torch_ops
    from kevscore.kernels.branch_attn import branch_attention
    from kevscore.model.layers.common import BranchContext

    nh, nkv, d = dims
    rows = 5
    gen = torch.Generator(device=DEV).manual_seed(t)
    q = torch.randn(rows, t, nh, d, generator=gen, device=DEV, dtype=torch.bfloat16)
    kv = torch.randn(rows, t, 2 * nkv, d, generator=gen, device=DEV, dtype=torch.bfloat16)
    k, v = kv[:, :, :nkv], kv[:, :, nkv:]  # strided views, as the projection split gives them
    pool = torch.randn(2, 3000, nkv, d, generator=gen, device=DEV, dtype=torch.bfloat16)
    for gap in (slice(1, 100), slice(700, 2000), slice(2999, None)):  # past each document: a tile's rows to mask
        pool[:, gap] = float("nan")
    upload = torch.randint(0, 3000, (rows, 7), device=DEV)  # start and length as strided columns, as the
    upload[:, 3] = torch.tensor([0, 100, 700, 2000, 100], device=DEV)  # runner passes them
    upload[:, 5] = torch.tensor([1, 600, 0, 999, 600], device=DEV)
    start, plen = upload[:, 3], upload[:, 5]
    steps = torch.arange(1024, device=DEV)
    mask = steps[None] < plen[:, None]
    ctx = BranchContext(positions=None, slots=None, kv_index=torch.where(mask, start[:, None] + steps, 0),
                        kv_mask=mask, kv_start=start, kv_len=plen, path="indexed")
    cpu = BranchContext(positions=None, slots=None, kv_index=ctx.kv_index.cpu(), kv_mask=mask.cpu(),
                        kv_start=None, kv_len=None, path="indexed")
    gate = torch.randn(rows, t, nh, 2 * d, generator=gen, device=DEV, dtype=torch.bfloat16)[..., d:]
    for g in (None, gate):  # the output gate is applied in the kernel's epilogue
        ref = torch_ops.attn_branch(q.float().cpu(), k.float().cpu(), v.float().cpu(),
                                    None if g is None else g.float().cpu(), pool.float().cpu(), cpu)
        out = branch_attention(q, k, v, pool[0], pool[1], start, plen, gate=g).float().cpu()
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, rel


@pytest.mark.parametrize("dims", [(16, 128, 32, 128), (2, 64, 4, 64)], ids=["kev4b", "demo"])
@pytest.mark.parametrize("t", [1, 17, 64, 130])
def test_fused_branch_conv_matches_fla_conv_and_l2norm(dims, t):
    """kernels/branch_conv.py (conv from the bank by slot, SiLU, split, l2 norm) against FLA's chain."""
    import fla_oracles
    from fla.modules.l2norm import l2norm_fwd

    from kevscore.kernels.branch_conv import branch_conv

    hk, dk, hv, dv = dims
    c = 2 * hk * dk + hv * dv
    rows = 5
    gen = torch.Generator(device=DEV).manual_seed(t)
    proj = torch.randn(rows, t, c + 96, generator=gen, device=DEV).to(torch.bfloat16)
    x = proj[..., :c]  # a strided slice of the projection output, as in the layer
    w = (torch.randn(c, 4, generator=gen, device=DEV) * 0.5).to(torch.bfloat16)
    bank = torch.randn(7, c, 3, generator=gen, device=DEV).to(torch.bfloat16)
    upload = torch.randint(0, 7, (rows, 9), device=DEV)
    slots = upload[:, 3]
    b = proj[..., c + 5: c + 5 + hv]  # the layer's b columns, also a strided slice
    q, k, v, beta = branch_conv(x, w, bank, slots, hk, dk, hv, dv, b=b)
    # the beta programs change nothing else
    *plain, _ = branch_conv(x, w, bank, slots, hk, dk, hv, dv)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), plain))
    # programs of two 8-token tiles over 2 warps (prefill's launch, side by side over heads): the same values up to
    # a rounding, since the l2 norm's sum runs in another order over another warp layout
    other = branch_conv(x, w, bank, slots, hk, dk, hv, dv, b=b, block_t=8, num_warps=2, tiles=2)
    assert all(torch.allclose(a.float(), c.float(), rtol=2 ** -7, atol=2 ** -7) for a, c in zip((q, k, v, beta), other))
    # beta: Triton's exp is an approximation where torch's is exact to the float, so one bf16 rounding apart at most
    ref_beta = torch.sigmoid(b)
    assert beta.is_contiguous() and torch.allclose(beta.float(), ref_beta.float(), rtol=2 ** -7, atol=0)
    print(f"beta: {(beta != ref_beta).sum().item()} of {beta.numel()} differ from torch's sigmoid by one rounding")
    y = fla_oracles.conv_branch(x, w, bank.index_select(0, slots))
    rq, rk, rv = y.split([hk * dk, hk * dk, hv * dv], -1)
    rq = l2norm_fwd(rq.reshape(rows, t, hk, dk).contiguous())[0]
    rk = l2norm_fwd(rk.reshape(rows, t, hk, dk).contiguous())[0]
    rv = rv.reshape(rows, t, hv, dv)
    for ours, ref in ((q, rq), (k, rk), (v, rv)):
        assert ours.is_contiguous()
        assert torch.allclose(ours.float(), ref.float(), rtol=2 ** -7, atol=2 ** -7)  # a bf16 rounding step at most


def test_fused_branch_conv_in_the_model_keeps_paths_bitwise(tiny):
    """Our branch conv in the bf16 model: its two state reads equal to the bit, and within 0.03 of FLA's conv
    in its place (two bf16 runs that differ by roundings; transformers' own bf16 is ~0.028 from fp32 here)."""
    enc = synthetic([1, 63, 64, 65, 300], [1, 17, 64, 65, 130])
    base, out = with_oracle(tiny, "conv", enc)
    assert out["indexed"] == out["gathered"]
    assert max(abs(a - b) for ra, rb in zip(base, out["indexed"]) for a, b in zip(ra, rb)) < 0.03


@pytest.mark.parametrize("shape", [(96, 64, 9216), (3, 17, 48), (1, 1, 1100)])
def test_swiglu_rows_bitwise_equals_fla(shape):
    """kernels/elementwise.py's row-tiled SwiGLU does FLA's swiglu_fwd arithmetic: equal to the bit."""
    import fla_oracles

    from kevscore.kernels.elementwise import swiglu_rows

    *lead, inner = shape
    gate_up = torch.randn(*lead, 2 * inner, device=DEV, generator=torch.Generator(DEV).manual_seed(inner)) * 4
    for dtype in (torch.bfloat16, torch.float32):
        x = gate_up.to(dtype)
        ours = swiglu_rows(x)
        assert ours.is_contiguous() and torch.equal(ours, fla_oracles.swiglu(x))


@pytest.mark.parametrize("shape", [(5440, 2560, 9216), (7, 2560, 9216), (300, 128, 256)], ids=["batch", "rows", "demo"])
def test_swiglu_gemm_close_to_cublas_and_swiglu(shape):
    """The gate|up GEMM with SwiGLU in its epilogue against cuBLAS's GEMM + `swiglu_rows` in bf16: gate and up
    rounded alike, so the two differ by the GEMMs' order of summation (a bf16 rounding of gate or up here and
    there); and a model's last-layer rows (several leading dims) come out in their shape."""
    import torch.nn.functional as F

    from kevscore.kernels.elementwise import swiglu_rows
    from kevscore.kernels.swiglu_gemm import interleave, swiglu_gemm

    m, k, inner = shape
    gen = torch.Generator(DEV).manual_seed(m)
    x = torch.randn(m, k, device=DEV, generator=gen).to(torch.bfloat16)
    gate, up = ((torch.randn(inner, k, device=DEV, generator=gen) / k ** 0.5).to(torch.bfloat16) for _ in range(2))
    ours = swiglu_gemm(x, interleave(gate, up))
    ref = swiglu_rows(F.linear(x, torch.cat([gate, up])))
    assert ours.shape == ref.shape and ours.dtype == torch.bfloat16
    assert torch.allclose(ours.float(), ref.float(), rtol=2 ** -6, atol=2 ** -8), (ours.float() - ref.float()).abs().max()
    rows = swiglu_gemm(x.view(1, m, k), interleave(gate, up))
    assert rows.shape == (1, m, inner) and torch.equal(rows[0], ours)


@pytest.mark.parametrize("dims", [(16, 4, 256, 64), (4, 2, 64, 16)], ids=["kev4b", "demo"])
def test_qk_norm_rotary_close_to_torch(dims):
    """The fused per-head RMSNorm + rotary of q (read from the q|gate projection in place) and k against the
    fp32 torch ops: within one bf16 rounding of the output."""
    from kevscore.kernels import fla_ops, torch_ops
    from kevscore.model.layers.common import Rotary

    nh, nkv, d, rot = dims
    rows, t = 5, 70
    gen = torch.Generator(DEV).manual_seed(d)
    proj = (torch.randn(rows, t, 2 * nh * d + 2 * nkv * d, device=DEV, generator=gen) * 3).to(torch.bfloat16)
    qg, k = proj[..., : 2 * nh * d], proj[..., 2 * nh * d: (2 * nh + nkv) * d]
    q = qg.reshape(rows, t, nh, 2 * d)[..., :d]
    k = k.reshape(rows, t, nkv, d)
    qs, ks = (1 + torch.randn(d, device=DEV, generator=gen) * 0.2 for _ in range(2))
    cos, sin = Rotary(rot, 1e7).to(DEV).cos_sin(torch.randint(0, 20000, (rows, t), device=DEV, generator=gen))
    ours = fla_ops.qk_norm_rotary(q, k, qs, ks, cos, sin, 1e-6)
    ref = torch_ops.qk_norm_rotary(q.float(), k.float(), qs, ks, cos, sin, 1e-6)
    for a, b in zip(ours, ref):
        assert a.dtype == torch.bfloat16 and a.is_contiguous()
        assert torch.allclose(a.float(), b, rtol=2 ** -8, atol=1e-5)


def test_our_gate_cumsum_equals_flas_kernel_bit_for_bit():
    """kernels/gate.py reads `a` in place; FLA's kernel reads a contiguous copy: same arithmetic, same bits, on
    branch rows and on packed documents."""
    from fla.ops.gated_delta_rule.gate import gdn_gate_chunk_cumsum
    from fla.ops.utils.constant import RCP_LN2

    from kevscore.kernels.gate import gate_cumsum

    gen = torch.Generator(DEV).manual_seed(0)
    proj = (torch.randn(6, 130, 40, device=DEV, generator=gen) * 4).to(torch.bfloat16)
    a, A_log, dt_bias = proj[..., 8:40], torch.randn(32, device=DEV, generator=gen), torch.randn(32, device=DEV)
    fla = gdn_gate_chunk_cumsum(a.contiguous(), A_log, chunk_size=64, scale=RCP_LN2, dt_bias=dt_bias)
    assert torch.equal(gate_cumsum(a, A_log, dt_bias, 64, RCP_LN2), fla)
    lens = [5, 64, 65, 300, 1]
    packed = (torch.randn(1, sum(lens), 40, device=DEV, generator=gen) * 4).to(torch.bfloat16)[..., 8:40]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
    chunks = torch.tensor([[d, c] for d, n in enumerate(lens) for c in range(-(-n // 64))], device=DEV)
    fla = gdn_gate_chunk_cumsum(packed.contiguous(), A_log, chunk_size=64, scale=RCP_LN2, dt_bias=dt_bias,
                                cu_seqlens=cu, chunk_indices=chunks)
    assert torch.equal(gate_cumsum(packed, A_log, dt_bias, 64, RCP_LN2, cu, chunks), fla)


def test_fla_gate_cumsum_close_to_torch_decay():
    """Our gate + chunk cumsum (FLA's approximate exp2/log2 in its softplus) against the fp32 torch decay."""
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    from kevscore.kernels import fla_ops, gdr_ref

    gen = torch.Generator(DEV).manual_seed(0)
    proj = (torch.randn(6, 130, 40, device=DEV, generator=gen) * 4).to(torch.bfloat16)
    a = proj[..., 8:40]  # a strided slice of the projection output, as in the layer
    gate = (a, torch.randn(32, device=DEV, generator=gen), torch.randn(32, device=DEV, generator=gen))
    ours = fla_ops.gate_cumsum(gate)
    ref = chunk_local_cumsum(gdr_ref.gate_decay(*gate), chunk_size=64, scale=RCP_LN2)
    assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-4)



@pytest.mark.parametrize("hv, dv", [(32, 128), (4, 64)], ids=["kev4b", "demo"])
def test_gated_norm_reads_the_gate_in_place_close_to_fla(hv, dv):
    """Our gated output norm (gate read in place from the projection output) against FLA's rms_norm_gated on a
    copy of it: within one bf16 rounding."""
    from fla.modules.fused_norm_gate import rms_norm_gated

    from kevscore.kernels import fla_ops

    gen = torch.Generator(DEV).manual_seed(dv)
    proj = (torch.randn(5, 70, 3 * hv * dv, device=DEV, generator=gen) * 2).to(torch.bfloat16)
    z = proj[..., hv * dv: 2 * hv * dv].reshape(5, 70, hv, dv)
    o = torch.randn(5, 70, hv, dv, device=DEV, generator=gen).to(torch.bfloat16)
    w = (1 + torch.randn(dv, device=DEV, generator=gen) * 0.1).to(torch.bfloat16)
    ours = fla_ops.gated_rms_norm(o, z, w, 1e-6)
    ref = rms_norm_gated(o, z.contiguous(), w, None, activation="swish", eps=1e-6)
    assert torch.allclose(ours.float(), ref.float(), rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("rows, d", [(6144, 2560), (37, 1024), (3, 128)])
def test_rms_norm_rows_close_to_fla(rows, d):
    """Our RMSNorm against FLA's kernel, within a rounding (both sum the squares in fp32, in different orders)."""
    import fla_oracles

    from kevscore.kernels import fla_ops

    gen = torch.Generator(device=DEV).manual_seed(rows)
    x = torch.randn(rows, d, generator=gen, device=DEV).to(torch.bfloat16)
    scale = 1 + 0.1 * torch.randn(d, generator=gen, device=DEV)
    torch.testing.assert_close(fla_ops.rms_norm(x, scale, 1e-6), fla_oracles.rms_norm(x, scale, 1e-6))


def test_proj_add_adds_the_projection_into_the_residual_stream():
    """`proj_add` on the GPU: the residual stream plus x W^T written into the stream's own memory, equal to the
    fp32 sum rounded once (cuBLAS's epilogue), against the torch ops' fp32 sum."""
    from kevscore.kernels import fla_ops, torch_ops

    gen = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(2, 37, 512, generator=gen, device=DEV).to(torch.bfloat16)
    weight = (torch.randn(256, 512, generator=gen, device=DEV) / 16).to(torch.bfloat16)
    stream = torch.randn(2, 37, 256, generator=gen, device=DEV).to(torch.bfloat16)
    ref = torch_ops.proj_add(x.float(), weight.float(), stream.float())
    out = fla_ops.proj_add(x, weight, stream)
    assert out.data_ptr() == stream.data_ptr() and out.shape == stream.shape
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -7, atol=1e-2)
