"""kevscore.job.data: Parquet input validation, output schema and path checks; the atomic writes of kevscore.job.parts."""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kevscore import faults
from kevscore.durable import write_atomic
from kevscore.errors import KevscoreError, KevscoreFailure
from kevscore.job.data import OUTPUT_SCHEMA, output_table, read_input
from kevscore.job.files import check_output_path, output_path, table_filler
from kevscore.job.options import RunOptions
from kevscore.job.scan import InputTable


def put(path: Path, columns: dict[str, list | pa.Array], schema: pa.Schema | None = None) -> Path:
    arrays = {k: v if isinstance(v, (pa.Array, pa.ChunkedArray)) else pa.array(v) for k, v in columns.items()}
    table = pa.table(arrays) if schema is None else pa.table(arrays, schema=schema)
    pq.write_table(table, path)
    return path


def fails(match: list[str], *args) -> str:
    """read_input(*args) raises a KevscoreError on one line that contains every string in match."""
    with pytest.raises(KevscoreError) as info:
        read_input(*args)
    message = str(info.value)
    assert "\n" not in message
    for part in match:
        assert part in message, (part, message)
    return message


@pytest.fixture
def one(tmp_path: Path) -> Path:
    return put(tmp_path / "in.parquet", {
        "document": ["alpha", "beta", "alpha", "gamma"],
        "question": ["q0", "q1", "q2", "q3"],
        "doc_id": ["a", "b", "a", "c"],
        "question_id": ["x0", "x1", "x2", "x3"],
        "labels": [["yes", "no"], ["A", "B", "C"], ["yes", "no"], ["t", "f"]],
    })


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    return put(tmp_path / "docs.parquet", {"doc_id": ["b", "a", "c", "a"],
                                           "document": ["beta", "alpha", "gamma", "alpha"]})


# ---------------------------------------------------------------- happy paths

def test_one_file_form(one: Path) -> None:
    t = read_input(one)
    assert len(t) == 4
    assert t.documents == ["alpha", "beta", "alpha", "gamma"]
    assert t.questions == ["q0", "q1", "q2", "q3"]
    assert t.doc_ids == ["a", "b", "a", "c"]
    assert t.question_ids == ["x0", "x1", "x2", "x3"]
    assert t.labels == [["yes", "no"], ["A", "B", "C"], ["yes", "no"], ["t", "f"]]
    assert t.sources == [one]


def test_one_file_minimal_has_no_optional_columns(tmp_path: Path) -> None:
    path = put(tmp_path / "in.parquet", {"document": ["d", "d"], "question": ["a", "b"], "other": [1, 2]})
    t = read_input(path)
    assert (t.documents, t.questions) == (["d", "d"], ["a", "b"])
    assert t.doc_ids is None and t.question_ids is None and t.labels is None


def test_one_file_same_doc_id_same_text_is_fine(tmp_path: Path) -> None:
    path = put(tmp_path / "in.parquet", {"document": ["d", "d"], "question": ["a", "b"], "doc_id": ["k", "k"]})
    assert read_input(path).doc_ids == ["k", "k"]


def test_two_file_form_joins_documents_in_input_order(tmp_path: Path, docs: Path) -> None:
    questions = put(tmp_path / "q.parquet", {
        "question": ["q0", "q1", "q2", "q3"], "doc_id": ["c", "a", "b", "a"],
        "question_id": ["x0", "x1", "x2", "x3"], "labels": [["y", "n"]] * 4})
    t = read_input(questions, docs)
    assert t.documents == ["gamma", "alpha", "beta", "alpha"]
    assert t.questions == ["q0", "q1", "q2", "q3"]
    assert t.doc_ids == ["c", "a", "b", "a"]
    assert t.question_ids == ["x0", "x1", "x2", "x3"]
    assert t.labels == [["y", "n"]] * 4
    assert t.sources == [questions, docs]


def test_dictionary_and_large_strings_are_decoded(tmp_path: Path) -> None:
    dict_docs = pa.array(["alpha", "beta", "alpha"]).dictionary_encode()
    assert pa.types.is_dictionary(dict_docs.type)
    path = put(tmp_path / "in.parquet", {
        "document": dict_docs,
        "question": pa.array(["q0", "q1", "q2"], pa.large_string()),
        "doc_id": pa.array(["a", "b", "a"]).dictionary_encode(),
        "labels": pa.array([["y", "n"]] * 3, pa.list_(pa.dictionary(pa.int32(), pa.string()))),
    })
    assert pa.types.is_dictionary(pq.read_schema(path).field("document").type)
    t = read_input(path)
    assert t.documents == ["alpha", "beta", "alpha"]
    assert t.questions == ["q0", "q1", "q2"]
    assert t.doc_ids == ["a", "b", "a"]
    assert t.labels == [["y", "n"]] * 3
    assert all(type(v) is str for v in t.documents + t.questions + t.doc_ids)


def test_dictionary_doc_ids_join_two_files(tmp_path: Path) -> None:
    q = put(tmp_path / "q.parquet", {"question": ["q0", "q1", "q2"],
                                     "doc_id": pa.array(["b", "a", "b"]).dictionary_encode()})
    d = put(tmp_path / "d.parquet", {"doc_id": pa.array(["a", "b"]).dictionary_encode(),
                                     "document": pa.array(["alpha", "beta"]).dictionary_encode()})
    assert pa.types.is_dictionary(pq.read_schema(d).field("document").type)
    t = read_input(q, d)
    assert t.documents == ["beta", "alpha", "beta"]
    assert t.doc_ids == ["b", "a", "b"]


def test_empty_input_returns_empty_table(tmp_path: Path) -> None:
    schema = pa.schema([("document", pa.string()), ("question", pa.string()),
                        ("labels", pa.list_(pa.string()))])
    path = tmp_path / "empty.parquet"
    pq.write_table(schema.empty_table(), path)
    t = read_input(path)
    assert len(t) == 0
    assert t.documents == [] and t.questions == [] and t.labels == []


# ---------------------------------------------------------------- unreadable files

def test_missing_file(tmp_path: Path) -> None:
    fails([str(tmp_path / "nope.parquet"), "no such file"], tmp_path / "nope.parquet")


def test_missing_documents_file(tmp_path: Path) -> None:
    q = put(tmp_path / "q.parquet", {"question": ["a"], "doc_id": ["a"]})
    fails(["nodocs.parquet", "no such file"], q, tmp_path / "nodocs.parquet")


def test_directory_is_not_a_file(tmp_path: Path) -> None:
    fails([str(tmp_path), "not a file"], tmp_path)


@pytest.mark.parametrize("content", [b"document,question\nd,q\n", os.urandom(300), b""])
def test_not_parquet(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "in.csv"
    path.write_bytes(content)
    fails([str(path), "not a readable Parquet file"], path)


# ---------------------------------------------------------------- missing columns

def test_one_file_missing_columns_lists_present(tmp_path: Path) -> None:
    path = put(tmp_path / "in.parquet", {"doc": ["d"], "question": ["q"]})
    msg = fails([str(path), "'document'", "columns present: 'doc', 'question'"], path)
    assert "'question'" not in msg.split(";")[0]


def test_questions_file_missing_doc_id(tmp_path: Path, docs: Path) -> None:
    path = put(tmp_path / "q.parquet", {"question": ["q"], "document": ["d"]})
    fails([str(path), "'doc_id'", "columns present: 'question', 'document'"], path, docs)


def test_documents_file_missing_document(tmp_path: Path) -> None:
    q = put(tmp_path / "q.parquet", {"question": ["q"], "doc_id": ["a"]})
    d = put(tmp_path / "d.parquet", {"doc_id": ["a"], "text": ["t"]})
    fails([str(d), "'document'", "columns present: 'doc_id', 'text'"], q, d)


def test_questions_file_with_document_and_documents_file(tmp_path: Path, docs: Path) -> None:
    q = put(tmp_path / "q.parquet", {"question": ["q"], "doc_id": ["a"], "document": ["d"]})
    fails([str(q), "'document'", "documents file"], q, docs)


# ---------------------------------------------------------------- nulls and types

@pytest.mark.parametrize("column", ["document", "question", "doc_id", "question_id"])
def test_nulls_in_string_columns(tmp_path: Path, column: str) -> None:
    cols = {"document": ["d"] * 5, "question": ["q"] * 5, "doc_id": ["k"] * 5,
            "question_id": ["x0", "x1", "x2", "x3", "x4"]}
    cols[column] = [v if i not in (1, 4) else None for i, v in enumerate(cols[column])]
    path = put(tmp_path / "in.parquet", cols)
    fails([str(path), f"column '{column}'", "nulls at rows 1, 4"], path)


def test_nulls_in_documents_file(tmp_path: Path) -> None:
    q = put(tmp_path / "q.parquet", {"question": ["q"], "doc_id": ["a"]})
    d = put(tmp_path / "d.parquet", {"doc_id": ["a", None, "c"], "document": ["x", "y", "z"]})
    fails([str(d), "column 'doc_id'", "nulls at row 1"], q, d)


def test_nulls_in_questions_doc_id(tmp_path: Path, docs: Path) -> None:
    q = put(tmp_path / "q.parquet", {"question": ["q", "r", "s"], "doc_id": ["a", "b", None]})
    fails([str(q), "column 'doc_id'", "nulls at row 2"], q, docs)


@pytest.mark.parametrize("column, values, type_name", [
    ("document", [1, 2], "int64"),
    ("question", [b"a", b"b"], "binary"),
    ("doc_id", [1.5, 2.5], "double"),
    ("question_id", [3, 4], "int64"),
    ("labels", [1, 2], "int64"),
    ("labels", [[1, 2], [3]], "list<element: int64>"),  # Parquet names list items "element"
])
def test_wrong_types(tmp_path: Path, column: str, values: list, type_name: str) -> None:
    cols: dict[str, list] = {"document": ["d", "e"], "question": ["q", "r"]}
    cols[column] = values
    path = put(tmp_path / "in.parquet", cols)
    fails([str(path), f"column '{column}'", f"type {type_name}"], path)


@pytest.mark.parametrize("labels, what, rows", [
    ([["a"], None, ["b"], None], "null or empty", "rows 1, 3"),
    ([["a"], [], ["b"], ["c"]], "null or empty", "row 1"),
    ([["a"], ["b"], ["c", None], ["d"]], "null labels", "row 2"),
    ([["a", "a"], ["b"], ["c"], ["d"]], "repeated labels", "row 0"),
])
def test_bad_labels_rows(tmp_path: Path, labels: list, what: str, rows: str) -> None:
    path = put(tmp_path / "in.parquet", {"document": ["d"] * 4, "question": ["q"] * 4,
                                         "labels": pa.array(labels, pa.list_(pa.string()))})
    fails([str(path), "column 'labels'", "string>", what, rows], path)


def test_labels_as_json_text(tmp_path: Path) -> None:
    """A labels column of text holds JSON arrays of strings (an empty text: no labels); other text names its rows."""
    cols = {"document": ["d"] * 4, "question": ["q"] * 4, "labels": ['["Yes", "No"]', "", '["A", "B", "C"]', None]}
    fails([str(tmp_path / "in.parquet"), "column 'labels' (string) has null or empty lists at rows 1, 3"],
          put(tmp_path / "in.parquet", cols))
    cols["labels"][1::2] = ["Yes,No", '["Yes", 3]']
    fails([str(tmp_path / "in.parquet"), "column 'labels' (string) has text that is no JSON array of strings at "
                                         "rows 1, 3"], put(tmp_path / "in.parquet", cols))
    cols["labels"][1::2] = ['["a", "b"]', ' ["c", "d"] ']
    assert read_input(put(tmp_path / "in.parquet", cols)).labels == [["Yes", "No"], ["a", "b"], ["A", "B", "C"],
                                                                     ["c", "d"]]


# ---------------------------------------------------------------- joins and ids

def test_unknown_doc_ids(tmp_path: Path, docs: Path) -> None:
    q = put(tmp_path / "q.parquet", {"question": list("qrstu"), "doc_id": ["a", "zz", "b", "yy", "zz"]})
    msg = fails([str(q), "column 'doc_id'", str(docs), "'zz', 'yy'", "rows 1, 3, 4"], q, docs)
    assert "'a'" not in msg and "'b'" not in msg


def test_many_unknown_doc_ids_are_abbreviated(tmp_path: Path, docs: Path) -> None:
    ids = [f"u{i}" for i in range(30)]
    q = put(tmp_path / "q.parquet", {"question": ["q"] * 30, "doc_id": ids})
    msg = fails([str(q), "'u0'", "(30 values)", "(30 rows)"], q, docs)
    assert "'u29'" not in msg


def test_one_file_doc_id_with_two_texts(tmp_path: Path) -> None:
    path = put(tmp_path / "in.parquet", {"document": ["x", "y", "x", "z", "x2"],
                                         "question": list("abcde"), "doc_id": ["k", "m", "k", "n", "k"]})
    msg = fails([str(path), "column 'doc_id'", "'k'", "different", "rows 0, 2, 4"], path)
    assert "'m'" not in msg


def test_documents_file_conflicting_duplicates(tmp_path: Path) -> None:
    q = put(tmp_path / "q.parquet", {"question": ["q"], "doc_id": ["a"]})
    d = put(tmp_path / "d.parquet", {"doc_id": ["a", "b", "a"], "document": ["x", "y", "X"]})
    fails([str(d), "column 'doc_id'", "'a'", "different", "rows 0, 2"], q, d)


def test_duplicate_question_ids(tmp_path: Path) -> None:
    path = put(tmp_path / "in.parquet", {"document": ["d"] * 5, "question": list("abcde"),
                                         "question_id": ["p", "r", "p", "s", "r"]})
    msg = fails([str(path), "column 'question_id'", "duplicate", "'p', 'r'", "rows 0, 1, 2, 4"], path)
    assert "'s'" not in msg


def test_duplicate_question_ids_two_file_form(tmp_path: Path, docs: Path) -> None:
    q = put(tmp_path / "q.parquet", {"question": ["a", "b"], "doc_id": ["a", "b"], "question_id": ["p", "p"]})
    fails([str(q), "column 'question_id'", "'p'", "rows 0, 1"], q, docs)


# ---------------------------------------------------------------- output paths

def test_default_output_path() -> None:
    assert output_path(RunOptions(input=Path("some/dir/run.parquet"))) == Path("some/dir/run.scores.parquet")
    assert output_path(RunOptions(input=Path("x.pq"))) == Path("x.scores.parquet")


def test_check_output_path_ok(tmp_path: Path, one: Path) -> None:
    check_output_path(tmp_path / "out.parquet", [one], overwrite=False)
    (tmp_path / "out.parquet").write_bytes(b"old")
    check_output_path(tmp_path / "out.parquet", [one], overwrite=True)


@pytest.mark.parametrize("overwrite", [False, True])
def test_check_output_is_input(tmp_path: Path, one: Path, docs: Path, overwrite: bool,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for output in (Path("in.parquet"), tmp_path / "sub" / ".." / "docs.parquet"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        with pytest.raises(KevscoreError, match="is the input"):
            check_output_path(output, [one, docs], overwrite=overwrite)


def test_check_output_is_input_through_symlink(tmp_path: Path, one: Path) -> None:
    link = tmp_path / "link.parquet"
    link.symlink_to(one)
    with pytest.raises(KevscoreError, match="is the input"):
        check_output_path(link, [one], overwrite=True)


def test_check_output_exists_without_overwrite(tmp_path: Path, one: Path) -> None:
    out = tmp_path / "out.parquet"
    out.write_bytes(b"old")
    with pytest.raises(KevscoreError, match="--overwrite") as info:
        check_output_path(out, [one], overwrite=False)
    assert str(out) in str(info.value)


def test_check_output_missing_directory(tmp_path: Path, one: Path) -> None:
    out = tmp_path / "missing" / "out.parquet"
    with pytest.raises(KevscoreError, match="does not exist") as info:
        check_output_path(out, [one], overwrite=True)
    assert str(tmp_path / "missing") in str(info.value)


def test_check_output_is_directory(tmp_path: Path, one: Path) -> None:
    (tmp_path / "dir").mkdir()
    with pytest.raises(KevscoreError, match="directory"):
        check_output_path(tmp_path / "dir", [one], overwrite=True)


# ---------------------------------------------------------------- the output's rows, atomic writes

def scores(n: int) -> tuple[list[list[str]], list[list[float]], list[float]]:
    labels = [["yes", "no"], ["A", "B", "C"], ["yes", "no"], ["t"]][:n]
    probs = [[0.25, 0.75], [0.4, 0.4, 0.2], [0.9, 0.1], [1.0]][:n]
    return labels, probs, [0.5, 0.6, 0.7, 0.8][:n]


def test_output_table_schema_and_values(one: Path) -> None:
    labels, probs, mass = scores(4)
    table = output_table(read_input(one), labels, probs, mass)
    assert table.schema.equals(OUTPUT_SCHEMA)
    assert table.column("row").to_pylist() == [0, 1, 2, 3]
    assert table.column("doc_id").to_pylist() == ["a", "b", "a", "c"]
    assert table.column("question_id").to_pylist() == ["x0", "x1", "x2", "x3"]
    assert table.column("labels").to_pylist() == labels
    assert table.column("probs").to_pylist() == probs
    assert table.column("prediction").to_pylist() == ["no", "A", "yes", "t"]  # tie → first
    assert table.column("label_mass").to_pylist() == mass


def test_output_table_null_ids_and_fixed_types(tmp_path: Path) -> None:
    path = put(tmp_path / "in.parquet", {"document": pa.array(["d", "e"]).dictionary_encode(),
                                         "question": pa.array(["q", "r"], pa.large_string())})
    table = output_table(read_input(path), [["a", "b"]] * 2, [[0.1, 0.9], [0.6, 0.4]], [1.0, 0.5])
    assert table.schema.equals(OUTPUT_SCHEMA)
    assert table.column("doc_id").to_pylist() == [None, None]
    assert table.column("question_id").to_pylist() == [None, None]
    assert table.column("prediction").to_pylist() == ["b", "a"]


def test_output_table_empty(tmp_path: Path) -> None:
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.schema([("document", pa.string()), ("question", pa.string())]).empty_table(), path)
    table = output_table(read_input(path), [], [], [])
    assert table.num_rows == 0 and table.schema.equals(OUTPUT_SCHEMA)


def empty_rows(n: int) -> InputTable:
    return InputTable(["d"] * n, ["q"] * n, None, None, None, [Path("in.parquet")])


@pytest.mark.parametrize("bad", ["labels", "probs", "mass", "aligned"])
def test_output_table_rejects_mismatched_lengths(bad: str) -> None:
    labels, probs, mass = scores(2)
    if bad == "labels":
        labels = labels[:1]
    elif bad == "probs":
        probs = probs[:1]
    elif bad == "mass":
        mass = mass + [0.1]
    else:  # labels and probs of different lengths in a row
        probs = [[0.5, 0.5], [0.5, 0.5]]
    with pytest.raises(ValueError):
        output_table(empty_rows(2), labels, probs, mass)


def write(out: Path, hook: str | None = None) -> None:
    """One output table written the way parts are (durable.write_atomic of files.table_filler)."""
    table = output_table(empty_rows(1), [["a", "b"]], [[0.3, 0.7]], [0.9])
    write_atomic(out, table_filler([table], hook=hook), out.parent)


@pytest.fixture
def disk_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills at the first fault point `disk-check` this test reaches."""
    monkeypatch.setenv("KEVSCORE_TEST_ENOSPC", "disk-check")
    monkeypatch.setattr(faults, "_reached", Counter())


def test_write_is_atomic_on_failure(tmp_path: Path, disk_full: None) -> None:
    with pytest.raises(KevscoreFailure, match=f"{tmp_path / 'out.parquet'}: cannot write .No space left on device"):
        write(tmp_path / "out.parquet", hook="disk-check")  # the disk fills after the first row group
    assert list(tmp_path.iterdir()) == []


def test_failed_write_leaves_existing_output_untouched(tmp_path: Path, disk_full: None) -> None:
    out = tmp_path / "out.parquet"
    out.write_bytes(b"previous results")
    with pytest.raises(KevscoreFailure):
        write(out, hook="disk-check")
    assert out.read_bytes() == b"previous results"
    assert [p.name for p in tmp_path.iterdir()] == ["out.parquet"]


def test_failed_replace_removes_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Path] = []

    def no_replace(src, dst) -> None:
        seen.append(Path(src))
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", no_replace)
    with pytest.raises(KevscoreFailure, match="cannot write .Permission denied"):
        write(tmp_path / "out.parquet")
    assert seen and seen[0].parent == tmp_path
    assert seen[0].name.startswith(".") and seen[0].name.endswith(".tmp")
    assert list(tmp_path.iterdir()) == []


def test_write_replaces_existing_output(tmp_path: Path) -> None:
    out = tmp_path / "out.parquet"
    out.write_bytes(b"previous results")
    write(out)
    assert pq.read_table(out).column("prediction").to_pylist() == ["b"]
    assert [p.name for p in tmp_path.iterdir()] == ["out.parquet"]
