"""The `kevscore` command line, end to end on CPU with the demo model: outputs, invariants, and errors."""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kevscore.cli import app
from kevscore.job.data import OUTPUT_SCHEMA
from kevscore.model.prompt import DOC, chat_template

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
runner = CliRunner()


def kevscore(*args):
    """Invoke `kevscore ARGS` in-process; the result has exit_code, stdout and stderr (separate streams)."""
    return runner.invoke(app, [str(a) for a in args])


def run_ok(*args) -> None:
    """`kevscore run ARGS --device cpu`, expected to succeed."""
    result = kevscore("run", *args, "--device", "cpu")
    assert result.exit_code == 0, (result.exit_code, result.stderr, result.exception)
    assert "kevscore run · demo on cpu" in result.stderr or "--model" in args  # the summary


def read(path: Path) -> pa.Table:
    """The output's scoring columns (the input's other columns follow them)."""
    table = pq.read_table(path)
    assert table.schema.names[:len(OUTPUT_SCHEMA)] == OUTPUT_SCHEMA.names, table.schema
    table = table.select(OUTPUT_SCHEMA.names)
    assert table.schema.equals(OUTPUT_SCHEMA), table.schema
    return table


def by_qid(table: pa.Table) -> dict[str, list[float]]:
    return dict(zip(table.column("question_id").to_pylist(), table.column("probs").to_pylist()))


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def put(path: Path, columns: dict) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def fails(directory: Path, parts: list[str], *args) -> str:
    """`kevscore run ARGS --device cpu` exits with status 2 (bad input or usage) and one `error:` line
    holding every part, and leaves `directory` exactly as it was (no output, no temp file)."""
    before = listing(directory)
    result = kevscore("run", *args, "--device", "cpu")
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for part in parts:
        assert part in lines[0], (part, lines[0])
    assert listing(directory) == before  # no output, no hidden .tmp left behind
    return lines[0]


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A copy of the examples: questions.parquet and two-file/{questions,documents}.parquet."""
    shutil.copy(EXAMPLES / "questions.parquet", tmp_path / "questions.parquet")
    shutil.copytree(EXAMPLES / "two-file", tmp_path / "two-file")
    return tmp_path


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> pa.Table:
    """The one-file example scored with the defaults (demo model, indexed path) on CPU."""
    d = tmp_path_factory.mktemp("base")
    shutil.copy(EXAMPLES / "questions.parquet", d / "questions.parquet")
    run_ok(d / "questions.parquet")
    assert listing(d) == ["questions.parquet", "questions.scores.parquet"]
    return read(d / "questions.scores.parquet")


# ---------------------------------------------------------------- happy paths

def test_run_one_file_example(base: pa.Table, example_rows: list[dict]) -> None:
    assert base.num_rows == len(example_rows) == 15
    assert base.column("row").to_pylist() == list(range(15))
    assert base.column("doc_id").to_pylist() == [r["doc_id"] for r in example_rows]
    assert base.column("question_id").to_pylist() == [r["question_id"] for r in example_rows]
    assert base.column("labels").to_pylist() == [["Yes", "No"]] * 15
    for row in base.to_pylist():
        probs = row["probs"]
        assert len(probs) == 2 and all(0.0 < p < 1.0 for p in probs)
        assert sum(probs) == pytest.approx(1.0, abs=1e-12)
        assert row["prediction"] == row["labels"][max(range(2), key=probs.__getitem__)]
        assert 0.0 < row["label_mass"] <= 1.0
    assert len({round(p[0], 6) for p in base.column("probs").to_pylist()}) > 5  # rows really differ


def test_two_file_form_matches_one_file(work: Path, base: pa.Table) -> None:
    d = work / "two-file"
    run_ok(d / "questions.parquet", "--documents", d / "documents.parquet")
    assert listing(d) == ["documents.parquet", "questions.parquet", "questions.scores.parquet"]
    two = read(d / "questions.scores.parquet")
    assert two.column("question_id").to_pylist() == pq.read_table(d / "questions.parquet").column(
        "question_id").to_pylist()
    assert by_qid(two) == by_qid(base)  # same rows in the same order: bit for bit


def test_shuffled_input_keeps_its_order(work: Path, base: pa.Table, example_rows: list[dict]) -> None:
    rows = list(example_rows)
    random.Random(7).shuffle(rows)
    assert [r["question_id"] for r in rows] != [r["question_id"] for r in example_rows]
    shuffled = work / "shuffled.parquet"
    pq.write_table(pa.Table.from_pylist(rows), shuffled)
    run_ok(shuffled)
    out = read(work / "shuffled.scores.parquet")
    assert out.column("row").to_pylist() == list(range(len(rows)))
    assert out.column("question_id").to_pylist() == [r["question_id"] for r in rows]
    assert out.column("doc_id").to_pylist() == [r["doc_id"] for r in rows]
    expected = by_qid(base)
    for qid, probs in by_qid(out).items():
        assert probs == pytest.approx(expected[qid], abs=1e-9), qid


def test_gathered_and_indexed_paths_are_identical(work: Path) -> None:
    src = work / "questions.parquet"
    run_ok(src, "--state-read", "gathered", "-o", work / "gathered.parquet")
    run_ok(src, "--state-read", "indexed", "-o", work / "indexed.parquet")
    gathered, indexed = read(work / "gathered.parquet"), read(work / "indexed.parquet")
    assert gathered.column("probs").to_pylist() == indexed.column("probs").to_pylist()  # bit for bit
    assert gathered.column("label_mass").to_pylist() == indexed.column("label_mass").to_pylist()


def test_bad_state_read_option(work: Path) -> None:
    fails(work, ["--state-read", "fastest", "indexed or gathered"], work / "questions.parquet", "--state-read",
          "fastest")


def test_path_is_the_deprecated_spelling_of_state_read(work: Path) -> None:
    result = kevscore("run", work / "questions.parquet", "--path", "gathered", "-o", work / "old.parquet", "--quiet")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.strip().splitlines() == ["warning: --path is deprecated; use --state-read"]
    assert "--path" not in kevscore("run", "--help").stdout  # hidden: only the new name is shown


def test_custom_labels(work: Path, base: pa.Table) -> None:
    run_ok(work / "questions.parquet", "--labels", "yes,no")
    out = read(work / "questions.scores.parquet")
    assert out.column("labels").to_pylist() == [["yes", "no"]] * 15
    for row in out.to_pylist():
        assert sum(row["probs"]) == pytest.approx(1.0, abs=1e-12)
        assert row["prediction"] == row["labels"][0 if row["probs"][0] >= row["probs"][1] else 1]
    assert out.column("probs").to_pylist() != base.column("probs").to_pylist()  # other tokens, other logits


def test_labels_in_reverse_order_reverse_the_probs(work: Path, base: pa.Table) -> None:
    run_ok(work / "questions.parquet", "--labels", "No,Yes")
    out = read(work / "questions.scores.parquet")
    for row, ref in zip(out.to_pylist(), base.to_pylist()):
        assert row["probs"] == pytest.approx(ref["probs"][::-1], abs=1e-12)
        assert row["label_mass"] == pytest.approx(ref["label_mass"], rel=1e-12)


def test_per_row_labels_column(work: Path, base: pa.Table, example_rows: list[dict]) -> None:
    choices = [["Yes", "No"], ["No", "Yes"], ["yes", "no", "Yes"], [" Yes", " No"]]
    labels = [choices[i % len(choices)] for i in range(len(example_rows))]
    path = work / "labelled.parquet"
    pq.write_table(pa.Table.from_pylist(example_rows).append_column("labels", pa.array(labels)), path)
    run_ok(path, "--labels", "yes,no")  # the column wins over --labels
    out = read(work / "labelled.scores.parquet")
    assert out.column("labels").to_pylist() == labels
    for i, (row, ref) in enumerate(zip(out.to_pylist(), base.to_pylist())):
        assert len(row["probs"]) == len(labels[i])
        assert sum(row["probs"]) == pytest.approx(1.0, abs=1e-12)
        assert row["prediction"] == labels[i][max(range(len(labels[i])), key=row["probs"].__getitem__)]
        if labels[i] == ["Yes", "No"]:
            assert row["probs"] == pytest.approx(ref["probs"], abs=1e-12)
        if labels[i] == ["No", "Yes"]:
            assert row["probs"] == pytest.approx(ref["probs"][::-1], abs=1e-12)


def test_template_file(work: Path, base: pa.Table) -> None:
    from kevscore.model.checkpoint import load_checkpoint

    chat = chat_template(load_checkpoint("demo").tokenizer)
    same = work / "chat.txt"
    same.write_text(chat.head + DOC + chat.tail)
    run_ok(work / "questions.parquet", "--template", same, "-o", work / "same.parquet")
    assert read(work / "same.parquet").column("probs").to_pylist() == base.column("probs").to_pylist()

    plain = work / "plain.txt"
    plain.write_text("Text: {document}\nQuestion: {question}\nAnswer (Yes or No):")
    run_ok(work / "questions.parquet", "--template", plain, "-o", work / "plain.parquet")
    out = read(work / "plain.parquet")
    assert out.num_rows == 15
    assert all(sum(p) == pytest.approx(1.0, abs=1e-12) for p in out.column("probs").to_pylist())
    assert out.column("probs").to_pylist() != base.column("probs").to_pylist()


def test_template_without_question(work: Path) -> None:
    bad = work / "bad.txt"
    bad.write_text("Document: {document}\nAnswer:")
    fails(work, [str(bad), "{question}", "exactly once"], work / "questions.parquet", "--template", bad)


def test_template_file_missing(work: Path) -> None:
    fails(work, [str(work / "nope.txt"), "cannot read the template"],
          work / "questions.parquet", "--template", work / "nope.txt")


def test_empty_input_writes_empty_output(tmp_path: Path) -> None:
    src = tmp_path / "empty.parquet"
    schema = pa.schema([("doc_id", pa.string()), ("question_id", pa.string()),
                        ("document", pa.string()), ("question", pa.string())])
    pq.write_table(schema.empty_table(), src)
    run_ok(src)
    out = read(tmp_path / "empty.scores.parquet")
    assert out.num_rows == 0


def test_overwrite(work: Path, base: pa.Table) -> None:
    out = work / "questions.scores.parquet"
    out.write_bytes(b"previous results")
    fails(work, [str(out), "already exists", "--overwrite"], work / "questions.parquet")
    assert out.read_bytes() == b"previous results"
    run_ok(work / "questions.parquet", "--overwrite")
    assert read(out).column("probs").to_pylist() == base.column("probs").to_pylist()
    assert listing(work) == ["questions.parquet", "questions.scores.parquet", "two-file"]


# ---------------------------------------------------------------- bad input

def test_missing_input_file(work: Path) -> None:
    fails(work, [str(work / "nope.parquet"), "no such file"], work / "nope.parquet")


def test_input_that_is_not_a_regular_file(work: Path) -> None:
    os.mkfifo(pipe := work / "pipe.parquet")
    fails(work, [str(pipe), "not a regular file"], pipe, "-o", work / "out.parquet")


def test_input_not_parquet(work: Path) -> None:
    path = work / "questions.parquet"
    path.write_text("document,question\nd,q\n")
    fails(work, [str(path), "not a readable Parquet file"], path)


def test_missing_column(work: Path, example_rows: list[dict]) -> None:
    path = put(work / "in.parquet", {"document": [r["document"] for r in example_rows]})
    fails(work, [str(path), "missing required column(s) 'question'", "columns present: 'document'"], path)


def test_null_question(work: Path, example_rows: list[dict]) -> None:
    questions = [None if i in (2, 9) else r["question"] for i, r in enumerate(example_rows)]
    path = put(work / "in.parquet", {"document": [r["document"] for r in example_rows],
                                     "question": pa.array(questions, pa.string())})
    fails(work, [str(path), "column 'question'", "nulls at rows 2, 9"], path)


def test_doc_id_without_document(work: Path) -> None:
    d = work / "two-file"
    docs = pq.read_table(d / "documents.parquet").to_pylist()
    kept = [r for r in docs if r["doc_id"] != "train"]
    assert len(kept) == len(docs) - 1
    pq.write_table(pa.Table.from_pylist(kept), d / "documents.parquet")
    qids = pq.read_table(d / "questions.parquet").column("doc_id").to_pylist()
    rows = ", ".join(str(i) for i, k in enumerate(qids) if k == "train")
    fails(d, [str(d / "questions.parquet"), "column 'doc_id'", "'train'", str(d / "documents.parquet"), rows],
          d / "questions.parquet", "--documents", d / "documents.parquet")


def test_doc_id_with_two_documents(work: Path, example_rows: list[dict]) -> None:
    rows = [dict(r) for r in example_rows]
    first = [i for i, r in enumerate(rows) if r["doc_id"] == rows[0]["doc_id"]]
    assert len(first) >= 2
    rows[first[-1]]["document"] += " Something else."
    path = work / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    fails(work, [str(path), "column 'doc_id'", repr(rows[0]["doc_id"]), "different",
                 ", ".join(map(str, first))], path)


def test_doc_id_with_two_documents_in_documents_file(work: Path) -> None:
    d = work / "two-file"
    docs = pq.read_table(d / "documents.parquet").to_pylist()
    docs.append({"doc_id": docs[0]["doc_id"], "document": "Another text."})
    pq.write_table(pa.Table.from_pylist(docs), d / "documents.parquet")
    fails(d, [str(d / "documents.parquet"), repr(docs[0]["doc_id"]), "different", f"rows 0, {len(docs) - 1}"],
          d / "questions.parquet", "--documents", d / "documents.parquet")


def test_duplicate_question_id(work: Path, example_rows: list[dict]) -> None:
    rows = [dict(r) for r in example_rows]
    rows[5]["question_id"] = rows[1]["question_id"]
    path = work / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    fails(work, [str(path), "column 'question_id'", "duplicate", repr(rows[1]["question_id"]), "rows 1, 5"], path)


def test_label_of_several_tokens_is_scored(work: Path, base: pa.Table) -> None:
    from kevscore.model.checkpoint import load_checkpoint

    assert len(load_checkpoint("demo").tokenizer.encode("maybe", add_special_tokens=False)) > 1
    run_ok(work / "questions.parquet", "--labels", "Yes,No,maybe")
    out = read(work / "questions.scores.parquet")
    assert out.column("labels").to_pylist() == [["Yes", "No", "maybe"]] * 15
    for row, ref in zip(out.to_pylist(), base.to_pylist()):
        assert sum(row["probs"]) == pytest.approx(1.0, abs=1e-12)
        assert row["label_mass"] >= ref["label_mass"] * (1 - 1e-5)  # a third label adds its probability


def test_label_with_brackets_is_shown_verbatim(work: Path) -> None:
    # rich markup must not eat "[b]" from a user's label (or a path) in the error line
    fails(work, ["[b]maybe,[b]maybe", "distinct"], work / "questions.parquet", "--labels", "[b]maybe,[b]maybe")


def test_label_column_of_no_tokens(work: Path, example_rows: list[dict]) -> None:
    labels = [["Yes", "No"]] * len(example_rows)
    labels[4] = ["Yes", ""]
    path = work / "in.parquet"
    pq.write_table(pa.Table.from_pylist(example_rows).append_column("labels", pa.array(labels)), path)
    fails(work, [path.name, "column 'labels'", "row 4", "label ''", "no tokens"], path)


def test_repeated_labels_option(work: Path) -> None:
    fails(work, ["--labels", "distinct"], work / "questions.parquet", "--labels", "Yes,Yes")


def test_prompt_longer_than_model(work: Path, example_rows: list[dict]) -> None:
    rows = [dict(r) for r in example_rows]
    long_doc = "The market was busy and loud. " * 800  # well over the demo model's 4096 positions
    for i in (3, 4):
        rows[i]["document"], rows[i]["doc_id"] = long_doc, "long"
    path = work / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    fails(work, [path.name, "longer than the model's 4096 positions", "rows 3, 4", "tokens)"], path)


def test_output_is_input(work: Path) -> None:
    src = work / "questions.parquet"
    before = src.read_bytes()
    fails(work, [str(src), "is the input"], src, "-o", src, "--overwrite")
    assert src.read_bytes() == before


def test_output_is_documents_file(work: Path) -> None:
    d = work / "two-file"
    fails(d, ["is the input", "documents.parquet"], d / "questions.parquet", "--documents",
          d / "documents.parquet", "-o", d / "documents.parquet", "--overwrite")


# ---------------------------------------------------------------- help

def test_help_lists_commands() -> None:
    result = kevscore("--help")
    assert result.exit_code == 0
    assert "run" in result.stdout and "Score many questions" in result.stdout


def test_run_help_lists_options() -> None:
    result = kevscore("run", "--help")
    assert result.exit_code == 0
    for option in ("--documents", "--output", "--model", "--device", "--state-read", "--labels", "--template",
                   "--batch-rows", "--bank-capacity", "--eager", "--overwrite", "--quiet"):
        assert option in result.stdout, option


@pytest.mark.parametrize("log_json", [False, True])
def test_a_bug_is_one_line_not_a_traceback(tmp_path: Path, monkeypatch, log_json: bool) -> None:
    """An exception that is kevscore's fault (not bad input, not the disk) reaches the user as one `error:`
    line and exit status 1 (and an `error` event under --log-json); KEVSCORE_TRACEBACK=1 shows the traceback."""
    from kevscore.api import Scorer

    def broken(*args, **kwargs):
        raise RuntimeError("kernel failed to compile\nat 52:10: arange's arguments must be constexpr")

    monkeypatch.setattr(Scorer, "run", broken)
    args = ["run", str(EXAMPLES / "demo-task.parquet"), "-o", str(tmp_path / "out.parquet"), "--device", "cpu",
            *(["--log-json"] if log_json else [])]
    res = runner.invoke(app, args)
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    said = "internal error, a bug in kevscore: RuntimeError: kernel failed to compile (rerun with KEVSCORE_TRACEBACK"
    if log_json:
        events = [json.loads(x) for x in res.output.splitlines() if x.startswith("{")]
        assert events[-1]["event"] == "error" and events[-1]["message"].startswith(said), events
    else:
        assert "error: " + said in res.output.replace("\n", " ")
    assert "at 52:10" not in res.output and not (tmp_path / "out.parquet").exists()
    monkeypatch.setenv("KEVSCORE_TRACEBACK", "1")
    res = runner.invoke(app, args)
    assert isinstance(res.exception, RuntimeError)


def test_an_exit_inside_a_command_is_not_a_bug(tmp_path: Path, monkeypatch) -> None:
    """typer's Exit is a RuntimeError: one raised inside a command's error handling keeps its status and adds
    no `internal error` line."""
    import typer

    from kevscore.api import Scorer

    def leave(*args, **kwargs):
        raise typer.Exit(3)

    monkeypatch.setattr(Scorer, "run", leave)
    res = runner.invoke(app, ["run", str(EXAMPLES / "demo-task.parquet"), "-o", str(tmp_path / "o.parquet")])
    assert res.exit_code == 3 and "internal error" not in res.output
