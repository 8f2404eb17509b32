"""The persistent bank (`--bank DIR`) and `kevscore bank-inspect`, through real CPU runs of the demo model:
warm and mixed runs, corruption of every kind detected and recomputed, killed and concurrent runs,
eviction, and the inspect output. Nothing here depends on the demo model's probability values."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from kevscore import faults
from kevscore.cli import app
from kevscore.engine.bank_dir import INDEX, MARKER
from kevscore.engine.bank_inspect import inspect_bank
from kevscore.job.options import RunOptions
from kevscore.job.run import run_job
from kevscore.model.config import FULL, LINEAR

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ROOT = Path(__file__).resolve().parent.parent
cli = CliRunner()


def run(src: Path, bank: Path | None, out: Path, **kw):
    return run_job(RunOptions(input=src, output=out, device="cpu", overwrite=True, bank=bank, **kw))


def probs(path: Path) -> dict[str, list[float]]:
    t = pq.read_table(path)
    return dict(zip(t.column("question_id").to_pylist(), t.column("probs").to_pylist()))


def subset(rows: list[dict], doc_ids: set[str], path: Path) -> Path:
    pq.write_table(pa.Table.from_pylist([r for r in rows if r["doc_id"] in doc_ids]), path)
    return path


def close(got: dict[str, list[float]], want: dict[str, list[float]]) -> None:
    assert got.keys() == want.keys()
    for qid, p in want.items():
        assert got[qid] == pytest.approx(p, abs=1e-6), qid


def index(bank: Path) -> dict:
    return json.loads((bank / INDEX).read_text())


def entry_of(bank: Path, doc_id: str) -> tuple[str, Path]:
    """(key, file) of the entry whose recorded document ids hold `doc_id`."""
    for key, rec in index(bank)["entries"].items():
        if doc_id in rec["doc_ids"]:
            return key, bank / rec["file"]
    raise AssertionError(f"no entry for {doc_id}")


def entry_files(bank: Path) -> dict[str, int]:
    return {p.name.removesuffix(".safetensors"): p.stat().st_size for p in (bank / "entries").glob("*/*.safetensors")}


def verify_ok(bank: Path, entries: int) -> dict:
    report = inspect_bank(bank, verify=True)
    assert report["bad_entries"] == [] and len(report["entries"]) == entries, report
    assert all(e["status"] == "ok" for e in report["entries"])
    return report


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return pq.read_table(EXAMPLES / "questions.parquet").to_pylist()


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> tuple[Path, dict[str, list[float]]]:
    """A bank holding the six example documents, made by a cold run, and that run's probabilities."""
    d = tmp_path_factory.mktemp("warm")
    shutil.copy(EXAMPLES / "questions.parquet", d / "questions.parquet")
    result = run(d / "questions.parquet", d / "bank", d / "out.parquet")
    assert result.bank.saved == 6 and result.bank.loaded == 0 and result.stats.prefilled == 6
    return d / "bank", probs(d / "out.parquet")


@pytest.fixture
def bank(warm, tmp_path) -> Path:
    """A private copy of the warm bank."""
    shutil.copytree(warm[0], tmp_path / "bank")
    return tmp_path / "bank"


@pytest.fixture
def src(tmp_path) -> Path:
    shutil.copy(EXAMPLES / "questions.parquet", tmp_path / "questions.parquet")
    return tmp_path / "questions.parquet"


# ---------------------------------------------------------------- warm and mixed runs

def test_second_run_loads_every_entry_and_matches_exactly(tmp_path, src):
    base = run(src, None, tmp_path / "base.parquet")
    first = run(src, tmp_path / "bank", tmp_path / "first.parquet")
    assert (first.bank.loaded, first.stats.prefilled, first.bank.saved) == (0, 6, 6)
    files = entry_files(tmp_path / "bank")
    assert len(files) == 6 and first.bank.written_bytes == sum(files.values())
    second = run(src, tmp_path / "bank", tmp_path / "second.parquet")
    assert (second.bank.loaded, second.stats.prefilled, second.bank.saved) == (6, 0, 0)
    assert second.bank.read_bytes == sum(files.values()) and second.bank.written_bytes == 0
    assert first.bank.warnings == second.bank.warnings == []
    assert probs(tmp_path / "second.parquet") == probs(tmp_path / "first.parquet") == probs(tmp_path / "base.parquet")
    masses = [pq.read_table(tmp_path / f"{n}.parquet").column("label_mass").to_pylist() for n in ("first", "second")]
    assert masses[0] == masses[1]
    assert base.bank is None


def test_mixed_run_prefills_exactly_the_new_documents(tmp_path, rows, warm, monkeypatch):
    from kevscore.engine.runner import EagerRunner
    from kevscore.model.checkpoint import load_checkpoint

    old = {"market", "train", "garden"}
    run(subset(rows, old, tmp_path / "old.parquet"), tmp_path / "bank", tmp_path / "old.out.parquet")
    prefilled: list[list[int]] = []
    original = EagerRunner.prefill
    monkeypatch.setattr(EagerRunner, "prefill", lambda self, docs, slots: (prefilled.extend(docs),
                                                                           original(self, docs, slots))[1])
    shutil.copy(EXAMPLES / "questions.parquet", tmp_path / "all.parquet")
    result = run(tmp_path / "all.parquet", tmp_path / "bank", tmp_path / "all.out.parquet")
    assert (result.bank.loaded, result.stats.prefilled, result.bank.saved) == (3, 3, 3)
    tok = load_checkpoint("demo").tokenizer
    texts = {r["doc_id"]: r["document"] for r in rows}
    seen = {doc for ids in prefilled for doc, text in texts.items() if text in tok.decode(ids)}
    assert len(prefilled) == 3 and seen == set(texts) - old
    close(probs(tmp_path / "all.out.parquet"), warm[1])
    assert len(entry_files(tmp_path / "bank")) == 6


def test_waves_load_and_prefill_per_wave(tmp_path, src, bank, warm):
    for key in list(entry_files(bank))[:2]:
        (bank / "entries" / key[:2] / f"{key}.safetensors").unlink()
    result = run(src, bank, tmp_path / "out.parquet", bank_capacity=2)
    assert result.stats.waves == 3
    assert (result.bank.loaded, result.stats.prefilled, result.bank.saved) == (4, 2, 2)
    close(probs(tmp_path / "out.parquet"), warm[1])  # other waves: other padding, other fp32 rounding
    verify_ok(bank, 6)


# ---------------------------------------------------------------- damage: detected, reported, recomputed

def _recomputed(src: Path, bank: Path, out: Path, warm, reasons: list[str], doc: str = "garden") -> None:
    """A CLI run on the damaged bank: one warning line naming the entry and the reason, exactly the
    damaged entry prefilled, the warm run's probabilities, and a bank that verifies afterwards."""
    key, _ = entry_of(bank, doc)
    result = cli.invoke(app, ["run", str(src), "--device", "cpu", "--bank", str(bank), "-o", str(out), "--overwrite"])
    assert result.exit_code == 0, (result.stderr, result.exception)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, result.stderr
    for part in [key[:12], f"doc ids {doc}", "recomputing it", *reasons]:
        assert part in warnings[0], (part, warnings[0])
    assert "5 loaded, 1 prefilled, 1 saved" in result.stderr
    close(probs(out), warm[1])  # the damaged entry's document is prefilled alone: other fp32 rounding
    verify_ok(bank, 6)


@pytest.mark.parametrize("where", ["data", "header"])
def test_flipped_byte_is_detected_and_recomputed(tmp_path, src, bank, warm, where):
    _, path = entry_of(bank, "garden")
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    if where == "data":
        pos = 8 + n + (len(data) - 8 - n) // 2
        data[pos] ^= 0x01
    else:  # a digit of a recorded CRC-32 in the header's metadata
        start = data.index(b'"crc32"', 8, 8 + n) + len(b'"crc32"')
        pos = next(i for i in range(start, 8 + n) if chr(data[i]).isdigit())
        data[pos] = ord("0") + (data[pos] - ord("0") + 1) % 10
    path.write_bytes(bytes(data))
    assert inspect_bank(bank, verify=True)["bad_entries"] == [entry_of(bank, "garden")[0]]
    _recomputed(src, bank, tmp_path / "out.parquet", warm, ["checksum mismatch"])


def test_truncated_file_is_detected_and_recomputed(tmp_path, src, bank, warm):
    _, path = entry_of(bank, "garden")
    os.truncate(path, path.stat().st_size // 2)
    _recomputed(src, bank, tmp_path / "out.parquet", warm, ["truncated"])


def test_negative_shape_in_a_header_is_refused_and_recomputed(tmp_path, src, bank, warm):
    # two dimensions of one tensor negated: the product, and so the byte range, still fits
    _, path = entry_of(bank, "garden")
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) >= 2)
    header[name]["shape"][:2] = [-d for d in header[name]["shape"][:2]]
    head = json.dumps(header).encode()
    path.write_bytes(len(head).to_bytes(8, "little") + head + data[8 + n:])
    _recomputed(src, bank, tmp_path / "out.parquet", warm, [f"tensor {name!r}: malformed header entry"])


def test_entry_of_another_model_under_this_key_is_refused(tmp_path, src, bank, warm):
    # a well-formed entry file of another document and model planted under garden's key
    _, garden = entry_of(bank, "garden")
    _, market = entry_of(bank, "market")
    shutil.copy(market, garden)
    _recomputed(src, bank, tmp_path / "out.parquet", warm, ["key does not match"])


@pytest.mark.parametrize("damage", ["deleted", "garbage"])
def test_lost_index_is_rebuilt(tmp_path, src, bank, warm, damage):
    if damage == "deleted":
        (bank / INDEX).unlink()
    else:
        (bank / INDEX).write_text('{"format": "kevscore-bank", "entries": [')
    result = cli.invoke(app, ["run", str(src), "--device", "cpu", "--bank", str(bank), "-o",
                              str(tmp_path / "out.parquet")])
    assert result.exit_code == 0, (result.stderr, result.exception)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "index.json" in warnings[0] and "rebuilding it from 6 entry files" in warnings[0]
    assert ("is missing" if damage == "deleted" else "is unreadable") in warnings[0]
    assert "6 loaded, 0 prefilled, 0 saved" in result.stderr
    assert probs(tmp_path / "out.parquet") == warm[1]
    rebuilt = index(bank)["entries"]
    assert len(rebuilt) == 6 and sorted(d for r in rebuilt.values() for d in r["doc_ids"]) == sorted(
        {r["doc_id"] for r in pq.read_table(src).to_pylist()})
    verify_ok(bank, 6)


def test_bank_pointed_at_another_model(tmp_path, src, bank, warm):
    from safetensors.torch import load_file, save_file

    from kevscore.model.demo import demo_checkpoint_dir

    other = tmp_path / "other-model"
    shutil.copytree(demo_checkpoint_dir(), other)
    weights = load_file(other / "model.safetensors")
    name = next(n for n in sorted(weights) if n.endswith("post_attention_layernorm.weight"))
    weights[name] = weights[name] + 0.25
    save_file(weights, other / "model.safetensors")
    out = tmp_path / "other.parquet"
    result = cli.invoke(app, ["run", str(src), "--device", "cpu", "--bank", str(bank), "--model", str(other),
                              "-o", str(out)])
    assert result.exit_code == 0, (result.stderr, result.exception)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    demo_fp = next(iter(index(bank)["models"]))
    assert len(warnings) == 1, result.stderr
    for part in ["6 of this run's documents have entries made by another model", demo_fp[:12], "prefilling"]:
        assert part in warnings[0], (part, warnings[0])
    assert "0 loaded, 6 prefilled, 6 saved" in result.stderr
    other_probs = probs(out)
    assert other_probs != warm[1]  # really another model
    again = run(src, bank, tmp_path / "again.parquet", model=str(other))
    assert (again.bank.loaded, again.stats.prefilled, again.bank.warnings) == (6, 0, [])
    assert probs(tmp_path / "again.parquet") == other_probs
    back = run(src, bank, tmp_path / "back.parquet")  # the demo's own entries are intact
    assert (back.bank.loaded, back.stats.prefilled, back.bank.warnings) == (6, 0, [])
    assert probs(tmp_path / "back.parquet") == warm[1]
    report = verify_ok(bank, 12)
    assert sorted(m["entries"] for m in report["models"].values()) == [6, 6]


@pytest.mark.parametrize("where", [MARKER, INDEX])
def test_other_format_version_is_refused(tmp_path, src, bank, where):
    info = json.loads((bank / where).read_text())
    info["version"] = 99
    (bank / where).write_text(json.dumps(info))
    before = {p: p.read_bytes() for p in bank.rglob("*") if p.is_file()}
    result = cli.invoke(app, ["run", str(src), "--device", "cpu", "--bank", str(bank), "-o",
                              str(tmp_path / "out.parquet")])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for part in ["kevscore bank format version 99", "reads version 1", str(bank)]:
        assert part in lines[0], (part, lines[0])
    assert not (tmp_path / "out.parquet").exists()
    inspected = cli.invoke(app, ["bank-inspect", str(bank)])
    assert inspected.exit_code == 2 and "format version 99" in inspected.stderr
    assert {p: p.read_bytes() for p in bank.rglob("*") if p.is_file()} == before


def test_bank_option_errors(tmp_path, src):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "notes.txt").write_text("mine")
    for args, parts in [
        (["--bank-max-gb", "1"], ["--bank-max-gb needs --bank"]),
        (["--bank", str(tmp_path / "b"), "--bank-max-gb", "0"], ["--bank-max-gb 0.0", "more than 0"]),
        (["--bank", str(tmp_path / "b"), "--bank-max-gb", "inf"], ["--bank-max-gb inf", "more than 0"]),
        (["--bank-capacity", str(10**9)], ["a state bank of 1,000,000,000 entries does not fit", "--bank-capacity"]),
        (["--bank", str(tmp_path / "a-file")], [str(tmp_path / "a-file"), "not a directory"]),
        (["--bank", str(tmp_path / "stuff")], [str(tmp_path / "stuff"), "not a kevscore bank", "notes.txt"]),
    ]:
        result = cli.invoke(app, ["run", str(src), "--device", "cpu", "-o", str(tmp_path / "o.parquet"), *args])
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        for part in parts:
            assert part in lines[0], (part, lines[0])
    assert sorted(p.name for p in (tmp_path / "stuff").iterdir()) == ["notes.txt"]
    assert not (tmp_path / "b").exists()


def test_failed_index_write_costs_the_bank_not_the_run(tmp_path, src, warm, monkeypatch):
    # the disk fills inside the commit's index write, after the entry files were renamed in
    monkeypatch.setenv("KEVSCORE_TEST_ENOSPC", "bank-index-write")
    monkeypatch.setattr(faults, "_reached", Counter())
    result = cli.invoke(app, ["run", str(src), "--device", "cpu", "--bank", str(tmp_path / "bank"), "-o",
                              str(tmp_path / "out.parquet")])
    assert result.exit_code == 0, (result.stderr, result.exception)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], result.stderr
    assert "0 saved" in result.stderr and "6 saved" not in result.stderr  # the summary counts kept entries
    assert probs(tmp_path / "out.parquet") == warm[1]
    monkeypatch.delenv("KEVSCORE_TEST_ENOSPC")
    again = run(src, tmp_path / "bank", tmp_path / "again.parquet")  # the renamed files are adopted
    assert (again.bank.loaded, again.stats.prefilled, again.bank.warnings) == (6, 0, [])
    verify_ok(tmp_path / "bank", 6)


def test_run_and_inspect_help_list_bank_options():
    assert all(o in cli.invoke(app, ["run", "--help"]).stdout for o in ("--bank", "--bank-max-gb"))
    text = cli.invoke(app, ["bank-inspect", "--help"]).stdout
    assert all(o in text for o in ("--entry", "--verify", "--json"))


# ---------------------------------------------------------------- eviction

def test_eviction_keeps_the_bank_under_the_limit_lru_first(tmp_path, rows, warm):
    sizes = {rec["doc_ids"][0]: rec["file_bytes"] for rec in index(warm[0])["entries"].values()}
    keep = {"market", "trip", "recipe"}
    limit = sum(sizes[d] for d in keep) + 100
    assert sum(sorted(sizes.values())[:4]) > limit  # no four entries fit
    bank = tmp_path / "bank"
    run(subset(rows, {"market", "train", "garden"}, tmp_path / "a.parquet"), bank, tmp_path / "a.out.parquet")
    # market, the oldest entry, is used again: train and garden become the least recently used
    used = run(subset(rows, {"market"}, tmp_path / "b.parquet"), bank, tmp_path / "b.out.parquet")
    assert used.bank.loaded == 1
    new = subset(rows, {"trip", "recipe"}, tmp_path / "c.parquet")
    result = cli.invoke(app, ["run", str(new), "--device", "cpu", "--bank", str(bank), "--bank-max-gb",
                              str(limit / 1e9)])
    assert result.exit_code == 0, (result.stderr, result.exception)
    assert "0 loaded, 2 prefilled, 2 saved, 2 evicted" in result.stderr
    again = cli.invoke(app, ["run", str(new), "--device", "cpu", "--bank", str(bank), "--log-json", "--overwrite"])
    done = json.loads(again.stdout.splitlines()[-1])  # the log's last line has the bank's figures too
    assert done["event"] == "done" and (done["bank"]["loaded"], done["bank"]["saved"]) == (2, 0), done
    files = entry_files(bank)
    assert sum(files.values()) <= limit
    assert set(files) == set(index(bank)["entries"])
    assert sorted(r["doc_ids"][0] for r in index(bank)["entries"].values()) == sorted(keep)
    verify_ok(bank, 3)


def test_dry_run_counts_the_documents_in_the_bank_as_loaded(tmp_path, src, bank, warm):
    _, garden = entry_of(bank, "garden")
    garden_tokens = index(bank)["entries"][garden.stem]["tokens"]
    garden.unlink()  # the bank holds 5 of the 6 documents
    before = {p: p.read_bytes() if p.is_file() else None for p in bank.rglob("*")}

    def plan(*args: str) -> dict:
        result = cli.invoke(app, ["run", str(src), "--device", "cpu", "--dry-run", "--log-json", *args])
        assert result.exit_code == 0, (result.stderr, result.exception)
        return json.loads(result.stdout)

    cold = plan()
    warm_plan = plan("--bank", str(bank), "--bank-max-gb", "1e-9")
    assert (cold["bank_hits"], cold["prefix_tokens"]) == (0, sum(r["tokens"] for r in index(warm[0])["entries"].values()))
    assert (warm_plan["bank_hits"], warm_plan["prefix_tokens"]) == (5, garden_tokens), warm_plan
    assert warm_plan["waves"] == cold["waves"]  # loaded documents take their bank slots too
    table = cli.invoke(app, ["run", str(src), "--device", "cpu", "--dry-run", "--bank", str(bank)]).stdout
    assert f"6 (5 loaded from the bank, {garden_tokens:,} tokens to prefill)" in table, table
    assert {p: p.read_bytes() if p.is_file() else None for p in bank.rglob("*")} == before  # nothing written, evicted
    result = run(src, bank, tmp_path / "out.parquet")  # the run does what the plan said
    assert (result.bank.loaded, result.stats.prefilled) == (5, 1)


# ---------------------------------------------------------------- bank-inspect

def test_inspect_table(bank, warm):
    result = cli.invoke(app, ["bank-inspect", str(bank), "--verify"])
    assert result.exit_code == 0, (result.stderr, result.exception)
    out = result.stdout
    fp = next(iter(index(bank)["models"]))
    for part in [f"bank {bank}", "format kevscore-bank v1", "6 entries", "free on disk", f"model {fp[:12]}",
                 "demo", "recurrent", "conv", "K/V", "last used", "total", "verify: 6 ok, 0 bad"]:
        assert part in out, (part, out)
    for key, rec in index(bank)["entries"].items():
        line = next(line for line in out.splitlines() if key[:12] in line)
        assert rec["doc_ids"][0] in line and f"{rec['tokens']:,}" in line and "ok" in line
    assert "unchecked" in cli.invoke(app, ["bank-inspect", str(bank)]).stdout


def test_inspect_json(bank, demo):
    result = cli.invoke(app, ["bank-inspect", str(bank), "--json", "--verify"])
    assert result.exit_code == 0, (result.stderr, result.exception)
    report = json.loads(result.stdout)
    cfg = demo.config
    nd, na = cfg.layer_types.count(LINEAR), cfg.layer_types.count(FULL)
    recurrent = nd * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv = nd * cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * 4
    per_token = na * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    files = entry_files(bank)
    assert len(report["entries"]) == 6 and report["bad_entries"] == [] and report["verified"] is True
    for e in report["entries"]:
        assert e["status"] == "ok" and e["indexed"] and len(e["doc_ids"]) == 1
        assert e["bytes"] == {"recurrent": recurrent, "conv": conv, "kv": e["tokens"] * per_token}
        assert e["file_bytes"] == files[e["key"]] > recurrent + conv + e["tokens"] * (per_token + 8)
    totals = report["totals"]
    assert totals["entries"] == 6 and totals["file_bytes"] == sum(files.values())
    assert totals["recurrent"] == 6 * recurrent and totals["kv"] == sum(e["tokens"] for e in report["entries"]) * per_token
    (fp, model), = report["models"].items()
    assert model["entries"] == 6 and model["about"]["name"] == "demo" and model["about"]["dtype"] == "float32"
    assert all(e["model"] == fp for e in report["entries"])
    assert report["disk"]["free_bytes"] > 0 and report["version"] == 1


def test_inspect_one_entry_and_errors(bank, tmp_path):
    key, path = entry_of(bank, "market")
    result = cli.invoke(app, ["bank-inspect", str(bank), "--entry", key[:10], "--verify", "--json"])
    assert result.exit_code == 0, (result.stderr, result.exception)
    one = json.loads(result.stdout)
    (entry,) = one["entries"]
    assert one["totals"]["entries"] == 6  # the bank's totals, not the entry's
    ids = torch.tensor(entry["ids_head"])
    assert entry["key"] == key and entry["status"] == "ok" and len(ids) == min(16, entry["tokens"])
    assert sorted(entry["crc32"]) == ["conv", "ids", "kv", "state"]
    table = cli.invoke(app, ["bank-inspect", str(bank), "--entry", key[:10]])
    assert table.exit_code == 0 and key in table.stdout and "market" in table.stdout
    for args, part in [(["--entry", "zzzz"], "no entry 'zzzz'"), (["--entry", ""], "ambiguous")]:
        bad = cli.invoke(app, ["bank-inspect", str(bank), *args])
        assert bad.exit_code == 2 and part in bad.stderr, bad.stderr
    missing = cli.invoke(app, ["bank-inspect", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "no such bank directory" in missing.stderr
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    verified = cli.invoke(app, ["bank-inspect", str(bank), "--verify", "--json"])
    assert verified.exit_code == 1
    report = json.loads(verified.stdout)
    assert report["bad_entries"] == [key]
    assert next(e for e in report["entries"] if e["key"] == key)["status"].startswith("corrupt: checksum mismatch")


# ---------------------------------------------------------------- killed and concurrent runs

def _spawn(src: Path, bank: Path, out: Path, hooks: Path, pause: str) -> subprocess.Popen:
    hooks.mkdir(parents=True, exist_ok=True)
    # one thread each: two of these may run at once, and tiny demo runs gain nothing from more
    env = dict(os.environ, KEVSCORE_TEST_MARKS=str(hooks), KEVSCORE_TEST_PAUSE=pause,
               OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "kevscore", "run", str(src), "--device", "cpu", "--bank",
                             str(bank), "-o", str(out), "--quiet"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for(marker: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before {marker.name}: {proc.stderr.read().decode()}")
        assert time.monotonic() < deadline, f"timed out waiting for {marker}"
        time.sleep(0.02)


@pytest.mark.parametrize("point", ["bank-entry-write", "bank-renamed", "bank-index-write"])
def test_run_killed_during_a_bank_write(tmp_path, src, rows, warm, point):
    bank, out = tmp_path / "bank", tmp_path / "out.parquet"
    proc = _spawn(src, bank, out, tmp_path / "hooks", point)
    try:
        _wait_for(tmp_path / "hooks" / point, proc)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL and not out.exists()
    complete = 0 if point == "bank-entry-write" else 6
    assert len(entry_files(bank)) == complete
    # a half-written temporary file (entry or index) stays in tmp/, never under entries/
    assert bool(list((bank / "tmp").rglob("*.tmp"))) == (point != "bank-renamed")
    assert index(bank)["entries"] == {}  # the killed run's entries never reached the index
    report = verify_ok(bank, complete)  # bank-inspect --verify accepts what the killed run left
    assert report["temporary"] and len(report["unindexed"]) == complete
    result = cli.invoke(app, ["bank-inspect", str(bank), "--verify"])
    assert result.exit_code == 0 and f"verify: {complete} ok, 0 bad" in result.stdout
    one = run(subset(rows, {"market"}, tmp_path / "one.parquet"), bank, tmp_path / "one.out.parquet")
    assert (one.bank.loaded, one.stats.prefilled, one.bank.warnings) == ((1, 0, []) if complete else (0, 1, []))
    assert list((bank / "tmp").iterdir()) == []  # the dead process's temporary files are gone
    assert len(index(bank)["entries"]) == max(complete, 1)  # complete entry files were adopted
    after = run(src, bank, out)
    assert (after.bank.loaded, after.stats.prefilled, after.bank.warnings) == ((6, 0, []) if complete else (1, 5, []))
    if complete:
        assert probs(out) == warm[1]  # entries written by the killed run, from the same cold prefill
    close(probs(out), warm[1])
    verify_ok(bank, 6)
    assert len(index(bank)["entries"]) == 6


def test_concurrent_runs_do_not_lose_or_corrupt_entries(tmp_path, rows, warm):
    """A commits while B waits on the lock: without the lock B would write an index without A's new
    entries (a lost update). Hooks make the interleaving deterministic."""
    bank = tmp_path / "bank"
    a_docs, b_docs = {"market", "train", "garden", "meeting"}, {"garden", "meeting", "trip", "recipe"}
    ha, hb = tmp_path / "hooks-a", tmp_path / "hooks-b"
    a = _spawn(subset(rows, a_docs, tmp_path / "a.parquet"), bank, tmp_path / "a.out.parquet", ha,
               "bank-before-commit,bank-commit-locked")
    try:
        _wait_for(ha / "bank-before-commit", a)  # A created the bank and prefilled; B opens it next
        b = _spawn(subset(rows, b_docs, tmp_path / "b.parquet"), bank, tmp_path / "b.out.parquet", hb,
                   "bank-before-commit")
        try:
            _wait_for(hb / "bank-before-commit", b)
            (ha / "bank-before-commit.go").touch()
            _wait_for(ha / "bank-commit-locked", a)  # A holds the lock with the index read, nothing written
            (hb / "bank-before-commit.go").touch()
            _wait_for(hb / "bank-lock-wait-commit", b)
            time.sleep(0.3)  # B is blocked in flock
            assert not (hb / "bank-commit-locked").exists()
            (ha / "bank-commit-locked.go").touch()
            assert a.wait(120) == 0, a.stderr.read().decode()
            assert b.wait(120) == 0, b.stderr.read().decode()
        finally:
            b.kill()
            b.wait()
    finally:
        a.kill()
        a.wait()
    entries = index(bank)["entries"]
    assert sorted(d for r in entries.values() for d in r["doc_ids"]) == sorted(a_docs | b_docs)
    assert set(entries) == set(entry_files(bank)) and len(entries) == 6
    verify_ok(bank, 6)
    for name in ("a", "b"):
        got = probs(tmp_path / f"{name}.out.parquet")
        close(got, {q: p for q, p in warm[1].items() if q in got})
    last = run(EXAMPLES / "questions.parquet", bank, tmp_path / "all.parquet")
    assert (last.bank.loaded, last.stats.prefilled) == (6, 0)
    close(probs(tmp_path / "all.parquet"), warm[1])


def test_in_memory_weights_digest_is_stable():
    """Bank entries are keyed by the model's fingerprint: the digest of in-memory weights (names, dtypes,
    shapes and sampled bytes; large tensors sampled) keeps the value every earlier version computed."""
    from types import SimpleNamespace

    import torch

    from kevscore.engine.bank_entry import weights_digest

    weights = {"b.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
               "a.big": (torch.arange(1 << 20 | 5) % 251).to(torch.bfloat16), "c.int": torch.arange(4)}
    digest = "mem:e99ec487c28af11d9e73bd55005b1fffbfe37e731c9a58f3b1b5a0014a3467cd"
    assert weights_digest(SimpleNamespace(path=None, weights=weights)) == digest
    weights["a.big"][-1] += 1  # the last element is always sampled
    assert weights_digest(SimpleNamespace(path=None, weights=weights)) != digest


# ---------------------------------------------------------------- a bank that cannot be written

def test_opening_an_unchanged_bank_writes_nothing(tmp_path, src, bank, warm, monkeypatch):
    # a full disk fails every index write made while opening: an unchanged bank makes none
    monkeypatch.setenv("KEVSCORE_TEST_ENOSPC", "bank-index-write-open")
    monkeypatch.setattr(faults, "_reached", Counter())
    result = cli.invoke(app, ["run", str(src), "--device", "cpu", "--bank", str(bank), "-o", str(tmp_path / "o.parquet")])
    assert result.exit_code == 0, (result.stderr, result.exception)
    assert "6 loaded, 0 prefilled, 0 saved" in result.stderr and "warning:" not in result.stderr, result.stderr
    assert probs(tmp_path / "o.parquet") == warm[1]


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_bank_that_cannot_be_written_is_used_read_only(tmp_path, src, bank, warm, monkeypatch, fault):
    import errno

    from kevscore.engine import bank_dir, bank_store

    if fault == "read-only":  # a read-only mount: the exclusive lock cannot even be opened for writing
        shared = bank_dir.bank_lock
        monkeypatch.setattr(bank_dir, "bank_lock", lambda root, exclusive, purpose: shared(root, False, purpose)
                            if not exclusive else (_ for _ in ()).throw(OSError(errno.EROFS, os.strerror(errno.EROFS))))
    else:  # a full disk: this process's temporary directory in the bank cannot be made
        mkdtemp = bank_store.tempfile.mkdtemp
        monkeypatch.setattr(bank_store.tempfile, "mkdtemp", lambda *a, **kw: mkdtemp(*a, **kw) if bank not in Path(
            kw.get("dir") or "/").parents else (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    _, garden = entry_of(bank, "garden")
    garden.unlink()  # one document to prefill: not saved
    before = {p: p.read_bytes() for p in bank.rglob("*") if p.is_file()}
    result = cli.invoke(app, ["run", str(src), "--device", "cpu", "--bank", str(bank), "--bank-max-gb", "1e-9",
                              "-o", str(tmp_path / "o.parquet")])
    assert result.exit_code == 0, (result.stderr, result.exception)
    warned = [line for line in result.stderr.splitlines() if "read-only" in line]
    assert len(warned) == 1 and warned[0].startswith("warning:"), result.stderr
    assert ("Read-only file system" if fault == "read-only" else "No space left on device") in warned[0]
    assert "5 loaded, 1 prefilled, 0 saved, 0 evicted" in result.stderr, result.stderr
    close(probs(tmp_path / "o.parquet"), warm[1])
    assert {p: p.read_bytes() for p in bank.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("window", ["1024", "1"])
def test_eviction_keeps_the_entries_this_run_loads(tmp_path, rows, warm, window):
    # a bank filled with A's documents, then B's; a run on A with a cap that holds A's entries only. With
    # --window 1, market's window commits first: train, the oldest entry, is kept for the window after it
    sizes = {rec["doc_ids"][0]: rec["file_bytes"] for rec in index(warm[0])["entries"].values()}
    bank, a = tmp_path / "bank", {"market", "train"}
    run(subset(rows, a, tmp_path / "a.parquet"), bank, tmp_path / "a.out.parquet")
    run(subset(rows, {"garden", "meeting"}, tmp_path / "b.parquet"), bank, tmp_path / "b.out.parquet")
    result = cli.invoke(app, ["run", str(tmp_path / "a.parquet"), "--device", "cpu", "--bank", str(bank),
                              "--bank-max-gb", str((sum(sizes[d] for d in a) + 100) / 1e9), "--overwrite",
                              "--window", window])
    assert result.exit_code == 0, (result.stderr, result.exception)
    assert "2 loaded, 0 prefilled, 0 saved, 2 evicted" in result.stderr, result.stderr
    assert sorted(r["doc_ids"][0] for r in index(bank)["entries"].values()) == sorted(a)
    verify_ok(bank, 2)
