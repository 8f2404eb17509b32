"""Long jobs on the CPU with the demo model: windows, streaming reads, resumable parts (killed at every point
and resumed), refusals and --restart, Ctrl-C, out-of-memory splits, --skip-invalid, --log-json, and peak
host memory bounded by the window rather than the input."""
from __future__ import annotations

import fcntl
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_shard import shard_rows
from typer.testing import CliRunner

from kevscore import display, faults
from kevscore.cli import app
from kevscore.engine.pipeline import Reporter
from kevscore.engine.plan import plan_windows
from kevscore.errors import KevscoreError
from kevscore.faults import Interrupted
from kevscore.job.data import OUTPUT_SCHEMA, read_input
from kevscore.job.options import RunOptions
from kevscore.job.parts import ERRORS_SCHEMA, PartStore, errors_path, parts_dir
from kevscore.job.rows import RowReader
from kevscore.job.run import run_job
from kevscore.job.scan import scan_input

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
WORDS = "the a of and to in is was for on market river garden train city house water light night".split()
cli = CliRunner()


def make_input(path: Path, docs: int, per_doc: int, order: str = "grouped", seed: int = 0,
               row_group_size: int = 64, doc_ids: bool = True) -> Path:
    """Short documents and questions (few tokens: fast on the demo model), deterministic in seed."""
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(8)) + f" {d}." for d in range(docs)]
    owner = [i % docs for i in range(docs * per_doc)]
    if order == "grouped":
        owner.sort()
    elif order == "shuffled":
        rng.shuffle(owner)
    cols = {"question_id": [f"{rng.getrandbits(64):016x}-{i:07d}" for i in range(len(owner))],
            "document": [texts[d] for d in owner],
            "question": [f"Is it {rng.choice(WORDS)}?" for _ in owner]}
    if doc_ids:
        cols = {"doc_id": [f"doc-{d:05d}" for d in owner], **cols}
    pq.write_table(pa.table(cols), path, row_group_size=row_group_size)
    return path


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "t.txt"
    path.write_text("{document}\n{question}")  # the shortest prompt: fast runs
    return path


def opts(src: Path, out: Path, template: Path, **kw) -> RunOptions:
    return RunOptions(input=src, output=out, device="cpu", template=template, **{"window": 6, "batch_rows": 16, **kw})


def read(path: Path) -> pa.Table:
    table = pq.read_table(path)
    assert table.schema.equals(OUTPUT_SCHEMA), table.schema
    return table


def threads_env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", **extra)


def spawn(*args, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kevscore", "run", *map(str, args), "--device", "cpu", "--no-carry"],
                          env=threads_env(**env), cwd=ROOT, capture_output=True, text=True, timeout=600)


# ---------------------------------------------------------------- planning and reading

def test_windows_bound_documents_rows_and_tokens_and_split_big_documents():
    rng = np.random.default_rng(0)
    doc_of_row = rng.integers(-1, 40, size=2000).astype(np.int32)
    doc_of_row[rng.choice(2000, 300, replace=False)] = 7  # one document with many rows
    tokens = rng.integers(1, 50, size=40)
    w = plan_windows(doc_of_row, tokens, max_docs=5, max_rows=120, max_tokens=150)
    assert (w.of_row >= 0).sum() == (doc_of_row >= 0).sum() and ((w.of_row < 0) == (doc_of_row < 0)).all()
    assert w.rows.sum() == (doc_of_row >= 0).sum()
    for k in range(len(w)):
        rows = w.rows_of(k)
        assert list(rows) == sorted(rows) and len(rows) == w.rows[k] <= 120
        docs = np.unique(doc_of_row[rows])
        assert len(docs) == w.docs[k] <= 5 and w.tokens[k] == tokens[docs].sum()
        assert len(docs) == 1 or w.tokens[k] <= 150
    big = np.unique(w.of_row[doc_of_row == 7])
    assert len(big) == -(-(doc_of_row == 7).sum() // 120) and all(w.docs[big] == 1)
    order = [int(np.unique(doc_of_row[w.rows_of(k)]).min()) for k in range(len(w))]
    assert order == sorted(order)  # documents in order of first appearance (index order here)
    assert w.digest() == plan_windows(doc_of_row, tokens, 5, 120, 150).digest()
    assert w.digest() != plan_windows(doc_of_row, tokens, 1, 120, 150).digest()


@pytest.mark.parametrize("bound", ["docs", "rows", "tokens"])
def test_each_window_bound_is_reached_and_windows_are_full(bound):
    """Every window but the last is full: its next document would break a bound. Each bound in turn is the
    only tight one, so a planner that cut earlier (or ignored that bound) fails here."""
    rng = np.random.default_rng(1)
    docs = 60
    per_doc = rng.integers(1, 6, size=docs)
    doc_of_row = np.repeat(np.arange(docs, dtype=np.int32), per_doc)
    tokens = rng.integers(5, 40, size=docs)
    limits = {"docs": 1000, "rows": 10**6, "tokens": 10**9}
    limits[bound] = {"docs": 4, "rows": 11, "tokens": 97}[bound]
    w = plan_windows(doc_of_row, tokens, limits["docs"], limits["rows"], limits["tokens"])
    used = {"docs": w.docs, "rows": w.rows, "tokens": w.tokens}[bound]
    assert used.max() <= limits[bound] and len(w) > 5
    nxt = [int(doc_of_row[w.rows_of(k + 1)[0]]) for k in range(len(w) - 1)]
    add = {"docs": np.ones(docs, int), "rows": per_doc, "tokens": tokens}[bound]
    for k, d in enumerate(nxt):  # window k stopped because document d did not fit
        assert used[k] + add[d] > limits[bound], (k, used[k], add[d])


def test_job_windows_use_the_row_and_token_bounds(tmp_path, template, monkeypatch):
    """The job plans with WINDOW_ROWS and WINDOW_TOKENS (1 M tokens; lowered here to reach them)."""
    from kevscore.job import run as job

    src = make_input(tmp_path / "q.parquet", 6, 2)
    counts = {}
    for name, value in (("WINDOW_TOKENS", 1), ("WINDOW_ROWS", 3)):
        with monkeypatch.context() as m:
            m.setattr(job, name, value)
            counts[name] = run_job(opts(src, tmp_path / f"{name}.parquet", template, window=100)).windows
    assert counts == {"WINDOW_TOKENS": 6, "WINDOW_ROWS": 6}  # one document (2 rows) per window: 6, not 1
    assert job.WINDOW_TOKENS == 1 << 20 and job.WINDOW_ROWS == 65536


def test_a_rerun_reports_the_documents_the_run_did(tmp_path, template, monkeypatch):
    """A document with more rows than a window holds is split over windows, and is still one document: in the
    job's result and in a rerun's that finds the job complete."""
    from kevscore.job import run as job

    src, out = make_input(tmp_path / "q.parquet", 6, 2), tmp_path / "out.parquet"
    monkeypatch.setattr(job, "WINDOW_ROWS", 1)
    first, again = (run_job(opts(src, out, template, window=100)) for _ in range(2))
    assert again.already_complete and (first.windows, first.documents, again.documents) == (12, 6, 6)


@pytest.mark.parametrize("two_file", [False, True])
def test_reader_takes_any_rows_of_a_shuffled_file(tmp_path, two_file):
    src = make_input(tmp_path / "q.parquet", 30, 7, order="shuffled", row_group_size=16)
    documents = None
    if two_file:
        rows = pq.read_table(src).to_pylist()
        docs = {r["doc_id"]: r["document"] for r in rows}
        documents = tmp_path / "d.parquet"
        pq.write_table(pa.table({"doc_id": list(docs)[::-1], "document": list(docs.values())[::-1]}), documents,
                       row_group_size=8)
        pq.write_table(pa.table({k: [r[k] for r in rows] for k in ("doc_id", "question_id", "question")}), src,
                       row_group_size=16)
    whole = read_input(src, documents)
    scan = scan_input(src, documents)
    reader = RowReader(scan)
    rng = random.Random(1)
    for _ in range(12):  # forwards, backwards, across row groups, one row, none
        rows = np.asarray(sorted(rng.sample(range(210), rng.choice([0, 1, 5, 60]))), dtype=np.int64)
        got = reader.read(rows)
        assert got.rows == rows.tolist()
        for name in ("documents", "questions", "doc_ids", "question_ids", "labels"):
            want = getattr(whole, name)
            assert getattr(got, name) == (None if want is None else [want[r] for r in rows]), name


# ---------------------------------------------------------------- results

def test_windows_change_batches_only(tmp_path, template):
    """Windows of 2 documents against one window: with --batch-invariant bit for bit; batched, equal up to
    the last bits (other batch-mates), with the rows in input order either way."""
    src = make_input(tmp_path / "q.parquet", 12, 3, order="shuffled")
    outs = {}
    for name, window, invariant in [("one", 1000, True), ("many", 2, True), ("batched", 2, False)]:
        result = run_job(opts(src, tmp_path / f"{name}.parquet", template, window=window, batch_invariant=invariant))
        assert result.windows == (1 if window == 1000 else 6)
        outs[name] = read(tmp_path / f"{name}.parquet")
    assert outs["many"].equals(outs["one"])
    assert outs["one"].column("row").to_pylist() == list(range(36))
    assert outs["one"].column("question_id").equals(pq.read_table(src).column("question_id"))
    for a, b in zip(outs["batched"].column("probs").to_pylist(), outs["one"].column("probs").to_pylist()):
        assert a == pytest.approx(b, abs=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["batched.parquet", "many.parquet", "one.parquet",
                                                          "q.parquet"]  # parts merged and removed


def test_two_file_form_in_windows_equals_one_file(tmp_path, template):
    one = run_job(opts(EXAMPLES / "questions.parquet", tmp_path / "one.parquet", template, window=2))
    two = run_job(opts(EXAMPLES / "two-file" / "questions.parquet", tmp_path / "two.parquet", template, window=2,
                       documents=EXAMPLES / "two-file" / "documents.parquet"))
    assert one.windows == two.windows == 3
    a, b = read(tmp_path / "one.parquet"), read(tmp_path / "two.parquet")
    qid = {q: p for q, p in zip(a.column("question_id").to_pylist(), a.column("probs").to_pylist())}
    assert {q: p for q, p in zip(b.column("question_id").to_pylist(), b.column("probs").to_pylist())} == qid


def test_shard_in_windows_keeps_the_shard_assignment(tmp_path, template):
    """Without doc_id, documents are keyed by their text, exactly as kevscore.job.shard does."""
    src = make_input(tmp_path / "q.parquet", 9, 2, order="shuffled", doc_ids=False)
    table = read_input(src)
    rows = []
    for rank in range(3):
        run_job(opts(src, tmp_path / f"r{rank}.parquet", template, window=2, shard=(rank, 3)))
        got = read(tmp_path / f"r{rank}.parquet").column("row").to_pylist()
        assert got == shard_rows(table.documents, table.documents, table.questions, rank, 3)  # keyed by text
        rows += got
    assert sorted(rows) == list(range(len(table)))


def test_persistent_bank_in_windows(tmp_path, template):
    src = make_input(tmp_path / "q.parquet", 8, 2)
    first = run_job(opts(src, tmp_path / "a.parquet", template, window=3, bank=tmp_path / "bank"))
    second = run_job(opts(src, tmp_path / "b.parquet", template, window=3, bank=tmp_path / "bank"))
    assert (first.bank.saved, first.stats.prefilled, first.windows) == (8, 8, 3)
    assert (second.bank.loaded, second.stats.prefilled) == (8, 0)
    assert read(tmp_path / "a.parquet").equals(read(tmp_path / "b.parquet"))


# ---------------------------------------------------------------- killed and resumed

@pytest.fixture(scope="module")
def killable(tmp_path_factory, template):
    """An interleaved input of 4 windows (every window's rows spread over the file: the merge interleaves
    all parts) and its uninterrupted output."""
    d = tmp_path_factory.mktemp("killable")
    src = make_input(d / "q.parquet", 24, 5, order="interleaved", row_group_size=32)
    run_job(opts(src, d / "base.parquet", template))
    return src, d / "base.parquet"


# point, occurrence: windows have one prefill group and two batches each (30 rows, 16 per batch)
KILLS = {"prefill": ("prefill:3", 2), "score": ("score:5", 2), "part-write": ("part-write:2", 1),
         "part-done": ("part-done:2", 2), "merge": ("merge:1", 4), "merged": ("merged:1", 4)}


@pytest.mark.parametrize("point", list(KILLS))
def test_killed_run_resumes_to_the_uninterrupted_output(tmp_path, killable, template, point):
    src, base = killable
    hook, parts_done = KILLS[point]
    out = tmp_path / "out.parquet"
    res = spawn(src, "-o", out, "--template", template, "--window", 6, "--batch-rows", 16, "--quiet",
                KEVSCORE_TEST_KILL=hook)
    assert res.returncode == -signal.SIGKILL, res.stderr
    parts = parts_dir(out)
    assert out.exists() == (point == "merged")  # a killed run never leaves a partial output
    names = sorted(p.name for p in parts.iterdir())
    done = [n for n in names if n.startswith("part-")]
    # a window's part is written while the next window is scored: a kill there may find it still in flight
    racing = point in ("prefill", "score")
    assert len(done) in ({parts_done - 1, parts_done} if racing else {parts_done})
    assert done == [f"part-{w:06d}.parquet" for w in range(len(done))]
    if not racing:
        assert any(n.endswith(".tmp") for n in names) == (point in ("part-write", "merge"))
    result = run_job(opts(src, out, template))  # the same command again
    assert result.resumed == len(done) and result.stats.rows == 120
    assert out.read_bytes() == base.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.parquet"]  # parts and temporary files gone


def test_ctrl_c_stops_after_the_batch_and_resumes(tmp_path, killable, template):
    src, base = killable
    out = tmp_path / "out.parquet"
    res = spawn(src, "-o", out, "--template", template, "--window", 6, "--batch-rows", 16,
                KEVSCORE_TEST_SIGINT="score:3")
    assert res.returncode == 130, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: interrupted (SIGINT): 1 of 4 windows (30 rows) are kept in") and "resume" in last
    assert "stopping after the current batch" in res.stderr
    assert not out.exists() and (parts_dir(out) / "part-000000.parquet").exists()
    assert run_job(opts(src, out, template)).resumed == 1
    assert out.read_bytes() == base.read_bytes()


def test_interrupted_in_process_raises_interrupted(tmp_path, killable, template, monkeypatch):
    src, _ = killable
    monkeypatch.setenv("KEVSCORE_TEST_SIGINT", "part-done:1")
    with pytest.raises(Interrupted, match="1 of 4 windows"):
        run_job(opts(src, tmp_path / "out.parquet", template))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
    assert sorted(p.name for p in parts_dir(tmp_path / "out.parquet").iterdir())[-2:] == ["manifest.json",
                                                                                       "part-000000.parquet"]
    monkeypatch.setenv("KEVSCORE_TEST_SIGINT", "score:1")  # nothing complete: nothing left behind
    with pytest.raises(Interrupted, match="before any window was complete; nothing was written"):
        run_job(opts(src, tmp_path / "other.parquet", template))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.parquet.parts"]


def test_an_interrupt_once_the_output_is_complete_says_so(tmp_path, killable, template, monkeypatch):
    """Ctrl-C once the merge has renamed the output into place (its parts not yet removed), or while the command
    prints its summary: the output is whole, and the line says so (not "no output was written")."""
    src, base = killable
    out = tmp_path / "out.parquet"
    monkeypatch.setenv("KEVSCORE_TEST_SIGINT", "merged")
    with pytest.raises(KeyboardInterrupt) as stopped:  # an Interrupted, saying what is kept
        run_job(opts(src, out, template))
    assert str(stopped.value) == (f"interrupted after the output was complete: {out} is whole; {parts_dir(out)} is "
                                  "left over and can be deleted")
    assert out.read_bytes() == base.read_bytes()
    monkeypatch.delenv("KEVSCORE_TEST_SIGINT")

    def interrupted(result):
        raise KeyboardInterrupt

    monkeypatch.setattr(display, "summary_table", interrupted)
    small = make_input(tmp_path / "small.parquet", 2, 2)
    result = cli.invoke(app, ["run", str(small), "--device", "cpu", "--template", str(template), "-o",
                              str(tmp_path / "small.out.parquet")])
    assert result.exit_code == 130 and result.stderr.strip().splitlines()[-1] == (
        f"error: interrupted after the output was complete: {tmp_path / 'small.out.parquet'} is whole; there is "
        "nothing to rerun"), result.stderr


def test_resume_refuses_changed_options_or_input_and_restart_starts_over(tmp_path, killable, template):
    src0, base = killable
    src = tmp_path / "q.parquet"
    shutil.copy(src0, src)
    out = tmp_path / "out.parquet"
    res = spawn(src, "-o", out, "--template", template, "--window", 6, "--batch-rows", 16, "--quiet",
                KEVSCORE_TEST_KILL="part-done:1")
    assert res.returncode == -signal.SIGKILL
    for change, words in [({"batch_rows": 8}, ["--batch-rows 16 -> 8"]), ({"labels": ["No", "Yes"]}, ["--labels"]),
                          ({"window": 5}, ["--window 6 -> 5"])]:
        with pytest.raises(KevscoreError, match="--restart") as info:
            run_job(opts(src, out, template, **change))
        for w in [str(out), "1 completed part(s)", "another job", *words]:
            assert w in str(info.value)
    rows = pq.read_table(src).to_pylist()
    rows[7]["question"] = "Is it new?"
    pq.write_table(pa.Table.from_pylist(rows), src)
    with pytest.raises(KevscoreError, match="input q.parquet changed"):
        run_job(opts(src, out, template))
    result = cli.invoke(app, ["run", str(src), "-o", str(out), "--template", str(template), "--window", "6",
                              "--batch-rows", "16", "--device", "cpu", "--restart", "--no-carry"])
    assert result.exit_code == 0, result.stderr
    assert "discarding 1 completed part(s)" in result.stderr
    changed, before = read(out).column("probs").to_pylist(), read(base).column("probs").to_pylist()
    assert changed[7] != pytest.approx(before[7], abs=1e-6)
    for i, (a, b) in enumerate(zip(changed, before)):
        assert i == 7 or a == pytest.approx(b, abs=1e-6)
    assert not parts_dir(out).exists()


class Warnings(Reporter):
    def __init__(self):
        self.warnings: list[str] = []

    def warn(self, message: str) -> None:
        self.warnings.append(message)


def failed_at_the_merge(src: Path, out: Path, template: Path, monkeypatch) -> list[str]:
    """Run the job into a full disk at the merge: every window's part is kept. Returns the parts directory's files."""
    monkeypatch.setattr(faults, "_reached", Counter())
    monkeypatch.setenv("KEVSCORE_TEST_ENOSPC", "merge:1")
    with pytest.raises(KevscoreError, match="No space left on device"):
        run_job(opts(src, out, template))
    monkeypatch.delenv("KEVSCORE_TEST_ENOSPC")
    return sorted(p.name for p in parts_dir(out).iterdir())


def test_a_damaged_manifest_resumes_the_parts_that_name_this_job_or_is_refused(tmp_path, killable, template,
                                                                               monkeypatch):
    """Each part names its job: with a manifest that is not one kevscore writes, parts that are all this job's are
    resumed (with a warning); any other part stops the run on one line that says what to do, and --restart
    starts over."""
    src, base = killable
    out = tmp_path / "out.parquet"
    names = failed_at_the_merge(src, out, template, monkeypatch)
    manifest = parts_dir(out) / "manifest.json"
    (parts_dir(out) / "part-000009.parquet").write_bytes(b"not a part")
    for damage in ("{not json", '["a list"]', '{"format": "kevscore-parts", "version": 1, "identity": 5}',
                   '{"format": "kevscore-parts", "version": 1, "identity": {}, "merged": "x"}'):
        manifest.write_text(damage)
        with pytest.raises(KevscoreError) as info:
            run_job(opts(src, out, template))
        assert str(info.value) == (f"{manifest}: damaged (not a manifest kevscore writes), and 1 of the 5 part(s) "
                                   "beside it are not this job's; rerun with --restart to discard them, or choose "
                                   "another --output")
        assert sorted(p.name for p in parts_dir(out).iterdir()) == sorted(names + ["part-000009.parquet"])
    (parts_dir(out) / "part-000009.parquet").unlink()
    progress = Warnings()
    assert run_job(opts(src, out, template), progress).resumed == 4
    assert progress.warnings == [f"{manifest}: damaged; resuming the 4 part(s) that name this job"]
    assert out.read_bytes() == base.read_bytes() and not parts_dir(out).exists()
    for identity in (["a list"], "x", {"input": "x"}, {"options": [1], "model": "m"}):  # resumed, not AttributeError
        out.unlink()
        failed_at_the_merge(src, out, template, monkeypatch)
        manifest.write_text(json.dumps({"format": "kevscore-parts", "version": 1, "identity": identity}))
        progress = Warnings()
        assert run_job(opts(src, out, template), progress).resumed == 4, identity
        assert progress.warnings == [f"{manifest}: damaged; resuming the 4 part(s) that name this job"]
    out.unlink()
    failed_at_the_merge(src, out, template, monkeypatch)
    manifest.write_text("{not json")
    (parts_dir(out) / "part-000009.parquet").write_bytes(b"not a part")
    assert run_job(opts(src, out, template, restart=True)).resumed == 0
    assert out.read_bytes() == base.read_bytes() and not parts_dir(out).exists()


@pytest.mark.parametrize("when", ["scoring", "merge"])
def test_an_input_changed_during_the_run_stops_it_before_the_output(tmp_path, killable, template, monkeypatch, when):
    """The input replaced by another file while its windows are read, or rewritten in place before the merge reads its
    carried columns: one line, no output, the parts kept; with the input as it was, the rerun resumes to the
    uninterrupted output."""
    src0, base = killable
    src, out = tmp_path / "q.parquet", tmp_path / "out.parquet"
    shutil.copy(src0, src)
    table = pq.read_table(src)
    changed = table.set_column(table.schema.get_field_index("question"), "question",
                               pa.array(["Is it changed?"] * table.num_rows))
    method = {"scoring": "write", "merge": "merge"}[when]
    original = getattr(PartStore, method)

    def replace_then(store, *args, **kwargs):
        pq.write_table(changed, tmp_path / "new.parquet" if when == "scoring" else src, row_group_size=32)
        if when == "scoring":
            os.replace(tmp_path / "new.parquet", src)
        return original(store, *args, **kwargs)

    monkeypatch.setattr(PartStore, method, replace_then)
    with pytest.raises(KevscoreError, match=f"^{re.escape(str(src))}: changed while this run read it") as info:
        run_job(opts(src, out, template, carry=True))
    assert info.value.exit_code == 1 and not out.exists() and len(list(parts_dir(out).glob("part-*"))) >= 1
    monkeypatch.undo()
    shutil.copy(src0, src)
    assert run_job(opts(src, out, template, carry=True)).resumed >= 1
    assert pq.read_table(out).select(OUTPUT_SCHEMA.names).equals(read(base))


def test_leftovers_with_nothing_completed_are_replaced_silently(tmp_path, killable, template):
    src, _ = killable
    out = tmp_path / "out.parquet"
    res = spawn(src, "-o", out, "--template", template, "--window", 6, "--batch-rows", 16, "--quiet",
                KEVSCORE_TEST_KILL="score:1")
    assert res.returncode == -signal.SIGKILL and (parts_dir(out) / "manifest.json").exists()
    assert run_job(opts(src, out, template, batch_rows=8)).resumed == 0  # another job, nothing to lose


def test_a_second_run_on_the_same_output_is_refused(tmp_path, killable, template):
    src, _ = killable
    out = tmp_path / "out.parquet"
    parts_dir(out).mkdir()
    fd = os.open(parts_dir(out) / "lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(KevscoreError, match="another kevscore run is writing this output"):
            run_job(opts(src, out, template))
    finally:
        os.close(fd)
    assert not out.exists()


def test_a_failed_run_with_nothing_completed_leaves_nothing(tmp_path, killable, template, monkeypatch):
    src, _ = killable
    monkeypatch.setenv("KEVSCORE_TEST_OOM_ROWS", "0")  # every row fails on its own
    with pytest.raises(KevscoreError, match="out of memory scoring this row alone"):
        run_job(opts(src, tmp_path / "out.parquet", template))
    assert list(tmp_path.iterdir()) == []


def slowed(method, seconds: float):
    def slow(self, *args):
        time.sleep(seconds)
        return method(self, *args)
    return slow


def test_a_slow_reader_or_writer_does_not_change_the_output(tmp_path, killable, template, monkeypatch):
    """Windows are read on one thread and their parts written on another while the next is scored: slowing
    either down changes the timing only."""
    src, base = killable
    monkeypatch.setattr(RowReader, "read", slowed(RowReader.read, 0.3))
    run_job(opts(src, tmp_path / "slow-read.parquet", template))
    monkeypatch.undo()
    monkeypatch.setattr(PartStore, "write", slowed(PartStore.write, 0.3))
    result = run_job(opts(src, tmp_path / "slow-write.parquet", template))
    assert result.windows == 4 and result.stats.write_s >= 4 * 0.3
    for name in ("slow-read", "slow-write"):
        assert read(tmp_path / f"{name}.parquet").equals(read(base)), name


@pytest.mark.parametrize("thread", ["reader", "writer"])
def test_a_failure_on_the_reader_or_writer_thread_ends_the_run_and_keeps_the_parts(tmp_path, killable, template,
                                                                                   monkeypatch, thread):
    """The third window's read (or write) fails: the run ends with that error, the parts written before it
    stay, and the next run resumes from them to the uninterrupted output."""
    src, base = killable
    cls, name = (RowReader, "read") if thread == "reader" else (PartStore, "write")
    real, calls = getattr(cls, name), []

    def failing(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(f"{thread}: disk gone")
        return real(self, *args)

    monkeypatch.setattr(cls, name, failing)
    out = tmp_path / "out.parquet"
    with pytest.raises(OSError, match=f"{thread}: disk gone"):
        run_job(opts(src, out, template))
    assert not out.exists()
    assert len(list(parts_dir(out).glob("part-*.parquet"))) == 2
    monkeypatch.undo()
    result = run_job(opts(src, out, template))
    assert result.resumed == 2 and read(out).equals(read(base))


# ---------------------------------------------------------------- faults

def test_out_of_memory_batches_are_split_and_retried(tmp_path, killable, template, monkeypatch):
    src, base = killable
    warnings = []
    monkeypatch.setenv("KEVSCORE_TEST_OOM_ROWS", "5")
    monkeypatch.setenv("KEVSCORE_TEST_OOM_DOCS", "2")

    class Collect(Reporter):
        def warn(self, message):
            warnings.append(message)

    result = run_job(opts(src, tmp_path / "out.parquet", template), Collect())
    out, ref = read(tmp_path / "out.parquet"), read(base)
    assert result.stats.oom_retries == len(warnings) > 0
    assert any("out of memory scoring a batch of 16 rows" in w and "retrying as 8 + 8" in w for w in warnings)
    assert any("out of memory prefilling" in w for w in warnings)
    assert result.stats.batches > 8  # more, smaller batches than the 8 planned
    for name in ("row", "doc_id", "question_id", "labels", "prediction"):
        assert out.column(name).equals(ref.column(name))
    for a, b in zip(out.column("probs").to_pylist(), ref.column("probs").to_pylist()):
        assert a == pytest.approx(b, abs=1e-6)


def test_rows_failing_alone_are_reported_with_skip_invalid(tmp_path, template, monkeypatch):
    src = make_input(tmp_path / "q.parquet", 4, 3)
    monkeypatch.setenv("KEVSCORE_TEST_OOM_ROWS", "0")
    result = run_job(opts(src, tmp_path / "out.parquet", template, skip_invalid=True))
    assert read(tmp_path / "out.parquet").num_rows == 0 and result.set_aside == 12
    errors = pq.read_table(errors_path(tmp_path / "out.parquet"))
    assert errors.schema.equals(ERRORS_SCHEMA) and errors.column("row").to_pylist() == list(range(12))
    assert all("out of memory scoring this row alone" in r for r in errors.column("reason").to_pylist())


def test_skip_invalid_sets_rows_aside_into_the_errors_file(tmp_path, template):
    rows = pq.read_table(EXAMPLES / "questions.parquet").to_pylist()
    rows[2]["document"] = "The market was busy and loud. " * 800  # over the demo model's 4096 positions
    rows[2]["doc_id"] = "long"
    rows[5]["question"] = None
    labels = [["Yes", "No"]] * len(rows)
    labels[9], labels[11] = ["Yes", ""], ["Yes", "Yes"]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows).append_column("labels", pa.array(labels)), src)
    out = tmp_path / "out.parquet"
    with pytest.raises(KevscoreError, match="column 'question' has nulls at row 5"):
        run_job(opts(src, out, template))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet"]
    result = run_job(opts(src, out, template, skip_invalid=True))
    scored = read(out)
    assert scored.column("row").to_pylist() == [r for r in range(len(rows)) if r not in (2, 5, 9, 11)]
    assert result.set_aside == 4 and result.errors == errors_path(out) == tmp_path / "out.errors.parquet"
    errors = pq.read_table(result.errors).to_pylist()
    assert [e["row"] for e in errors] == [2, 5, 9, 11]
    assert [e["question_id"] for e in errors] == [rows[i]["question_id"] for i in (2, 5, 9, 11)]
    assert errors[0]["doc_id"] == "long"
    for e, words in zip(errors, [["longer than the model's 4096 positions", "tokens"], ["'question' is null"],
                                 ["label ''", "no tokens"], ["repeated label"]]):
        for w in words:
            assert w in e["reason"], (w, e)
    (tmp_path / "other.errors.parquet").write_bytes(b"x")
    with pytest.raises(KevscoreError, match="other.errors.parquet: already exists"):
        run_job(opts(src, tmp_path / "other.parquet", template, skip_invalid=True))


def test_a_removed_errors_file_is_named_as_such(tmp_path, template):
    """The errors file of a complete --skip-invalid output removed between runs, or after a run was killed with
    its output in place (the rerun only cleans up): the rerun names it and what to do, not "another job's output";
    --overwrite then scores the job again and writes both."""
    src = make_input(tmp_path / "q.parquet", 4, 3)
    out = tmp_path / "out.parquet"
    removed = re.escape(f"{out}: complete (this job's output), but its errors file {errors_path(out)} (the rows "
                        "--skip-invalid set aside) was removed; pass --overwrite to score the job again and write both")
    run_job(opts(src, out, template, skip_invalid=True))
    errors_path(out).unlink()
    with pytest.raises(KevscoreError, match=removed):
        run_job(opts(src, out, template, skip_invalid=True))
    out.unlink()
    killed = spawn(src, "-o", out, "--template", template, "--window", 6, "--batch-rows", 16, "--skip-invalid",
                   "--quiet", KEVSCORE_TEST_KILL="merged")
    assert killed.returncode == -signal.SIGKILL and errors_path(out).is_file() and parts_dir(out).is_dir()
    errors_path(out).unlink()
    with pytest.raises(KevscoreError, match=removed):
        run_job(opts(src, out, template, skip_invalid=True))
    assert run_job(opts(src, out, template, skip_invalid=True, overwrite=True)).set_aside == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.errors.parquet", "out.parquet", "q.parquet"]


# ---------------------------------------------------------------- the command line

def test_log_json_lines(tmp_path, template):
    src = make_input(tmp_path / "q.parquet", 6, 2)
    result = cli.invoke(app, ["run", str(src), "--device", "cpu", "--template", str(template), "--window", "2",
                              "--log-json"])
    assert result.exit_code == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    names = [e["event"] for e in events]
    assert names[0] == "start" and names[-2:] == ["merged", "done"]
    assert names.count("window") == names.count("part") == 3 and "wave" in names
    part = next(e for e in events if e["event"] == "part")
    # parts are written while the next window is scored: rows_done counts the rows scored by then
    assert part["rows"] == 4 and part["rows_total"] == 12 and 4 <= part["rows_done"] <= 12 and "eta_s" in part
    wave = next(e for e in events if e["event"] == "wave")
    assert wave["entries"] == 2 and wave["entry_capacity"] >= 2
    done = events[-1]
    assert done["rows"] == 12 and done["windows"] == 3 and done["peak_rss_bytes"] > 100e6
    assert done["peak_gpu_bytes"] is None and done["rows_per_s"] > 0
    assert all("time" in e for e in events)
    bad = cli.invoke(app, ["run", str(tmp_path / "nope.parquet"), "--device", "cpu", "--log-json"])
    assert bad.exit_code == 2 and json.loads(bad.stdout)["event"] == "error"


def test_summary_and_progress_show_long_job_numbers(tmp_path, template):
    src = make_input(tmp_path / "q.parquet", 6, 2)
    result = cli.invoke(app, ["run", str(src), "--device", "cpu", "--template", str(template), "--window", "2"])
    assert result.exit_code == 0, result.stderr
    for words in ("windows", "rows/s", "peak host memory", "wall time", "score", "prefill", "bank"):
        assert words in result.stderr, words


# ---------------------------------------------------------------- memory

def peak_rss(src: Path, out: Path, template: Path, window: int) -> tuple[int, dict]:
    """Peak RSS of a `kevscore run` (the kernel's count for the child), and its --log-json summary."""
    proc = subprocess.Popen([sys.executable, "-m", "kevscore", "run", str(src), "--device", "cpu", "-o", str(out),
                             "--template", str(template), "--window", str(window), "--log-json"],
                            env=threads_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0
    done = json.loads(stdout.decode().splitlines()[-1])
    return usage.ru_maxrss * 1024, done


def test_peak_memory_is_bounded_by_the_window_not_the_input(tmp_path, template):
    """600 rows (19 windows of 8 documents) and 2,400 rows (75 windows): the same peak, give or take
    allocator noise (measured: +5 MB). Holding the input instead (one window: a bank for all its
    documents, all its rows and results) costs 400 MB more at 2,400 rows than windows do."""
    small = make_input(tmp_path / "small.parquet", 150, 4, row_group_size=512)
    large = make_input(tmp_path / "large.parquet", 600, 4, row_group_size=512)
    rss_small, done_small = peak_rss(small, tmp_path / "small.out.parquet", template, 8)
    rss_large, done_large = peak_rss(large, tmp_path / "large.out.parquet", template, 8)
    assert (done_small["windows"], done_large["windows"]) == (19, 75)
    assert done_large["rows"] == 4 * done_small["rows"] == 2400
    assert abs(done_large["peak_rss_bytes"] - rss_large) < 16e6  # the run's own report agrees with the kernel's
    assert rss_large - rss_small < 25e6, (rss_small / 1e6, rss_large / 1e6)
