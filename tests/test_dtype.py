"""`--dtype` (and `Scorer(dtype=...)`) on the CPU: the choices and their one-line errors, fp32 as the CPU's only
dtype, the dtype in a job's identity, its output's provenance and the bank's fingerprint, and the pieces of the
GPU's fp32 path that run without a GPU. The GPU runs themselves: tests/test_cuda_dtype.py."""
from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from kevscore.api import Scorer
from kevscore.cli import app
from kevscore.engine.backend import build_runner, resolve_dtype
from kevscore.errors import KevscoreError
from kevscore.job.provenance import differences, output_provenance

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
cli = CliRunner()


def kevscore_run(*args):
    return cli.invoke(app, ["run", *map(str, args), "--quiet"])


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    line, = [x for x in result.stderr.splitlines() if x.strip()]
    assert line.startswith("error: ")
    return line.removeprefix("error: ")


@pytest.fixture
def src(tmp_path) -> Path:
    return Path(shutil.copy(EXAMPLES / "questions.parquet", tmp_path / "q.parquet"))


def test_help_names_the_choices():
    text = " ".join(cli.invoke(app, ["run", "--help"], terminal_width=120).stdout.split())
    assert "--dtype" in text and "[auto|bf16|fp32]" in text


@pytest.mark.parametrize("args, message", [
    (["--dtype", "fp16"], "--dtype fp16: choose auto, bf16 or fp32"),
    (["--dtype", "bfloat16"], "--dtype bfloat16: choose auto, bf16 or fp32"),
    (["--dtype", "bf16"], "--dtype bf16: the CPU runs fp32 only; bf16 needs a GPU (--device cuda)"),
])
def test_bad_dtypes_are_one_line(src, tmp_path, args, message):
    assert one_error_line(kevscore_run(src, "--device", "cpu", "-o", tmp_path / "o.parquet", *args)) == message
    assert not (tmp_path / "o.parquet").exists() and not list(tmp_path.glob("*.parts"))


def test_resolve_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU
    assert resolve_dtype("auto", cuda) == torch.bfloat16 and resolve_dtype("bf16", cuda) == torch.bfloat16
    assert resolve_dtype("fp32", cuda) == torch.float32
    assert resolve_dtype("auto", cpu) == resolve_dtype("fp32", cpu) == torch.float32
    with pytest.raises(KevscoreError, match="the CPU runs fp32 only"):
        resolve_dtype("bf16", cpu)


def test_the_cpu_builds_fp32_runners_only(demo):
    """(resolve_dtype refuses bf16 on the CPU before a runner is built)"""
    for dtype in (None, torch.float32):
        runner = build_runner(demo, torch.device("cpu"), [10], dtype=dtype)
        assert runner.bank.conv.dtype == runner.model.lm_head.dtype == torch.float32


def test_fp32_on_the_cpu_is_the_default_job(src, tmp_path):
    """On the CPU, --dtype fp32 is what auto picks: the same bytes, and the same job (a rerun of the other
    spelling finds the output complete); the output records the dtype."""
    out = tmp_path / "o.parquet"
    assert kevscore_run(src, "--device", "cpu", "-o", out).exit_code == 0
    first = out.read_bytes()
    again = cli.invoke(app, ["run", str(src), "--device", "cpu", "--dtype", "fp32", "-o", str(out)])
    assert again.exit_code == 0 and "already complete" in again.output, again.output
    out.unlink()
    assert kevscore_run(src, "--device", "cpu", "--dtype", "fp32", "-o", out).exit_code == 0
    assert out.read_bytes() == first
    record = output_provenance(out)
    assert record["dtype"] == record["options"]["dtype"] == "float32"


def test_a_change_of_dtype_is_named():
    """A resume under another dtype is refused like any result-changing option, with the flag in words."""
    old = {"options": {"device": "cuda", "dtype": "bfloat16", "labels": ["Yes", "No"]}}
    new = {"options": {"device": "cuda", "dtype": "float32", "labels": ["Yes", "No"]}}
    assert differences(old, new) == ["--dtype bfloat16 -> float32"]


def test_the_bank_fingerprint_holds_the_dtype(demo):
    """Entries of an fp32 GPU model, a bf16 GPU model and the CPU are keyed by three fingerprints, so a
    persistent bank never loads one's entries into another's run."""
    from kevscore.engine.bank_entry import model_fingerprint

    prints = [model_fingerprint(demo, dtype, backend) for dtype, backend in
              ((torch.bfloat16, "fla_ops"), (torch.float32, "fla_ops"), (torch.float32, "torch_ops"))]
    assert len({p.digest for p in prints}) == 3
    assert [p.about["dtype"] for p in prints] == ["bfloat16", "float32", "float32"]


def test_the_scorer_takes_a_dtype(src, tmp_path):
    from kevscore.api import SCORER_OPTIONS

    assert "dtype" in SCORER_OPTIONS  # the command line's --dtype reaches the Scorer it runs through
    default = Scorer("demo", device="cpu").score(src)
    fp32 = Scorer("demo", device="cpu", dtype="fp32")
    assert fp32.options.dtype == "fp32"
    assert fp32.score(src).column("probs").equals(default.column("probs"))
    result = fp32.score_file(src, tmp_path / "o.parquet")
    assert output_provenance(result.output)["options"]["dtype"] == "float32"
    for dtype, message in (("bf16", "--dtype bf16: the CPU runs fp32 only"), ("half", "--dtype half: choose")):
        with pytest.raises(KevscoreError, match=message):
            Scorer("demo", device="cpu", dtype=dtype)


def test_similar_length_prefill_groups(demo):
    """A runner asking for `similar_lengths` (the fp32 GPU runner: no flash attention) gets prefill groups that
    attention pads by at most PAD_WASTE, each with its pad indices; other runners' groups are unchanged."""
    from conftest import cpu_engine, synthetic

    from kevscore.engine.runner import PAD_WASTE, prefill_inputs

    lens = [1, 3, 5, 40, 44, 50, 60, 64, 65, 300, 310, 900]
    enc = synthetic(lens, [4])
    engine = cpu_engine(demo, docs=enc.prefixes)
    assert engine._prefill_groups(enc, list(range(len(lens)))) == [list(range(len(lens)))]
    engine.runner.similar_lengths = True
    groups = engine._prefill_groups(enc, list(range(len(lens))))
    assert sorted(d for g in groups for d in g) == list(range(len(lens))) and len(groups) > 1
    bank = engine.runner.bank
    for group in groups:
        sizes = [lens[d] for d in group]
        assert len(sizes) * max(sizes) <= PAD_WASTE * sum(sizes), sizes
        bank.reset()
        _, ctx = prefill_inputs([enc.prefixes[d] for d in group], [bank.alloc(n) for n in sizes], bank, "cpu", 3)
        assert ctx.pad_index is not None
    scores = engine.run(enc, "indexed").probs  # and the groups score as one group does (to fp32 rounding)
    engine.runner.similar_lengths = False
    for a, b in zip(scores, engine.run(enc, "indexed").probs):
        assert a == pytest.approx(b, abs=1e-6)


def test_fp32_prefill_attention_without_flash(demo, monkeypatch):
    """The GPU backend's prefill attention in fp32 (flash attention has none): padded documents through SDPA
    with each KV head repeated, and documents of far-apart lengths one by one; both against the torch ops. Its
    output gate's kernel (checked in Triton's interpreter, tests/interpret) runs here as torch arithmetic."""
    pytest.importorskip("triton")
    from kevscore.engine.bank import BankLayout, StateBank
    from kevscore.engine.runner import prefill_inputs
    from kevscore.kernels import fla_ops, torch_ops

    def sigmoid_gate(x, gate, index=None):  # elementwise.sigmoid_gate: token n at place index[n] of B x L
        rows = x.flatten(0, 1)
        return (rows if index is None else rows[index]).reshape(gate.shape) * torch.sigmoid(gate)

    monkeypatch.setattr(fla_ops, "sigmoid_gate", sigmoid_gate)

    bank = StateBank(demo.config, BankLayout(8, 2000), "cpu", torch.float32)
    gen = torch.Generator().manual_seed(0)
    for lens, padded in (([100, 90, 110, 95], True), ([1, 5, 64, 65, 130, 3], False), ([64] * 3, True)):
        bank.reset()
        _, ctx = prefill_inputs([[7] * n for n in lens], [bank.alloc(n) for n in lens], bank, "cpu", 3)
        assert (ctx.pad_index is not None) == padded
        n = sum(lens)
        q, gate = (torch.randn(1, n, 4, 64, generator=gen) for _ in range(2))
        k, v = (torch.randn(1, n, 2, 64, generator=gen) for _ in range(2))
        ours, ref = fla_ops.attn_prefill(q, k, v, gate, ctx), torch_ops.attn_prefill(q, k, v, gate, ctx)
        assert ours.shape == ref.shape and torch.allclose(ours, ref, atol=1e-5), (lens, (ours - ref).abs().max())


def test_prefill_memory_per_token_follows_the_dtype(demo):
    from kevscore.engine.cuda_runner import prefill_bytes_per_token

    assert prefill_bytes_per_token(demo.config, 4) == 2 * prefill_bytes_per_token(demo.config)


def test_the_output_of_an_fp32_job_reads_back(src, tmp_path):
    out = tmp_path / "o.parquet"
    assert kevscore_run(src, "--device", "cpu", "--dtype", "fp32", "-o", out).exit_code == 0
    assert pq.read_table(out).num_rows == pq.read_metadata(src).num_rows
    text = cli.invoke(app, ["info", str(out)], terminal_width=80).stdout
    assert "cpu, float32" in text and "dtype" not in text.split("options", 1)[1]  # said once, on the device row


def test_the_fp32_solve_kernel_keeps_flas_launch_interface():
    """fla_oracles.kkt_solve_fp32, FLA's (I + A)^-1 kernel re-jitted with 3xTF32 merges, takes the same constexprs
    and unspecialized arguments as FLA's own (a clone without its annotations compiled nothing on the GPU)."""
    pytest.importorskip("fla")
    import triton
    from fla_oracles import chunk_gated_delta_rule_fwd_kkt_solve_kernel, kkt_solve_fp32

    fla = chunk_gated_delta_rule_fwd_kkt_solve_kernel
    while not isinstance(fla, triton.runtime.jit.JITFunction):
        fla = fla.fn
    ours = kkt_solve_fp32()
    assert ours.constexprs == fla.constexprs and len(ours.constexprs) >= 6
    assert ours.do_not_specialize == fla.do_not_specialize and ours.arg_names == fla.arg_names
    assert ours.fn.__globals__["SOLVE_TRIL_DOT_PRECISION"].value == "tf32x3"
