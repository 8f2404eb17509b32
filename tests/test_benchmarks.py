"""The benchmark scripts stay runnable: each parses its options and prints its usage on a CPU machine, and
the ones that have a CPU mode run end to end on tiny inputs (their GPU runs happen on the device only)."""
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).parent.parent
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


def run(*args, cwd=ROOT, env: dict | None = None):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=600, cwd=cwd,
                          env={**os.environ, **env} if env else None)


def benchmark(name: str):
    """benchmarks/NAME.py as a module (benchmarks/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_score():
    return benchmark("bench_score")


def test_there_are_benchmark_scripts():
    assert {"bench_score.py", "bench_kernels.py", "bench_bank.py"} <= {p.name for p in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_prints_its_usage(script):
    res = run(script, "--help")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("usage:") and script.name in res.stdout


def test_bank_benchmark_runs_on_the_cpu(tmp_path):
    out = tmp_path / "bank.json"
    res = run(ROOT / "benchmarks" / "bench_bank.py", "--model", "demo", "--device", "cpu", "--docs", "3",
              "--doc-len", "48", "--reps", "1", "--dir", tmp_path / "bank", "--json", out)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["bank_identical_after_load"] is True
    assert report["total_bytes"] == 3 * report["entry_bytes"]
    assert "prefill" in res.stdout and "load" in res.stdout


def test_long_input_has_the_asked_rows_and_documents(tmp_path):
    out = tmp_path / "long.parquet"
    res = run(ROOT / "benchmarks" / "make_long_input.py", out, "--rows", "53", "--docs", "5")
    assert res.returncode == 0, res.stderr[-2000:]
    table = pq.read_table(out)
    per_doc = Counter(table.column("doc_id").to_pylist())
    assert table.num_rows == 53 and len(per_doc) == 5
    assert sorted(per_doc.values()) == [10, 10, 11, 11, 11]  # the first rows % docs documents get one more


@pytest.mark.parametrize("shape", ["kev-0.8b", "kev-4b"])
def test_the_floor_counts_the_weight_matmuls_the_model_runs(shape):
    """bench_score's floor FLOPs against the model's own projection weights (built on the meta device): every
    branch token through every projection, except the last layer's output projection and MLP, which run at
    each row's last position only, like the LM head; prefill runs every projection on every token but the
    last layer's after its bank entry (its output projection, MLP and an attention layer's q|gate)."""
    import torch

    from kevscore.kernels import torch_ops
    from kevscore.model.config import SHAPES
    from kevscore.model.kev import KevModel

    bench = bench_score()
    cfg = SHAPES[shape]
    with torch.device("meta"):
        model = KevModel(cfg, torch_ops)
    projections = ("in_proj", "out_proj", "qkv_proj", "o_proj", "gate_up", "down")

    def weights(module, names=projections):
        return sum(p.numel() for name, p in module.named_parameters() if name.rsplit(".", 1)[-1] in names)

    per_token = weights(model)
    assert per_token > 0.8 * sum(p.numel() for p in model.parameters()) - cfg.vocab_size * cfg.hidden_size
    last = model.layers[-1]
    last_only = weights(last.mlp) + weights(last.mixer, ("out_proj", "o_proj"))
    tokens, rows = 96 * 64, 96
    expected = 2 * (per_token * tokens - last_only * (tokens - rows) + cfg.hidden_size * cfg.vocab_size * rows)
    assert bench.matmul_flops(cfg, tokens, rows) == expected
    q_gate = last.mixer.qkv_proj[:last.mixer.splits[0]].numel() if cfg.layer_types[-1] == "full_attention" else 0
    assert bench.prefill_flops(cfg, 1000) == 2 * (per_token - last_only - q_gate) * 1000
    # at the W1 shape the last layer's tail is about 2% of the call's FLOPs
    assert 0.01 < 1 - expected / (2 * (per_token * tokens + cfg.hidden_size * cfg.vocab_size * rows)) < 0.04


def test_attention_flops_count_the_pairs_the_masks_allow():
    """Attention's FLOPs against the allowed (query, key) pairs counted off explicit masks: a branch token sees
    the whole document and its own branch up to itself, a prefill token its document up to itself; 4 x head_dim
    FLOPs per pair and query head, in every attention layer (a prefill's last one, when attention, in none)."""
    import dataclasses

    import torch

    from kevscore.model.config import SHAPES

    bench = bench_score()
    cfg = SHAPES["kev-4b"]
    doc, q, rows = 37, 11, 3
    branch_mask = torch.cat([torch.ones(q, doc), torch.ones(q, q).tril()], 1)
    per_pair = 4 * cfg.head_dim * cfg.num_attention_heads
    layers = cfg.layer_types.count("full_attention")
    assert bench.attention_flops(cfg, doc, q, rows) == per_pair * layers * rows * int(branch_mask.sum())
    assert cfg.layer_types[-1] == "full_attention"
    prefill_pairs = int(torch.ones(doc, doc).tril().sum())
    assert bench.prefill_attention_flops(cfg, doc, 2) == per_pair * (layers - 1) * 2 * prefill_pairs
    linear_last = dataclasses.replace(cfg, layer_types=cfg.layer_types[:-1] + ("linear_attention",))
    assert bench.prefill_attention_flops(linear_last, doc, 2) == per_pair * (layers - 1) * 2 * prefill_pairs
    # W2 (8 documents of 8,192 tokens, 12 questions of 64 tokens each): 15% on top of the weight matmuls
    ratio = bench.attention_flops(cfg, 8192, 64, 96) / bench.matmul_flops(cfg, 96 * 64, 96)
    assert 0.14 < ratio < 0.17


def test_kernels_compile_for_the_h200(tmp_path):
    """benchmarks/sm90_build.py compiles every kernel variant for sm_90a without a GPU (Triton's own ptxas):
    a kernel that does not compile fails here, not on the device; every variant fits in 255 registers."""
    out = tmp_path / "sm90.json"
    res = run(ROOT / "benchmarks" / "sm90_build.py", "--json", out)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())
    names = {r["variant"] for r in rows}
    assert any(n.startswith("chunks") for n in names) and any(n.startswith("attention") for n in names)
    assert any(n.startswith("conv") for n in names)
    assert all(0 < r["registers"] <= 255 and r["shared"] >= 0 for r in rows)
    # the defaults the runner launches spill nothing
    from kevscore.kernels.branch_wy import default_block_v

    wy = benchmark("sm90_build").WY_DEFAULTS
    assert all(bv == default_block_v(*tiles) for tiles, bv, _ in wy)
    defaults = {"conv block_t 4 warps 1 tiles 1", "swiglu gemm 128 x 256 x 64 warps 8 stages 3",
                "kkt solve packed False warps 1", "kkt solve packed True warps 1"} | {
        f"wy T tiles {bt1}+{bt2} bv {bv} warps {wp}" for (bt1, bt2), bv, wp in wy}
    assert all(r["spill_bytes"] == 0 for r in rows if r["variant"] in defaults)
    assert defaults <= {r["variant"] for r in rows}
    gemm = next(r for r in rows if r["variant"].startswith("swiglu gemm 128"))
    assert gemm["shared"] <= 227 * 1024, gemm  # its 3 stages of x and weight tiles and the output tile
    # an fp32 model (--dtype fp32) launches these at the Kev-4B shape, its dots in 3xTF32: each fits in a block's
    # 227 KB of shared memory (branch attention's bf16 tiles would take 512 KB in fp32)
    fp32 = [r for r in rows if r["variant"].startswith("fp32 ")]
    assert len(fp32) == 7 and all(r["shared"] <= 227 * 1024 for r in fp32), fp32
    assert sum(r["variant"].startswith("fla ") for r in rows) == 4  # FLA's pinned kernels in bf16 as well
    # which an fp32 model's 3xTF32 leaves alone: no dot of a bf16 model's kernels has fp32 operands without a
    # precision of its own, so their code is the same under TRITON_F32_DEFAULT (set process-wide for fp32)
    bf16 = ("fla ", "chunks packed", "attention bm 128 bn 64", "wy T tiles", "kkt solve")
    again = run(ROOT / "benchmarks" / "sm90_build.py", "--only", ",".join(bf16), "--json", tmp_path / "again.json",
                env={"TRITON_F32_DEFAULT": "tf32x3"})
    assert again.returncode == 0, again.stderr[-3000:]
    ptx = {r["variant"]: r["ptx_sha256"] for r in rows if r["variant"].startswith(bf16)}
    same = {r["variant"]: r["ptx_sha256"] for r in json.loads((tmp_path / "again.json").read_text())}
    assert len(same) >= 8 and same == ptx, (same, ptx)


def test_profile_summary_adds_kernels_whose_short_names_collide():
    """torch's templated elementwise kernels share their first 90 characters: the summary adds them (an
    earlier version overwrote one with the other and undercounted launches, NOTES.md 13)."""
    bench = bench_score()
    prefix = "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native:"
    events = [(prefix + ":sigmoid_kernel", 300.0, 72), (prefix + ":copy_kernel", 600.0, 72),
              ("nvjet_sm90_tst_192x192", 30000.0, 93), ("_chunks_wy_kernel", 9000.0, 72), ("idle", 0.0, 5)]
    out = bench.summarize(events, reps=3)
    assert out["launches_per_call"] == (72 + 72 + 93 + 72) / 3
    assert abs(out["kernel_ms_per_call"] - 39.9 / 3) < 1e-9
    assert out["top_kernel_launches"][prefix[:90]] == 48
    assert abs(out["groups"]["matmul"] - 10.0) < 1e-9 and abs(out["groups"]["gated delta rule (ours)"] - 3.0) < 1e-9


def test_job_benchmark_arithmetic():
    """GPU idle time counts only the gaps between phases (overlaps count none); the job floor is prefill of
    every document token plus scoring of every question, at the measured rate."""
    from kevscore.model.config import SHAPES

    job = benchmark("bench_job")
    assert job.idle_between([("prefill", 0.0, 2.0), ("score", 2.5, 3.0), ("prefill", 3.0, 4.0)]) == 0.5
    assert job.idle_between([("score", 1.0, 3.0), ("prefill", 0.0, 2.0)]) == 0.0  # overlapping: no idle
    assert job.idle_between([]) == 0.0
    cfg = SHAPES["kev-4b"]
    floor = job.job_floor_s(cfg, 1_700_000, 510_000, 6000, 760.0)
    score = bench_score()
    assert floor["prefill"] == pytest.approx(score.prefill_flops(cfg, 1_700_000) / 760e12)
    assert floor["score"] == pytest.approx(score.matmul_flops(cfg, 510_000, 6000) / 760e12)
    assert floor["job"] == pytest.approx(floor["prefill"] + floor["score"])
    assert 18 < floor["job"] < 23  # issue 17's job: ~21 s at 760 TFLOP/s
    # each prefill group's GPU time runs from the end of the one before (or its phase's start); scoring's
    # steps and steps outside a prefill phase are not groups
    phases = [("prefill", 1.0, 1.5), ("score", 1.5, 2.0), ("prefill", 2.0, 3.0)]
    steps = [("prefill", 1.2), ("prefill", 1.5), ("score", 1.9), ("prefill", 2.4), ("prefill", 3.0), ("prefill", 9.0)]
    assert job.group_times(phases, steps) == "200 300 400 600 (4 groups)"
    assert job.group_times(8, []) == "not recorded"  # a report from before the groups were timed


def test_host_lead_per_group():
    """The host's lead over the GPU: each group's last launch against the GPU's end of the group before."""
    job = benchmark("bench_job")
    steps = [("prefill", 1.0), ("prefill", 2.0), ("prefill", 3.0), ("score", 3.5), ("score", 4.0)]
    host = [0.1, 0.4, 2.5, 3.4, 3.45]  # group 3 launched 0.5 s after group 2 ended: the GPU waited
    assert job.host_lead(steps, host, "prefill") == "min -500 ms, median 600 ms, 1 of 2 behind the GPU"
    assert job.host_lead(steps, host, "score") == "min 50 ms, median 50 ms, 0 of 1 behind the GPU"
    assert job.host_lead([], [], "prefill") == "not recorded"


def test_job_stack_sampling_covers_its_seconds_from_its_start():
    """bench_job's stack sampler runs for its SECONDS from when it starts (the job's start), however long the
    process ran before: a window counted from the process's start would have closed during the imports."""
    import threading
    import time

    job = benchmark("bench_job")
    gate = threading.Event()
    sleeper = threading.Thread(target=gate.wait, name="sampled-sleeper")
    sleeper.start()
    try:
        finish = job.sample_stacks(time.perf_counter() - 100.0, 0.3, every=0.01)  # its process began 100 s ago
        time.sleep(0.6)
        samples = finish()
    finally:
        gate.set()
        sleeper.join()
    times = [t for t, name, _ in samples if name == "sampled-sleeper"]
    assert len(times) >= 3 and all(100.0 <= t <= 100.45 for t in times), times  # from its start, for ~0.3 s
    assert any("wait" in frame for t, name, stack in samples if name == "sampled-sleeper" for frame in stack)


def test_job_benchmark_runs_a_job_on_the_cpu(tmp_path):
    """bench_job.py runs `kevscore run`'s job in a child process and reports its phases (CPU, demo model); an A/B's
    swaps (`--fla`, fla_ops' functions: the GPU's, so the CPU job runs as it would) reach the child."""
    out = tmp_path / "job.json"
    res = run(ROOT / "benchmarks" / "bench_job.py", "--device", "cpu", "--model", "demo", "--rows", "12",
              "--docs", "3", "--doc-words", "12", "--question-words", "3", "--starts", "warm",
              "--baseline-docs", "0", "--prefill-docs", "", "--fla", "solve", "--json", out)
    assert res.returncode == 0, res.stderr[-2000:]
    job = json.loads(out.read_text())["jobs"]["warm"]
    assert job["rows"] == 12 and job["documents"] == 3
    assert 0 < job["prefill_s"] + job["score_s"] < job["wall_s"] < job["process_s"]
    assert set(job["load_phases"]) == {"gpu imports", "scan", "checkpoint", "tokens", "runner", "identity"}
    assert "warm" in res.stdout and "rows/s" in res.stdout


def test_the_baselines_and_budgets_sample_the_first_documents_rows(tmp_path):
    """bench_job's sample for the baselines and the scoring budgets: every row of the input's first documents, in
    input order, encoded as a job encodes them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "in.parquet"
    doc_ids = ["b", "a", "b", "c", "a", "c"]
    pq.write_table(pa.table({"doc_id": doc_ids, "document": [f"text of {d}" for d in doc_ids],
                             "question": [f"question {i}?" for i in range(6)]}), data)
    enc, ckpt = benchmark("bench_job").sample_rows(data, 2, "demo", "cpu")
    assert len(enc) == 4 and len(enc.prefixes) == 2  # the rows of b and a, not c
    assert ckpt.tokenizer.decode(enc.prefixes[enc.row_prefix[0]]).count("text of b")


def test_the_first_groups_trace_summary_counts_busy_time_once():
    """Kernels on two streams overlap: busy time is their union, the span first start to last end."""
    job = benchmark("bench_job")
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "gemm", "ts": 1000, "dur": 400},
        {"cat": "kernel", "name": "norm", "ts": 1200, "dur": 400},   # overlaps gemm by 200 us
        {"cat": "kernel", "name": "gemm", "ts": 2000, "dur": 1000},  # after a 400 us gap
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},
    ]}
    summary = job.kernel_summary(trace)
    assert summary["span_ms"] == 2.0 and summary["busy_ms"] == 1.6 and summary["kernels"] == 3
    assert summary["longest_ms"] == [("gemm", 1.4), ("norm", 0.4)]
    assert job.kernel_summary({"traceEvents": []}) == {}


def test_prefill_host_timing_by_layer(tiny, monkeypatch):
    """bench_job's host timing: one record per prefill group on the job's thread, an entry per layer, and the
    functions it wraps restored by the test (they are patched process-wide)."""
    from conftest import cpu_engine, synthetic

    from kevscore.engine import runner as runner_module
    from kevscore.engine.pipeline import Scores
    from kevscore.model.kev import KevModel

    job = benchmark("bench_job")
    monkeypatch.setattr(runner_module, "prefill_inputs", runner_module.prefill_inputs)
    monkeypatch.setattr(KevModel, "prefill", KevModel.prefill)
    groups = job.time_prefill_on_host()
    enc = synthetic([5, 7, 9], [2])
    engine = cpu_engine(tiny, docs=enc.prefixes)
    engine.prefill_tokens = 8  # one document a group
    engine.prefill_wave(enc, [0, 1, 2], Scores.empty(0).stats)
    assert len(groups) == 3 and all(len(g["layers_ms"]) == len(tiny.config.layer_types) for g in groups)
    assert all(g["inputs_ms"] >= 0 and min(g["layers_ms"]) >= 0 for g in groups)
    summary = job.host_summary(groups)
    assert summary.startswith("inputs ") and "(median of 2 groups)" in summary
    assert job.host_summary(groups[:1]) == "not recorded"
