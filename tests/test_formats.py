"""Users' own data as it is: input columns carried through, CSV and JSON Lines in and out, directories and
globs of Parquet files, `-o -`, column names of their own, --limit and --dry-run; all through the CLI."""
from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kevscore.cli import app
from kevscore.job.data import OUTPUT_SCHEMA

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
THEIRS = {"doc_id": "id", "question_id": "qid", "document": "text", "question": "ask"}


def kevscore(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def run_ok(*args):
    result = kevscore("run", *args, "--device", "cpu", "--quiet")
    assert result.exit_code == 0, (result.stderr, result.exception)
    return result


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.fixture(scope="module")
def source() -> pa.Table:
    """The examples with a column of the user's own."""
    table = pq.read_table(EXAMPLES / "questions.parquet")
    return table.append_column("expected", pa.array(["Yes" if i % 2 else "No" for i in range(table.num_rows)]))


@pytest.fixture(scope="module")
def base(tmp_path_factory, source: pa.Table) -> pa.Table:
    d = tmp_path_factory.mktemp("base")
    pq.write_table(source, d / "q.parquet")
    run_ok(d / "q.parquet")
    return pq.read_table(d / "q.scores.parquet")


def test_input_columns_are_carried_by_default(base: pa.Table, source: pa.Table) -> None:
    assert base.schema.names == OUTPUT_SCHEMA.names + ["question", "expected"]  # not the document text
    assert base.column("expected").equals(source.column("expected"))
    assert base.column("question").equals(source.column("question"))


def test_no_carry_writes_the_scoring_columns(tmp_path: Path, source: pa.Table, base: pa.Table) -> None:
    pq.write_table(source, tmp_path / "q.parquet")
    run_ok(tmp_path / "q.parquet", "--no-carry")
    out = pq.read_table(tmp_path / "q.scores.parquet")
    assert out.schema.equals(OUTPUT_SCHEMA) and out.equals(base.select(OUTPUT_SCHEMA.names))


def test_csv_with_own_column_names_in_and_out(tmp_path: Path, source: pa.Table, base: pa.Table) -> None:
    pacsv.write_csv(source.rename_columns([THEIRS.get(n, n) for n in source.column_names]), tmp_path / "q.csv")
    run_ok(tmp_path / "q.csv", "-o", tmp_path / "out.csv", "--question-column", "ask", "--document-column", "text",
           "--doc-id-column", "id", "--question-id-column", "qid")
    out = pacsv.read_csv(tmp_path / "out.csv")
    assert out.column_names == OUTPUT_SCHEMA.names + ["ask", "expected"]  # carried under the user's names
    assert [json.loads(p) for p in out.column("probs").to_pylist()] == base.column("probs").to_pylist()
    assert [json.loads(v) for v in out.column("labels").to_pylist()] == base.column("labels").to_pylist()
    assert out.column("doc_id").to_pylist() == base.column("doc_id").to_pylist()


def test_errors_name_the_file_and_columns_as_given(tmp_path: Path, source: pa.Table) -> None:
    rows = source.to_pylist()
    rows[2]["question"] = None
    pq.write_table(pa.Table.from_pylist(rows).rename_columns(
        [THEIRS.get(n, n) for n in source.column_names]), tmp_path / "q.parquet")
    result = kevscore("run", tmp_path / "q.parquet", "--device", "cpu", "--question-column", "ask",
                      "--document-column", "text")
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert line.startswith(f"error: {tmp_path / 'q.parquet'}: column 'ask' has nulls at row 2"), line
    assert "staged" not in line and listing(tmp_path) == ["q.parquet"]


def test_jsonl_in_and_stdout_out(tmp_path: Path, source: pa.Table, base: pa.Table) -> None:
    with open(tmp_path / "q.jsonl", "w") as f:
        for row in source.to_pylist():
            f.write(json.dumps(row) + "\n")
    result = run_ok(tmp_path / "q.jsonl", "-o", "-")
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert rows == base.to_pylist()
    assert listing(tmp_path) == ["q.jsonl"]


def test_jsonl_output_file(tmp_path: Path, source: pa.Table, base: pa.Table) -> None:
    pq.write_table(source, tmp_path / "q.parquet")
    run_ok(tmp_path / "q.parquet", "-o", tmp_path / "out.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert rows == base.to_pylist()


def test_directory_and_glob_of_parquet_files(tmp_path: Path, source: pa.Table, base: pa.Table) -> None:
    (tmp_path / "parts").mkdir()
    pq.write_table(source.slice(0, 6), tmp_path / "parts" / "a.parquet")
    pq.write_table(source.slice(6), tmp_path / "parts" / "b.parquet")
    run_ok(tmp_path / "parts", "-o", tmp_path / "dir.parquet")
    run_ok(str(tmp_path / "parts" / "*.parquet"), "-o", tmp_path / "glob.parquet")
    for name in ("dir", "glob"):
        out = pq.read_table(tmp_path / f"{name}.parquet")
        assert out.select(["row", "question_id", "prediction"]).equals(base.select(["row", "question_id",
                                                                                    "prediction"]))
    assert "needs -o" in kevscore("run", str(tmp_path / "parts" / "*.parquet"), "--device", "cpu").stderr


def test_two_file_input_given_alone_suggests_documents(tmp_path: Path) -> None:
    result = kevscore("run", EXAMPLES / "two-file" / "questions.parquet", "--device", "cpu")
    assert result.exit_code == 2 and "--documents FILE" in result.stderr, result.stderr


def test_limit_scores_the_first_rows(tmp_path: Path, source: pa.Table) -> None:
    rows = source.to_pylist()
    rows[9]["question"] = None  # beyond the limit: not checked
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "q.parquet")
    run_ok(tmp_path / "q.parquet", "--limit", "4")
    out = pq.read_table(tmp_path / "q.scores.parquet")
    assert out.column("row").to_pylist() == [0, 1, 2, 3]
    assert kevscore("run", tmp_path / "q.parquet", "--device", "cpu", "--limit", "0").exit_code == 2


def test_a_changed_limit_does_not_resume(tmp_path: Path) -> None:
    src = Path(shutil.copy(EXAMPLES / "questions.parquet", tmp_path / "q.parquet"))
    out = tmp_path / "out.parquet"
    killed = subprocess.run([sys.executable, "-m", "kevscore", "run", str(src), "-o", str(out), "--device", "cpu",
                             "--window", "1", "--limit", "8", "--quiet"], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", KEVSCORE_TEST_KILL="part-done:1"), timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    result = kevscore("run", src, "-o", out, "--device", "cpu", "--window", "1", "--limit", "9")
    assert result.exit_code == 2 and "--limit 8 -> 9" in result.stderr, result.stderr
    resumed = kevscore("run", src, "-o", out, "--device", "cpu", "--window", "1", "--limit", "8")
    assert resumed.exit_code == 0 and pq.read_table(out).num_rows == 8, resumed.stderr


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path: Path) -> None:
    src = Path(shutil.copy(EXAMPLES / "questions.parquet", tmp_path / "q.parquet"))
    result = kevscore("run", src, "--device", "cpu", "--dry-run", "--window", "2")
    assert result.exit_code == 0, result.stderr
    for words in ("rows", "15", "documents", "windows", "wave", "tokens to prefill", "calibration", "estimate",
                  "assumes"):
        assert words in result.stdout, words
    plan = json.loads(kevscore("run", src, "--device", "cpu", "--dry-run", "--log-json").stdout)
    assert plan["event"] == "plan" and plan["rows"] == 15 and plan["windows"] == 1 and plan["estimate_s"] > 0
    assert plan["prefix_tokens"] > 0 and plan["waves"] >= 1 and plan["calibration_rows"] > 0
    assert listing(tmp_path) == ["q.parquet"]


def test_dry_run_checks_the_whole_input(tmp_path: Path, source: pa.Table) -> None:
    rows = source.to_pylist()
    rows[14]["question"] = None
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "q.parquet")
    result = kevscore("run", tmp_path / "q.parquet", "--device", "cpu", "--dry-run")
    assert result.exit_code == 2 and "row 14" in result.stderr


def test_json_extension_and_stdout_with_log_json_are_refused(tmp_path: Path) -> None:
    src = EXAMPLES / "questions.parquet"
    assert ".jsonl" in kevscore("run", src, "--device", "cpu", "-o", tmp_path / "o.json").stderr
    both = kevscore("run", src, "--device", "cpu", "-o", "-", "--log-json")
    assert both.exit_code == 2 and "choose one" in both.stderr


def test_uri_inputs_through_pyarrow_filesystems(tmp_path: Path, source: pa.Table, base: pa.Table) -> None:
    pq.write_table(source, tmp_path / "q.parquet")
    uri = (tmp_path / "q.parquet").as_uri()
    run_ok(uri, "-o", tmp_path / "out.parquet")
    assert pq.read_table(tmp_path / "out.parquet").select(["row", "prediction"]).equals(
        base.select(["row", "prediction"]))
    assert "needs -o" in kevscore("run", uri, "--device", "cpu").stderr
    bad = kevscore("run", "nosuchfs://bucket/q.parquet", "--device", "cpu", "-o", tmp_path / "x.parquet")
    assert bad.exit_code == 2 and "error: nosuchfs://bucket/q.parquet: cannot open" in bad.stderr, bad.stderr


def test_clashing_input_columns_are_not_carried(tmp_path: Path, source: pa.Table) -> None:
    pq.write_table(source.append_column("prediction", pa.array(["mine"] * source.num_rows)), tmp_path / "q.parquet")
    result = kevscore("run", tmp_path / "q.parquet", "--device", "cpu")
    assert result.exit_code == 0 and "column 'prediction' is not copied" in result.stderr, result.stderr
    out = pq.read_table(tmp_path / "q.scores.parquet")
    assert out.column_names.count("prediction") == 1 and "mine" not in out.column("prediction").to_pylist()


def test_csv_labels_column_holds_json_arrays(tmp_path: Path, source: pa.Table) -> None:
    labels = [json.dumps(["No", "Yes"] if i % 2 else ["Yes", "No"]) for i in range(source.num_rows)]
    pacsv.write_csv(source.append_column("labels", pa.array(labels)), tmp_path / "q.csv")
    run_ok(tmp_path / "q.csv", "-o", tmp_path / "out.parquet")
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.column("labels").to_pylist() == [json.loads(v) for v in labels]


@pytest.mark.parametrize("bad", ["not json", "5", '["Yes", 3]'])
def test_csv_labels_that_are_no_json_array_name_their_rows_or_are_set_aside(tmp_path: Path, source: pa.Table,
                                                                           bad: str) -> None:
    labels = [json.dumps(["Yes", "No"])] * source.num_rows
    labels[2] = labels[7] = bad
    pacsv.write_csv(source.append_column("labels", pa.array(labels)), tmp_path / "q.csv")
    result = kevscore("run", tmp_path / "q.csv", "-o", tmp_path / "out.parquet", "--device", "cpu")
    line = result.stderr.strip()
    assert result.exit_code == 2 and line == (f"error: {tmp_path / 'q.csv'}: column 'labels' (string) has text that "
                                              "is no JSON array of strings at rows 2, 7"), line
    assert listing(tmp_path) == ["q.csv"]
    run_ok(tmp_path / "q.csv", "-o", tmp_path / "out.parquet", "--skip-invalid")
    errors = pq.read_table(tmp_path / "out.errors.parquet").to_pylist()
    assert [(e["row"], e["reason"]) for e in errors] == [(r, "column 'labels' has text that is no JSON array of "
                                                             "strings") for r in (2, 7)]
    assert 2 not in pq.read_table(tmp_path / "out.parquet").column("row").to_pylist()


@pytest.mark.parametrize("name, text, error, detail", [
    ("q.csv", 'document,question\n"unterminated,x\n', "not readable as CSV (CSV parse error: ", "Expected 2 columns"),
    ("q.jsonl", '{"document": "d", "question": \n', "not readable as JSON Lines (JSON parse error: ", "Invalid value")])
def test_an_unparsable_file_is_one_line_naming_the_parsers_error(tmp_path: Path, name: str, text: str, error: str,
                                                                 detail: str) -> None:
    """A file its format's parser refuses: one line with the file and the parser's own words (no wrapper's)."""
    (tmp_path / name).write_text(text)
    result = kevscore("run", tmp_path / name, "-o", tmp_path / "out.parquet")
    line = result.stderr.strip()
    assert result.exit_code == 2 and line.startswith(f"error: {tmp_path / name}: {error}") and detail in line, line
    assert len(line.splitlines()) == 1 and listing(tmp_path) == [name]


def test_several_gpus_write_parquet_only(tmp_path: Path) -> None:
    result = kevscore("run", EXAMPLES / "questions.parquet", "--gpus", "2", "-o", tmp_path / "out.csv")
    assert result.exit_code == 2 and "give -o a .parquet name" in result.stderr, result.stderr
    none = kevscore("run", EXAMPLES / "questions.parquet", "--gpus", "0", "-o", tmp_path / "out.parquet")
    assert none.exit_code == 2 and "--gpus 0: must be at least 1" in none.stderr, none.stderr
    assert listing(tmp_path) == []


def test_stdout_reader_that_stops_early_is_not_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kevscore.job.files import to_stdout

    (tmp_path / "big.jsonl").write_bytes(b"{}\n" * 200_000)  # more than a pipe holds
    read, write = os.pipe()
    os.close(read)  # `| head` has gone
    with open(write, "w") as pipe:
        monkeypatch.setattr(sys, "stdout", pipe)
        to_stdout(tmp_path / "big.jsonl")  # no BrokenPipeError
        pipe.write("more")  # and later writes go nowhere, quietly


# ---------------------------------------------------------------- what users' files hold, as they hold it

def test_csv_columns_are_carried_as_written(tmp_path: Path) -> None:
    """CSV has no types: a carried cell comes out as its text (leading zeros, 'NA', a 23-digit id), not a guess."""
    (tmp_path / "q.csv").write_text("document,question,zip,flag,note,big\n"
                                    "The eggs cost 49 pounds.,Is it?,00123,True,NA,12345678901234567890123\n")
    run_ok(tmp_path / "q.csv", "-o", tmp_path / "out.parquet")
    out = pq.read_table(tmp_path / "out.parquet").select(["zip", "flag", "note", "big"])
    assert out.to_pylist() == [{"zip": "00123", "flag": "True", "note": "NA", "big": "12345678901234567890123"}]


def test_parquet_with_integer_ids_or_json_labels_is_read_as_any_option_reads_it(tmp_path: Path, source: pa.Table,
                                                                                 base: pa.Table) -> None:
    """pandas writes integer ids; a labels column may hold JSON text: the same file scores with and without --limit."""
    ids = {d: i for i, d in enumerate(dict.fromkeys(source.column("doc_id").to_pylist()))}
    table = source.set_column(source.schema.get_field_index("doc_id"), "doc_id",
                              pa.array([ids[d] for d in source.column("doc_id").to_pylist()], pa.int64()))
    table = table.append_column("labels", pa.array(['["Yes", "No"]'] * table.num_rows))
    pq.write_table(table, tmp_path / "q.parquet")
    for args in ((), ("--limit", 1000)):
        run_ok(tmp_path / "q.parquet", "-o", tmp_path / "out.parquet", "--overwrite", *args)
        out = pq.read_table(tmp_path / "out.parquet")
        assert out.column("doc_id").to_pylist() == [str(ids[d]) for d in source.column("doc_id").to_pylist()]
        assert out.column("probs").equals(base.column("probs"))


def test_jsonl_whose_key_first_appears_late_is_read(tmp_path: Path) -> None:
    """Keys and types are found over more than the first MiB: a key seen first near the end, or null until then."""
    rows = [{"document": f"Document {i % 50} " + "word " * 20, "question": "Is it?", "note": None}
            for i in range(12_000)]
    rows[-1]["note"], rows[-2]["late"] = "x", "y"
    with open(tmp_path / "q.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    assert (tmp_path / "q.jsonl").stat().st_size > 1 << 20
    result = kevscore("run", tmp_path / "q.jsonl", "-o", tmp_path / "out.parquet", "--device", "cpu", "--dry-run")
    assert result.exit_code == 0, result.stderr


def test_column_options_that_name_no_column_or_one_twice_are_refused(tmp_path: Path, source: pa.Table) -> None:
    pq.write_table(source.append_column("text", source.column("question")), tmp_path / "q.parquet")
    typo = kevscore("run", tmp_path / "q.parquet", "--device", "cpu", "--question-column", "qustion")
    assert typo.exit_code == 2 and "no column 'qustion' to read as 'question'; columns present: 'doc_id'" in \
        typo.stderr, typo.stderr
    twice = kevscore("run", tmp_path / "q.parquet", "--device", "cpu", "--question-column", "doc_id")
    assert twice.exit_code == 2 and "column 'doc_id' cannot be read as both" in twice.stderr, twice.stderr
    onto = kevscore("run", tmp_path / "q.parquet", "--device", "cpu", "--question-column", "text")
    assert onto.exit_code == 2 and "'text' is to be read as 'question', but there is a column 'question' too" in \
        onto.stderr, onto.stderr
    assert listing(tmp_path) == ["q.parquet"]


def test_errors_about_a_copied_input_name_the_file_as_given(tmp_path: Path) -> None:
    (tmp_path / "q.csv").write_text("document,question\n" + "word " * 6000 + ",Is it?\n")
    result = kevscore("run", tmp_path / "q.csv", "-o", tmp_path / "out.parquet", "--device", "cpu")
    assert result.exit_code == 2 and f"error: {tmp_path / 'q.csv'}: prompt" in result.stderr, result.stderr
    assert "staged" not in result.stderr


def test_values_json_and_csv_cannot_hold_are_written_as_they_can(tmp_path: Path, source: pa.Table) -> None:
    """JSON Lines: NaN and infinities as null (strict JSON), inside lists and structs too; CSV: a struct column as
    JSON text, as strict."""
    n = source.num_rows
    nan, inf = float("nan"), float("inf")
    floats = pa.array([nan, inf, 1.5] + [None] * (n - 3))
    structs = pa.array([{"a": i, "d": datetime.date(2020, 1, 1), "x": -inf if i else 0.5} for i in range(n)])
    lists = pa.array([[nan, 1.0, inf]] + [[2.0]] * (n - 1))
    pq.write_table(source.append_column("f", floats).append_column("s", structs).append_column("l", lists),
                   tmp_path / "q.parquet")
    run_ok(tmp_path / "q.parquet", "-o", tmp_path / "out.jsonl")

    def strict(constant: str):
        raise ValueError(constant)

    rows = [json.loads(line, parse_constant=strict) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["f"] for r in rows[:4]] == [None, None, 1.5, None]
    assert [rows[0]["l"], rows[1]["l"], rows[0]["s"]["x"], rows[1]["s"]["x"]] == [[None, 1.0, None], [2.0], 0.5, None]
    run_ok(tmp_path / "q.parquet", "-o", tmp_path / "out.csv")
    out = pacsv.read_csv(tmp_path / "out.csv")
    assert out.column("s").to_pylist()[:2] == ['{"a": 0, "d": "2020-01-01", "x": 0.5}',
                                                '{"a": 1, "d": "2020-01-01", "x": null}']
    assert json.loads(out.column("l")[0].as_py(), parse_constant=strict) == [None, 1.0, None]


def test_an_empty_csv_labels_cell_is_a_null_one(tmp_path: Path, source: pa.Table) -> None:
    """An empty labels cell is a row without labels, as a null list in Parquet: named, or set aside."""
    labels = [json.dumps(["No", "Yes"])] * source.num_rows
    labels[1] = ""
    pacsv.write_csv(source.append_column("labels", pa.array(labels)), tmp_path / "q.csv")
    result = kevscore("run", tmp_path / "q.csv", "-o", tmp_path / "out.parquet", "--device", "cpu", "--quiet")
    assert result.exit_code == 2 and "column 'labels' (string) has null or empty lists at row 1" in \
        result.stderr, result.stderr
    run_ok(tmp_path / "q.csv", "-o", tmp_path / "out.parquet", "--skip-invalid")
    assert pq.read_table(tmp_path / "out.errors.parquet").column("row").to_pylist() == [1]


def test_outputs_refused_before_any_work(tmp_path: Path, source: pa.Table) -> None:
    """An extension kevscore does not write, an empty -o, the input itself under --dry-run, an output inside an
    input directory, and --skip-invalid with -o -: each one line, exit 2, nothing written."""
    (tmp_path / "in").mkdir()
    pq.write_table(source, tmp_path / "in" / "q.parquet")
    src = tmp_path / "in" / "q.parquet"
    for args, words in (((src, "-o", tmp_path / "out.txt"), "kevscore writes .parquet, .csv or .jsonl"),
                        ((src, "-o", ""), "give the output a file name"),
                        ((src, "-o", src, "--dry-run"), "the output is the input file"),
                        ((tmp_path / "in", "-o", tmp_path / "in" / "out.parquet"), "which this run reads"),
                        ((src, "-o", "-", "--skip-invalid"), "give -o a file")):
        result = kevscore("run", *args, "--device", "cpu")
        assert result.exit_code == 2 and words in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1
    assert listing(tmp_path) == ["in"] and listing(tmp_path / "in") == ["q.parquet"]


def test_odd_input_paths(tmp_path: Path, source: pa.Table, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file whose name holds glob characters is that file; '' is no input; '.' writes beside its directory."""
    (tmp_path / "d").mkdir()
    pq.write_table(source, tmp_path / "d" / "data[1].parquet")
    run_ok(tmp_path / "d" / "data[1].parquet")
    assert listing(tmp_path / "d") == ["data[1].parquet", "data[1].scores.parquet"]
    assert "the input's path is empty" in kevscore("run", "", "-o", tmp_path / "x.parquet").stderr
    (tmp_path / "d" / "data[1].scores.parquet").unlink()
    monkeypatch.chdir(tmp_path / "d")
    run_ok(".")
    assert listing(tmp_path) == ["d", "d.scores.parquet"]


def test_duplicate_column_names_are_refused_before_scoring(tmp_path: Path, source: pa.Table) -> None:
    table = source.append_column("extra", pa.array(["a"] * source.num_rows))
    pq.write_table(table.append_column("extra", pa.array(["b"] * source.num_rows)), tmp_path / "q.parquet")
    result = kevscore("run", tmp_path / "q.parquet", "--device", "cpu")
    assert result.exit_code == 2 and "'extra' appear more than once" in result.stderr, result.stderr
    assert listing(tmp_path) == ["q.parquet"]


def test_a_directory_of_files_of_different_columns_is_read_as_one(tmp_path: Path, source: pa.Table) -> None:
    """The files' columns together: one a file lacks (or holds only as nulls) is null in its rows."""
    (tmp_path / "parts").mkdir()
    first = source.slice(0, 6).drop_columns(["expected"]).append_column("note", pa.nulls(6))
    pq.write_table(first, tmp_path / "parts" / "a.parquet")
    pq.write_table(source.slice(6).append_column("note", pa.array(["n"] * (source.num_rows - 6))),
                   tmp_path / "parts" / "b.parquet")
    run_ok(tmp_path / "parts", "-o", tmp_path / "out.parquet")
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.column("expected").to_pylist() == [None] * 6 + source.column("expected").to_pylist()[6:]
    assert out.column("note").to_pylist() == [None] * 6 + ["n"] * (source.num_rows - 6)


def test_a_directory_of_files_with_integer_and_text_ids_reads_them_as_text(tmp_path: Path, source: pa.Table,
                                                                          base: pa.Table) -> None:
    """One file's ids are integers (as pandas writes them), another's text: every id is read as its text."""
    (tmp_path / "parts").mkdir()
    first = source.slice(0, 6)
    numbers = {d: i for i, d in enumerate(dict.fromkeys(first.column("doc_id").to_pylist()))}
    first = first.set_column(0, "id", pa.array([numbers[d] for d in first.column("doc_id").to_pylist()], pa.int64()))
    first = first.set_column(1, "question_id", pa.array(range(100, 106), pa.int32()))
    pq.write_table(first, tmp_path / "parts" / "a.parquet")
    pq.write_table(source.slice(6).rename_columns(["id", *source.column_names[1:]]), tmp_path / "parts" / "b.parquet")
    run_ok(tmp_path / "parts", "-o", tmp_path / "out.parquet", "--doc-id-column", "id")
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.column("doc_id").to_pylist() == ["0"] * 3 + ["1"] * 3 + source.column("doc_id").to_pylist()[6:]
    assert out.column("question_id").to_pylist() == [str(i) for i in range(100, 106)] + \
        source.column("question_id").to_pylist()[6:]
    assert out.column("probs").equals(base.column("probs"))


def test_renames_that_swap_names_or_live_in_one_file_are_read(tmp_path: Path, source: pa.Table,
                                                               base: pa.Table) -> None:
    """Two columns' names swapped, and a renamed id column in the documents file alone: no clash."""
    swapped = source.rename_columns([{"question": "document", "document": "question"}.get(n, n)
                                     for n in source.column_names])
    pq.write_table(swapped, tmp_path / "swap.parquet")
    run_ok(tmp_path / "swap.parquet", "-o", tmp_path / "swap.out.parquet", "--question-column", "document",
           "--document-column", "question")
    assert pq.read_table(tmp_path / "swap.out.parquet").column("probs").equals(base.column("probs"))
    two = EXAMPLES / "two-file"
    documents = pq.read_table(two / "documents.parquet")
    pq.write_table(documents.rename_columns(["id" if n == "doc_id" else n for n in documents.column_names]),
                   tmp_path / "docs.parquet")
    run_ok(two / "questions.parquet", "--documents", tmp_path / "docs.parquet", "--doc-id-column", "id",
           "-o", tmp_path / "two.out.parquet")


def test_a_glob_inputs_output_is_not_one_it_would_read(tmp_path: Path, source: pa.Table) -> None:
    pq.write_table(source, tmp_path / "a.parquet")
    pattern = str(tmp_path / "*.parquet")
    result = kevscore("run", pattern, "-o", tmp_path / "out.parquet", "--device", "cpu")
    assert result.exit_code == 2 and f"the input {pattern} would read it" in result.stderr, result.stderr
    plan = kevscore("run", pattern, "--dry-run", "--device", "cpu")  # no -o: a dry run writes nothing
    assert plan.exit_code == 0, plan.stderr
    assert "give -o/--output" in kevscore("run", "/", "--device", "cpu").stderr


def test_binary_columns_are_base64_in_csv_and_json_lines(tmp_path: Path, source: pa.Table) -> None:
    """A binary column carried into a CSV or JSON Lines output is base64 text (Parquet keeps the bytes)."""
    import base64

    values = [bytes([0, 255, i % 256]) if i % 3 else None for i in range(source.num_rows)]
    texts = [None if v is None else base64.b64encode(v).decode() for v in values]
    for i, kind in enumerate((pa.binary(), pa.large_binary())):
        pq.write_table(source.append_column("blob", pa.array(values, kind)), tmp_path / f"q{i}.parquet")
        run_ok(tmp_path / f"q{i}.parquet", "-o", tmp_path / f"o{i}.csv")
        read = pacsv.read_csv(tmp_path / f"o{i}.csv", convert_options=pacsv.ConvertOptions(
            column_types={"blob": pa.string()}, strings_can_be_null=True))
        assert read.column("blob").to_pylist() == texts
        run_ok(tmp_path / f"q{i}.parquet", "-o", tmp_path / f"o{i}.jsonl")
        lines = (tmp_path / f"o{i}.jsonl").read_text().splitlines()
        assert [json.loads(line)["blob"] for line in lines] == texts
    run_ok(tmp_path / "q0.parquet", "-o", tmp_path / "o.parquet")
    assert pq.read_table(tmp_path / "o.parquet").column("blob").to_pylist() == values
