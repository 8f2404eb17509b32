"""`kevscore compare` on the CPU, driven through typer's runner: report contents, parity gate, errors."""
import json
import os
import re
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kevscore.cli import app

EXAMPLES = Path(__file__).parent.parent / "examples"


def compare(*args: str):
    return CliRunner().invoke(app, ["compare", "--device", "cpu", "--reps", "2", "--warmup", "1", *args])


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    result = compare("--cases", "shared,padded,mixed", "--json", str(out / "r.json"), "--plot", str(out / "r.png"))
    assert result.exit_code == 0, result.output
    return out, result.output, json.loads((out / "r.json").read_text())


def test_report_holds_samples_parity_and_provenance(report):
    out, text, r = report
    assert r["timer"] == "cpu-wall-clock" and r["parity"] is True
    assert [c["name"] for c in r["cases"]] == ["shared", "padded", "mixed"]
    for case in r["cases"]:
        for path in ("gathered", "indexed"):
            assert len(case["latency_ms"][path]) == 2 and all(ms > 0 for ms in case["latency_ms"][path])
            assert len(case["wall_s"][path]) == 2 and case["warmup_s"][path] > 0
            s = case["summary"][path]
            assert s["p10_ms"] <= s["median_ms"] <= s["p90_ms"] and s["rows_per_s"] > 0
        assert case["max_abs_diff"] == 0 and case["flips"] == 0 and case["bank_unchanged"] is True
        assert case["summary"]["indexed_over_gathered"] == pytest.approx(
            case["summary"]["indexed"]["median_ms"] / case["summary"]["gathered"]["median_ms"])
    shared, padded, mixed = r["cases"]
    assert shared["rows"] == 96 and shared["documents"] == 16 and shared["definition"]["questions"] == 6
    assert padded["rows"] == 91  # 13 x 7 fits no row bucket
    assert mixed["prefilled_in_call"] == 8 and shared["prefilled_in_call"] == 0
    env = r["environment"]
    assert set(env["versions"]) >= {"torch", "triton", "transformers", "fla-core", "flash-linear-attention"}
    assert env["versions"]["torch"] and env["device"] == "cpu"
    assert re.fullmatch(r"[0-9a-f]{64}", env["source_sha256"]["kevscore/compare.py"])
    assert "kevscore/kernels/gdr_ref.py" in env["source_sha256"]
    raw = (out / "r.json").read_text()
    for private in (socket.gethostname(), str(Path.home()), os.getcwd(), str(out)):
        assert private not in raw
    assert (out / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "shared" in text and "wall-clock ms" in text and "graph capture" not in text  # not on a CPU


def test_progress_per_case_and_phase_and_spread_warnings(report):
    _, text, r = report
    for line in ("loading demo on cpu", "case 1/3 shared: 96 rows", "shared: warm-up, gathered path",
                 "padded: timing 2 calls per path", "case 3/3 mixed"):
        assert line in text, line
    for case in r["cases"]:
        s = case["summary"]
        g, i = s["gathered"], s["indexed"]
        assert s["spread_overlap"] == (i["p10_ms"] <= g["p90_ms"] and g["p10_ms"] <= i["p90_ms"])
        said = any(w.startswith(f"case {case['name']}: the paths' p10-p90") for w in r["warnings"])
        assert said == s["spread_overlap"]
    busy = max(r["environment"]["load_average"]) >= (os.cpu_count() or 1) / 2
    assert busy == any("machine was busy" in w for w in r["warnings"])
    for warning in r["warnings"]:
        assert warning[:40] in " ".join(text.split())


def test_broken_indexed_path_reports_flips_and_fails(tmp_path, monkeypatch):
    """The demo model answers from its document: an indexed state scan that reads the next entry's state
    flips answers."""
    from kevscore.kernels import torch_ops

    real = torch_ops.gdr_branch

    def broken(q, k, v, gate, beta, bank, slots, path, *rest):
        if path == "indexed":
            slots = (slots + 1) % bank.shape[0]
        return real(q, k, v, gate, beta, bank, slots, path, *rest)

    monkeypatch.setattr(torch_ops, "gdr_branch", broken)
    result = compare("--data", str(EXAMPLES / "questions.parquet"), "--cases", "warm",
                     "--json", str(tmp_path / "r.json"))
    assert result.exit_code == 1
    assert "parity failed in warm" in result.output
    case = json.loads((tmp_path / "r.json").read_text())["cases"][0]
    assert case["flips"] > 0 and case["max_abs_diff"] > 0
    assert case["summary"]["parity"] is False


def test_data_rows_at_every_temperature(tmp_path):
    result = compare("--data", str(EXAMPLES / "questions.parquet"), "--cases", "cold,warm",
                     "--json", str(tmp_path / "r.json"), "--baseline", "hf")
    assert result.exit_code == 0, result.output
    r = json.loads((tmp_path / "r.json").read_text())
    cold, warm = r["cases"]
    assert cold["prefilled_in_call"] == cold["documents"] > 0 and warm["prefilled_in_call"] == 0
    assert cold["rows"] == warm["rows"] > 0 and r["parity"]
    for case in (cold, warm):  # transformers on the full sequences, timed and compared with indexed
        assert len(case["hf_ms"]) == 2 and all(ms > 0 for ms in case["hf_ms"])
        assert case["summary"]["hf_over_indexed"] == pytest.approx(
            case["summary"]["hf_median_ms"] / case["summary"]["indexed"]["median_ms"])
    assert "transformers naive: cold" in result.output


@pytest.mark.parametrize("args, message", [
    (["--cases", "shared,nope"], "--cases nope: choose among"),
    (["--data", str(EXAMPLES / "questions.parquet"), "--cases", "shared"], "with --data, the cases are"),
    (["--reps", "0"], "need reps >= 1"),
    (["--batch-rows", "0"], "--batch-rows 0: must be at least 1"),  # as `run` refuses it
    (["--baseline", "vllm"], "--baseline vllm: choose hf or fp32"),
    (["--baseline", "fp32"], "--baseline fp32: the CPU runs fp32 already"),  # bf16 runs on a GPU only
    (["--json", "/nonexistent-dir/r.json"], "its folder does not exist"),
])
def test_bad_options_fail_with_one_line(args, message):
    result = compare(*args)
    assert result.exit_code == 2 and message in result.output


def test_fp32_baseline_times_an_fp32_engine_and_reports_the_rows_that_flip(tiny, demo):
    """`--baseline fp32` (a GPU's; the CPU has fp32 alone) on CPU engines: the baseline engine scores each case's
    rows on the indexed path, is timed, and the rows whose prediction differs are named. Here the baseline is
    another model (tiny), so predictions do differ; against itself, none does."""
    from conftest import cpu_engine, synthetic

    from kevscore.compare import run_case

    enc = synthetic([30, 70, 130], [5, 17, 40], labels=(361, 383))
    ours, theirs = (cpu_engine(m, docs=enc.prefixes) for m in (demo, tiny))
    want = [theirs.run(enc, "indexed").probs, ours.run(enc, "indexed").probs]
    flips = [r for r, (a, b) in enumerate(zip(*want)) if (a[0] > a[1]) != (b[0] > b[1])]
    res = run_case(ours, "warm", enc, 1.0, {}, reps=1, warmup=1, hf_reps=2, fp32=theirs)
    assert len(res.fp32_ms) == 2 and all(ms > 0 for ms in res.fp32_ms)
    assert res.fp32_flipped == flips and flips
    assert res.fp32_max_abs_diff == max(abs(x - y) for a, b in zip(*want) for x, y in zip(a, b)) > 0
    s = res.summary()
    assert s["fp32_over_indexed"] == pytest.approx(s["fp32_median_ms"] / s["indexed"]["median_ms"])
    assert res.parity  # the baseline's flips are no parity failure
    same = run_case(ours, "mixed", enc, 0.5, {}, reps=1, warmup=1, hf_reps=1, fp32=cpu_engine(demo, docs=enc.prefixes))
    assert same.fp32_flipped == [] and same.fp32_max_abs_diff == 0.0


def test_long_document_case_asks_many_questions_of_each_long_document(tmp_path):
    """Issue 21's W2 shape, small on a CPU: each document 4x longer than the other cases' and 12 rows reading it;
    both paths to the bit, the bank unchanged."""
    result = compare("--cases", "long-document", "--reps", "1", "--json", str(tmp_path / "r.json"))
    assert result.exit_code == 0, result.output
    case, = json.loads((tmp_path / "r.json").read_text())["cases"]
    assert case["rows"] == 48 and case["documents"] == 4 and case["definition"]["questions"] == 12
    assert case["definition"]["doc_len"] == 4 * 48
    assert case["max_abs_diff"] == 0 and case["flips"] == 0 and case["bank_unchanged"] is True


def test_outputs_that_are_inputs_directories_or_each_other_are_refused_before_any_work(tmp_path):
    from kevscore.model.demo import demo_checkpoint_dir
    demo = demo_checkpoint_dir()
    import shutil
    data = tmp_path / "victim.parquet"
    shutil.copy(EXAMPLES / "questions.parquet", data)
    before = data.read_bytes()
    for args, message in [(["--data", str(data), "--cases", "warm", "--json", str(data)], "is the --data input"),
                          (["--data", str(data), "--cases", "warm", "--plot", str(data)], "is the --data input"),
                          (["--json", str(tmp_path / "r"), "--plot", str(tmp_path / "." / "r")], "both name"),
                          (["--json", str(tmp_path)], "is a directory"),
                          (["--model", str(demo), "--json", str(demo / "config.json")], "inside the model's"),
                          (["--documents", str(data)], "--documents")]:
        result = compare(*args)
        assert result.exit_code == 2 and message in result.output, (args, result.output)
        assert len(result.output.strip().splitlines()) == 1 and "loading" not in result.output
    assert data.read_bytes() == before


def test_empty_data_is_refused_not_parity_ok(tmp_path):
    import pyarrow.parquet as pq
    empty = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(EXAMPLES / "questions.parquet").slice(0, 0), empty)
    result = compare("--data", str(empty), "--cases", "warm")
    assert result.exit_code == 2 and "no rows to compare" in result.output, result.output


def test_a_model_producing_nan_writes_valid_json_and_blames_neither_path(tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from kevscore.model.demo import demo_checkpoint_dir
    model = Path(shutil.copytree(demo_checkpoint_dir(), tmp_path / "nan-model"))
    weights = load_file(model / "model.safetensors")
    weights["model.embed_tokens.weight"] = torch.full_like(weights["model.embed_tokens.weight"], float("nan"))
    save_file(weights, model / "model.safetensors")
    result = compare("--model", str(model), "--cases", "shared", "--json", str(tmp_path / "r.json"))
    assert result.exit_code == 1 and "shared: both paths' probabilities are non-finite" in result.output, result.output
    assert "indexed path does not reproduce" not in result.output

    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    case = json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse)["cases"][0]
    assert case["max_abs_diff"] is None and case["non_finite"] == ["gathered", "indexed"]
    assert case["summary"]["parity"] is False


def test_a_path_with_non_finite_probabilities_is_named_in_the_table():
    from kevscore import display
    case = {"non_finite": ["gathered"], "max_abs_diff": None, "flips": 0, "bank_unchanged": True}
    assert "gathered not finite" in display._parity(case) and "max |dp|" not in display._parity(case)
    assert display._parity({**case, "non_finite": []}) == "ok"
