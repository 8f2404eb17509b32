"""GPU tests (marked `cuda`) of `--dtype fp32`: the fp32 model against the CPU path (fp32) within 1e-4, its prefill
(no flash attention in fp32) against the CPU's entries, its bank entries apart from bf16's, a job of another dtype
refused, and `compare --baseline fp32` reporting the rows whose prediction bf16 flips.

An fp32 model's Triton dots run in 3xTF32 (TRITON_F32_DEFAULT, set when its runner is built), which Triton reads
when it compiles a kernel; other tests in this process may have compiled fp32 kernels already, in TF32 (their
default), and Triton keeps those. So the test of the precision promise runs `kevscore run` in a process of its
own, as a user does; the tests in this process hold fp32 to tolerances that TF32 meets too (emulated on the CPU
with these inputs: 2.6e-4 in probabilities, 3.6e-4 relative in the states)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import cpu_engine, gpu_engine, synthetic
from typer.testing import CliRunner

from kevscore.cli import app

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
FP32 = torch.float32


def labelled_questions(tmp_path: Path, example_rows: list[dict]) -> Path:
    """examples/questions.parquet with labels of one and of several tokens: label masses far below 1, where an
    error of the arithmetic shows (TF32 dots move them by 0.4% in a CPU emulation)."""
    labels = [[["Yes", "No"], ["Yes", "No", "maybe"], ["No way", "Yes"]][i % 3] for i in range(len(example_rows))]
    src = tmp_path / "labelled.parquet"
    pq.write_table(pa.Table.from_pylist(example_rows).append_column("labels", pa.array(labels)), src)
    return src


def run_in_a_process(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "kevscore", "run", *map(str, args), "--quiet"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


def test_fp32_run_matches_the_cpu_path_within_1e_4(tmp_path, example_rows):
    """`kevscore run --device cuda --dtype fp32` (in a process of its own) against `--device cpu`: every
    probability within 1e-4 and every label mass within 1e-4 relative, on the demo task and on labels of several
    tokens; its two state reads agree to the bit; the output records float32."""
    for src in (EXAMPLES / "demo-task.parquet", labelled_questions(tmp_path, example_rows)):
        out = {}
        for device, read in (("cuda", "indexed"), ("cuda", "gathered"), ("cpu", "indexed")):
            path = tmp_path / f"{src.stem}-{device}-{read}.parquet"
            res = run_in_a_process(src, "--device", device, "--dtype", "fp32", "--state-read", read, "-o", path)
            assert res.returncode == 0, res.stderr[-3000:]
            out[device, read] = pq.read_table(path)
        gpu, cpu = out["cuda", "indexed"], out["cpu", "indexed"]
        assert gpu.column("probs").equals(out["cuda", "gathered"].column("probs"))
        worst = max(abs(a - b) for ra, rb in zip(gpu.column("probs").to_pylist(), cpu.column("probs").to_pylist())
                    for a, b in zip(ra, rb))
        mass = max(abs(a - b) / max(b, 1e-300) for a, b in zip(gpu.column("label_mass").to_pylist(),
                                                                 cpu.column("label_mass").to_pylist()))
        print(f"{src.name}: fp32 GPU against the CPU: max |dp| {worst:.3g}, label mass {mass:.3g} relative")
        assert worst <= 1e-4 and mass <= 1e-4, (src.name, worst, mass)
        assert gpu.column("prediction").equals(cpu.column("prediction"))
        meta = json.loads(pq.read_schema(tmp_path / f"{src.stem}-cuda-indexed.parquet").metadata[b"kevscore.provenance"])
        assert meta["dtype"] == meta["options"]["dtype"] == "float32" and meta["options"]["device"] == "cuda"


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_fp32_engine_close_to_the_cpu_engine(tiny, eager):
    """The fp32 runner (random weights, documents up to 2048 tokens, branches of one to 130 tokens) against the CPU
    engine: fp32 model and bank, both state reads, eager and under CUDA graphs (3xTF32 gives about 1e-6; the
    bound is TF32's, see above)."""
    enc = synthetic([1, 63, 64, 65, 300, 2048], [1, 17, 64, 65, 130])
    engine = gpu_engine(tiny, enc.prefixes, eager=eager, max_rows=8, dtype=FP32)
    bank = engine.runner.bank
    assert engine.runner.model.lm_head.dtype == FP32 and bank.conv.dtype == bank.kv.dtype == FP32
    assert os.environ.get("TRITON_F32_DEFAULT") == "tf32x3"
    ref = cpu_engine(tiny, docs=enc.prefixes, max_rows=8).run(enc, "indexed").probs
    for path in ("indexed", "gathered"):
        got = engine.run(enc, path).probs
        worst = max(abs(a - b) for ra, rb in zip(got, ref) for a, b in zip(ra, rb))
        print(f"{path}: max |dp| {worst:.3g}")
        assert worst < 1e-3, (path, worst)
    if not eager:
        assert engine.runner.graphs


def test_fp32_prefill_close_to_the_cpu_entries(tiny):
    """fp32 has no flash attention: the runner groups documents of similar lengths (padded SDPA), and a group of
    far-apart lengths (here given to the runner directly) runs document by document; both write the entries the
    CPU writes, to fp32 rounding."""
    from kevscore.engine.pipeline import Scores

    lens = [1, 5, 63, 64, 65, 200, 700, 129]
    enc = synthetic(lens, [4])
    gpu, cpu = gpu_engine(tiny, enc.prefixes, dtype=FP32), cpu_engine(tiny, docs=enc.prefixes)
    assert gpu.runner.similar_lengths and len(gpu._prefill_groups(enc, list(range(len(lens))))) > 1
    for engine in (gpu, cpu):
        engine.prefill_wave(enc, list(range(len(lens))), Scores.empty(0).stats)
    n, tokens = len(lens), cpu.runner.bank.used_tokens

    def entries(bank):
        return bank.state[:, :n].cpu(), bank.conv[:, :n].cpu(), bank.kv[:, :, :tokens].cpu()

    want = entries(cpu.runner.bank)
    grouped = entries(gpu.runner.bank)
    bank = gpu.runner.bank
    bank.reset()
    slots = [bank.alloc(x) for x in lens]
    bank.publish()
    gpu.runner.prefill(enc.prefixes, slots)  # one pack of every length: attention document by document
    alone = entries(bank)
    for got in (grouped, alone):
        for name, a, b in zip(("state", "conv", "kv"), got, want):
            rel = ((a - b).norm() / b.norm()).item()
            assert rel < 2e-3, (name, rel)


def test_bank_entries_of_each_dtype_are_kept_apart(tmp_path):
    """A persistent bank keys entries by a fingerprint holding the dtype: an fp32 run over a bank a bf16 run
    filled prefills its documents (and adds its own entries), and its next run loads them, to the bit."""
    from kevscore.engine.bank_inspect import inspect_bank
    from kevscore.job.options import RunOptions
    from kevscore.job.run import run_job

    src = EXAMPLES / "questions.parquet"

    def run(dtype: str, name: str):
        return run_job(RunOptions(input=src, output=tmp_path / name, device="cuda", dtype=dtype,
                                  bank=tmp_path / "bank"))

    bf16 = run("bf16", "bf16.parquet")
    first = run("fp32", "fp32.parquet")
    again = run("fp32", "again.parquet")
    assert bf16.bank.saved == 6 and (first.bank.loaded, first.bank.saved) == (0, 6)
    assert (again.bank.loaded, again.stats.prefilled) == (6, 0)
    probs = [pq.read_table(tmp_path / n).column("probs") for n in ("bf16.parquet", "fp32.parquet", "again.parquet")]
    assert probs[1].equals(probs[2]) and not probs[0].equals(probs[1])
    report = inspect_bank(tmp_path / "bank")
    assert sorted(m["about"]["dtype"] for m in report["models"].values()) == ["bfloat16", "float32"]


def test_an_output_of_another_dtype_is_another_job(tmp_path):
    """A rerun with the other dtype does not pass for the job that wrote the output; with the same one it does."""
    src, out = EXAMPLES / "questions.parquet", tmp_path / "out.parquet"

    def run(*args):
        return CliRunner().invoke(app, ["run", str(src), "--device", "cuda", "-o", str(out), *args])

    assert run().exit_code == 0
    assert json.loads(pq.read_schema(out).metadata[b"kevscore.provenance"])["dtype"] == "bfloat16"
    assert "already complete" in run("--dtype", "bf16").output  # auto on a GPU is bf16: the same job
    other = run("--dtype", "fp32")
    assert other.exit_code == 2 and "already exists (the output of another job)" in other.output, other.output


def test_compare_baseline_fp32_reports_the_rows_that_flip(tmp_path, example_rows):
    """`kevscore compare --baseline fp32 --data`: the bf16 paths' parity as always, and the fp32 model timed and
    compared row by row; its differences are reported, never a failure."""
    src = labelled_questions(tmp_path, example_rows)
    result = CliRunner().invoke(app, ["compare", "--device", "cuda", "--data", str(src), "--cases", "warm,cold",
                                      "--reps", "2", "--warmup", "1", "--baseline", "fp32",
                                      "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["parity"] and report["options"]["baseline"] == "fp32"
    for case in report["cases"]:
        assert len(case["fp32_ms"]) == 2 and all(ms > 0 for ms in case["fp32_ms"])
        flipped = case["fp32_flipped"]
        assert all(0 <= r < case["rows"] for r in flipped) and flipped == sorted(set(flipped))
        assert 0 < case["fp32_max_abs_diff"] < 0.5  # bf16 is not fp32, and not far from it
        assert case["summary"]["fp32_over_indexed"] > 0
    assert "predictions flipped" in " ".join(result.output.split())


def test_fused_mlp_run_close_to_the_default(tmp_path, example_rows):
    """The gate|up GEMM with SwiGLU in its epilogue (`kernels/swiglu_gemm.py`, bf16's default on the H200), in a
    process of its own, against cuBLAS + `swiglu_rows` (KEVSCORE_FUSED_MLP=0): every probability within 0.02, its
    two state reads equal to the bit, on the demo task and on labels of several tokens."""
    for src in (EXAMPLES / "demo-task.parquet", labelled_questions(tmp_path, example_rows)):
        out = {}
        for fused, read in (("1", "indexed"), ("1", "gathered"), ("0", "indexed")):
            path = tmp_path / f"{src.stem}-{fused}-{read}.parquet"
            res = run_in_a_process(src, "--device", "cuda", "--state-read", read, "-o", path,
                                   env={"KEVSCORE_FUSED_MLP": fused})
            assert res.returncode == 0, res.stderr[-3000:]
            out[fused, read] = pq.read_table(path).column("probs").to_pylist()
        assert out["1", "indexed"] == out["1", "gathered"]
        worst = max(abs(a - b) for ra, rb in zip(out["1", "indexed"], out["0", "indexed"]) for a, b in zip(ra, rb))
        assert worst < 0.02, worst

