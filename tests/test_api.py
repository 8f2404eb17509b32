"""The Python API (kevscore.Scorer) on CPU with the demo model: the same outputs and errors as `kevscore run`,
the model loaded once, bank entries reused across calls, and the README's example."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import kevscore
from kevscore.api import Scorer
from kevscore.cli import app
from kevscore.faults import Interrupted
from kevscore.job import run as job
from kevscore.model.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
QUESTIONS = EXAMPLES / "questions.parquet"
TWO = EXAMPLES / "two-file"
cli = CliRunner()


def kevscore_run(*args) -> CliRunner:
    return cli.invoke(app, ["run", *map(str, args), "--device", "cpu", "--quiet"])


def cli_output(out: Path, *args) -> pa.Table:
    """What `kevscore run ARGS -o OUT` writes."""
    result = kevscore_run(*args, "-o", out)
    assert result.exit_code == 0, result.stderr
    return pq.read_table(out)


def cli_error(*args) -> str:
    """The message of the one `error:` line a failing `kevscore run ARGS` prints."""
    result = kevscore_run(*args)
    assert result.exit_code == 2, result.stderr
    line, = result.stderr.strip().splitlines()
    return line.removeprefix("error: ")


@pytest.fixture(scope="module")
def scorer() -> Scorer:
    return Scorer("demo", device="cpu")


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> dict[str, pa.Table]:
    """`kevscore run`'s outputs of the one-file and the two-file example."""
    d = tmp_path_factory.mktemp("cli")
    return {"one": cli_output(d / "one.parquet", QUESTIONS),
            "two": cli_output(d / "two.parquet", TWO / "questions.parquet", "--documents", TWO / "documents.parquet")}


def same(got: pa.Table, want: pa.Table) -> None:
    """The same columns and values, probabilities bit for bit (the schema's metadata aside)."""
    assert got.schema.names == want.schema.names
    assert got.column("probs").to_pylist() == want.column("probs").to_pylist()
    assert got.equals(want)


def test_import_is_light_and_the_api_is_exported():
    code = ("import sys, kevscore; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert kevscore.Scorer.__module__ == 'kevscore.api' and 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
    assert kevscore.KevscoreError is job.KevscoreError and kevscore.RunResult is job.RunResult
    assert (ROOT / "kevscore" / "py.typed").is_file()
    with pytest.raises(AttributeError, match="no attribute 'Scorerr'"):
        kevscore.Scorerr  # noqa: B018


def test_score_a_table_a_path_and_record_batches(scorer, expected):
    table = pq.read_table(QUESTIONS)
    same(scorer.score(table), expected["one"])
    same(scorer.score(QUESTIONS), expected["one"])
    same(scorer.score(str(QUESTIONS)), expected["one"])
    same(scorer.score(table.to_batches()[0]), expected["one"])


def test_two_file_form_from_tables_and_paths(scorer, expected):
    questions, documents = TWO / "questions.parquet", TWO / "documents.parquet"
    same(scorer.score(pq.read_table(questions), pq.read_table(documents)), expected["two"])
    same(scorer.score(questions, documents), expected["two"])
    same(scorer.score(pq.read_table(questions), documents), expected["two"])


def test_score_a_data_frame(scorer, expected):
    pandas = pytest.importorskip("pandas")
    frame = pandas.read_parquet(QUESTIONS)
    assert isinstance(frame, pandas.DataFrame)
    same(scorer.score(frame).cast(expected["one"].schema), expected["one"])  # pandas 3: large_string columns


def test_columns_carry_and_limit(scorer, expected, tmp_path):
    renamed = pq.read_table(QUESTIONS).rename_columns(["doc", "qid", "text", "q"])
    got = scorer.score(renamed, columns={"doc_id": "doc", "question_id": "qid", "document": "text", "question": "q"})
    assert got.select(expected["one"].column_names[:-1]).equals(expected["one"].drop_columns(["question"]))
    assert got.column("q").equals(expected["one"].column("question"))
    bare = scorer.score(QUESTIONS, carry=False, limit=4)
    assert bare.column_names == expected["one"].column_names[:-1] and bare.num_rows == 4
    same(bare, cli_output(tmp_path / "bare.parquet", QUESTIONS, "--no-carry", "--limit", 4))


def test_score_file_is_kevscore_run(scorer, expected, tmp_path):
    out = tmp_path / "scores.parquet"
    result = scorer.score_file(QUESTIONS, out)
    assert result.output == out and result.stats.rows == 15
    cli_output(tmp_path / "cli.parquet", QUESTIONS)
    assert out.read_bytes() == (tmp_path / "cli.parquet").read_bytes()  # the very same file
    assert scorer.score_file(QUESTIONS, out).already_complete  # a rerun of the same job: nothing to do
    with pytest.raises(kevscore.KevscoreError, match="already exists .* pass --overwrite"):
        scorer.score_file(QUESTIONS, out, carry=False)  # another job onto it
    assert not scorer.score_file(QUESTIONS, out, carry=False, overwrite=True).already_complete
    default = tmp_path / "q.parquet"
    shutil.copy(QUESTIONS, default)
    scorer.score_file(default)
    same(pq.read_table(tmp_path / "q.scores.parquet"), expected["one"])


def test_score_file_resumes_like_run(tmp_path, monkeypatch):
    """Stopped after two of six windows, the same call resumes them and writes run's output, byte for byte;
    restart=True discards them."""
    cli_output(tmp_path / "cli.parquet", QUESTIONS, "--window", 1)
    scorer, out = Scorer(device="cpu"), tmp_path / "out.parquet"
    monkeypatch.setenv("KEVSCORE_TEST_SIGINT", "part-done:2")  # a Ctrl-C once the second part is written
    with pytest.raises(Interrupted, match="2 of 6 windows .* rerun the same command to resume"):
        scorer.score_file(QUESTIONS, out, window=1)
    monkeypatch.delenv("KEVSCORE_TEST_SIGINT")
    assert not out.exists()
    result = scorer.score_file(QUESTIONS, out, window=1)
    assert (result.resumed, result.windows, result.stats.rows) == (2, 6, 15)
    assert out.read_bytes() == (tmp_path / "cli.parquet").read_bytes()
    monkeypatch.setenv("KEVSCORE_TEST_SIGINT", "part-done:3")
    with pytest.raises(Interrupted):
        scorer.score_file(QUESTIONS, tmp_path / "again.parquet", window=1)
    monkeypatch.delenv("KEVSCORE_TEST_SIGINT")
    assert scorer.score_file(QUESTIONS, tmp_path / "again.parquet", window=1, restart=True).resumed == 0


@pytest.mark.parametrize("case", ["no question", "missing file", "null document", "bad labels", "bad window",
                                  "output is input"])
def test_bad_input_raises_the_cli_message(scorer, tmp_path, case):
    bad = tmp_path / "bad.parquet"
    table = pq.read_table(QUESTIONS)
    if case == "no question":
        pq.write_table(table.drop_columns(["question"]), bad)
    elif case == "null document":
        pq.write_table(table.set_column(2, "document", pa.array([None] + table.column(2).to_pylist()[1:])), bad)
    cli_args, call = {
        "no question": ([bad], lambda: scorer.score(bad)),
        "missing file": ([tmp_path / "nope.parquet"], lambda: scorer.score(tmp_path / "nope.parquet")),
        "null document": ([bad], lambda: scorer.score_file(bad, tmp_path / "out.parquet")),
        "bad labels": ([QUESTIONS, "--labels", "Yes"], lambda: Scorer(device="cpu", labels=["Yes"])),
        "bad window": ([QUESTIONS, "--window", 0], lambda: scorer.score(QUESTIONS, window=0)),
        "output is input": ([QUESTIONS, "-o", QUESTIONS], lambda: scorer.score_file(QUESTIONS, QUESTIONS)),
    }[case]
    with pytest.raises(kevscore.KevscoreError) as raised:
        call()
    assert str(raised.value) == cli_error(*cli_args)


def test_tables_are_named_in_messages(scorer):
    table = pq.read_table(QUESTIONS)
    with pytest.raises(kevscore.KevscoreError, match=r"^<questions>: missing required column\(s\) 'question'"):
        scorer.score(table.drop_columns(["question"]))
    with pytest.raises(kevscore.KevscoreError, match="^<questions>: column 'doc_id' has values with no document in "
                                                     "<documents>: 'market' at rows 0, 1, 2$"):
        scorer.score(pq.read_table(TWO / "questions.parquet"), pq.read_table(TWO / "documents.parquet").slice(1))
    with pytest.raises(kevscore.KevscoreError, match="a pyarrow Table, a pandas DataFrame or a path, not list"):
        scorer.score(table.to_pylist())
    with pytest.raises(kevscore.KevscoreError, match="'text' is not a column kevscore reads"):
        scorer.score(table, columns={"text": "question"})
    with pytest.raises(kevscore.KevscoreError, match="--device tpu: choose cpu, cuda or auto"):
        Scorer(device="tpu")


@pytest.mark.parametrize("make, words", [
    (lambda s, t: Scorer(labels=None), "labels None: give a list of strings"),
    (lambda s, t: Scorer(labels=[1, 2]), "labels [1, 2]: give a list of strings"),
    (lambda s, t: Scorer(batch_rows="8"), "--batch-rows '8': must be at least 1"),
    (lambda s, t: s.score(t, limit=2.5), "--limit 2.5: must be at least 1"),
    (lambda s, t: s.score(t, columns=["question"]), "columns ['question']: give a mapping")])
def test_arguments_of_the_wrong_type_are_the_apis_own_errors(scorer, make, words):
    """Not a TypeError from deep inside: the KevscoreError naming the argument and what it takes."""
    with pytest.raises(kevscore.KevscoreError, match=re.escape(words)):
        make(scorer, pq.read_table(QUESTIONS))


def test_the_model_loads_once(monkeypatch, expected):
    loads = []

    def counted(*args, **kwargs):
        loads.append(args)
        return load_checkpoint(*args, **kwargs)

    monkeypatch.setattr(job, "load_checkpoint", counted)
    scorer = Scorer(device="cpu")
    scorer.score(QUESTIONS, limit=2)  # one document: a bank of one entry
    small = scorer.loaded.runner
    first = scorer.score(QUESTIONS)
    runner = scorer.loaded.runner
    second = scorer.score(TWO / "questions.parquet", TWO / "documents.parquet")
    assert runner is not small  # too small for six documents: a new one
    assert scorer.loaded.runner is runner  # its bank holds the second input's documents too
    assert scorer.plan(QUESTIONS).documents == 6
    assert len(loads) == 1 and first.column("probs").equals(second.column("probs"))
    same(first, expected["one"])
    scorer.close()
    scorer.score(QUESTIONS, limit=1)
    assert len(loads) == 2


def test_a_fixed_bank_capacity_is_kept(expected):
    scorer = Scorer(device="cpu", bank_capacity=2)
    first = scorer.score(QUESTIONS)
    runner = scorer.loaded.runner
    assert runner.bank.layout.entries == 2 and scorer.last_result.stats.waves == 3
    assert scorer.score(QUESTIONS).equals(first) and scorer.loaded.runner is runner
    scorer.score(QUESTIONS, limit=1)  # two entries again, but a token pool for one document: a new runner
    assert scorer.loaded.runner is not runner and scorer.loaded.runner.bank.layout.entries == 2


def test_score_interrupted_keeps_nothing(scorer, monkeypatch):
    monkeypatch.setenv("KEVSCORE_TEST_SIGINT", "part-done:4")
    with pytest.raises(Interrupted, match="^interrupted; nothing was kept"):
        scorer.score(QUESTIONS, window=1)


def test_bank_entries_are_reused_across_calls(tmp_path, expected):
    scorer = Scorer(device="cpu", bank=tmp_path / "bank")
    same(scorer.score(QUESTIONS), expected["one"])
    first = scorer.last_result
    assert first.stats.prefilled == 6 and first.bank.saved == 6 and first.bank.loaded == 0
    same(scorer.score(pq.read_table(QUESTIONS)), expected["one"])
    second = scorer.last_result
    assert second.stats.prefilled == 0 and second.bank.loaded == 6  # no document read again


def test_the_cli_runs_through_a_scorer(tmp_path, monkeypatch):
    calls = []
    run = Scorer.run
    monkeypatch.setattr(Scorer, "run", lambda self, opts, progress=None: calls.append(opts) or run(self, opts, progress))
    cli_output(tmp_path / "out.parquet", QUESTIONS, "--batch-rows", 7)
    assert [(c.output, c.batch_rows) for c in calls] == [(tmp_path / "out.parquet", 7)]


def test_readme_example_runs(tmp_path, monkeypatch):
    """The README's "From Python" example, as written, in a copy of the examples."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## From Python", 1)[1].split("\n## ", 1)[0]
    code, = re.findall(r"```python\n(.*?)```", section, re.S)
    shutil.copytree(EXAMPLES, tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    assert pq.read_table(tmp_path / "demo-scores.parquet").num_rows == 200


def test_api_arguments_of_the_wrong_kind_are_one_line(tmp_path: Path) -> None:
    """A table where a path goes, labels as a set, a model, flag or bank of another type: a KevscoreError
    naming the argument, never the table's text or a raw TypeError."""
    from kevscore.errors import KevscoreError

    table = pq.read_table(QUESTIONS)
    scorer = Scorer(device="cpu")
    for call in (lambda: scorer.score_file(table, tmp_path / "o.parquet"), lambda: scorer.plan(table),
                 lambda: scorer.score_file(QUESTIONS, tmp_path / "o.parquet", documents=table)):
        with pytest.raises(KevscoreError, match=r"take a path \(str or os.PathLike\); use Scorer.score") as e:
            call()
        assert "\n" not in str(e.value) and len(str(e.value)) < 200
    for kwargs, said in (({"labels": {"Yes", "No"}}, "labels .*: give an ordered sequence"),
                         ({"model": None}, "model None: give"), ({"eager": "no"}, "eager 'no': give True or False"),
                         ({"bank": 123}, "bank 123: give a path")):
        with pytest.raises(KevscoreError, match=said):
            Scorer(**{"device": "cpu", **kwargs})
    with pytest.raises(KevscoreError, match="carry 'no': give True or False"):
        scorer.score_file(QUESTIONS, tmp_path / "o.parquet", carry="no")
