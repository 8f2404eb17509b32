"""Inputs of Arrow types a job must read and carry as they are: string and binary views, nanosecond times, a uuid;
a directory's hidden and underscored files (a writer's temporaries) left unread; a table Parquet cannot hold;
a column named like one of ours in another case."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kevscore.cli import app

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_ok(*args) -> None:
    result = CliRunner().invoke(app, ["run", *map(str, args), "--device", "cpu", "--quiet"])
    assert result.exit_code == 0, (result.stderr, result.exception)


@pytest.fixture(scope="module")
def source() -> pa.Table:
    return pq.read_table(EXAMPLES / "questions.parquet")


@pytest.fixture(scope="module")
def base(tmp_path_factory, source: pa.Table) -> pa.Table:
    d = tmp_path_factory.mktemp("base")
    pq.write_table(source, d / "q.parquet")
    run_ok(d / "q.parquet", "--no-carry")
    return pq.read_table(d / "q.scores.parquet")


@pytest.mark.skipif(not hasattr(pa, "string_view"), reason="pyarrow without view types")
def test_string_and_binary_view_columns_are_read_and_carried(tmp_path: Path, source: pa.Table, base: pa.Table) -> None:
    n = source.num_rows
    views = pa.table({name: source.column(name).cast(pa.string_view()) for name in source.column_names})
    views = views.append_column("labels", pa.array([["Yes", "No"]] * n, pa.list_(pa.string_view())))
    views = views.append_column("blob", pa.array([b"\x00%d" % i for i in range(n)], pa.binary_view()))
    pq.write_table(views, tmp_path / "q.parquet")
    run_ok(tmp_path / "q.parquet", "-o", tmp_path / "out.parquet")
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.select(["row", "question_id", "probs"]).equals(base.select(["row", "question_id", "probs"]))
    assert out.column("blob").to_pylist() == [b"\x00%d" % i for i in range(n)]
    assert out.column("question").to_pylist() == source.column("question").to_pylist()


def test_nanosecond_times_are_carried_exactly(tmp_path: Path, source: pa.Table) -> None:
    """Parquet keeps them; JSON Lines and CSV write their text, nanoseconds and all (Python's times hold
    microseconds)."""
    n = source.num_rows
    ns = pa.array(range(1, n + 1), pa.timestamp("ns"))
    table = source.append_column("t", ns).append_column("d", pa.array(range(n), pa.duration("ns")))
    pq.write_table(table.append_column("lt", pa.array([[i] for i in range(n)], pa.list_(pa.timestamp("ns")))),
                   tmp_path / "q.parquet")
    run_ok(tmp_path / "q.parquet", "-o", tmp_path / "out.parquet")
    assert pq.read_table(tmp_path / "out.parquet").column("t").equals(pa.chunked_array([ns]))
    run_ok(tmp_path / "q.parquet", "-o", tmp_path / "out.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [rows[1]["t"], rows[1]["d"], rows[1]["lt"]] == ["1970-01-01 00:00:00.000000002", "1",
                                                         ["1970-01-01 00:00:00.000000001"]]
    run_ok(tmp_path / "q.parquet", "-o", tmp_path / "out.csv")
    out = pacsv.read_csv(tmp_path / "out.csv", convert_options=pacsv.ConvertOptions(strings_can_be_null=True,
                                                                                    column_types={"t": pa.string()}))
    assert out.column("t")[1].as_py() == "1970-01-01 00:00:00.000000002"


def test_a_directory_skips_hidden_and_underscored_files(tmp_path: Path, source: pa.Table, base: pa.Table) -> None:
    """A writer's temporaries (Spark's _temporary/, a .part-0.parquet being written) are not part of the input."""
    parts = tmp_path / "parts"
    for sub in ("_temporary/0", ".git", ""):
        (parts / sub).mkdir(parents=True, exist_ok=True)
        pq.write_table(source.slice(0, 2), parts / sub / ".part-9.parquet")
        pq.write_table(source.slice(0, 2), parts / sub / "_part-8.parquet")
    pq.write_table(source.slice(0, 2), parts / "_temporary/0" / "part-7.parquet")
    pq.write_table(source.slice(0, 2), parts / ".git" / "part-7.parquet")
    pq.write_table(source, parts / "part-0.parquet")
    run_ok(parts, "-o", tmp_path / "out.parquet", "--no-carry")
    assert pq.read_table(tmp_path / "out.parquet").equals(base)
    run_ok(parts.as_uri(), "-o", tmp_path / "uri.parquet", "--no-carry")
    assert pq.read_table(tmp_path / "uri.parquet").equals(base)
    (parts / "part-0.parquet").unlink()
    result = CliRunner().invoke(app, ["run", str(parts), "-o", str(tmp_path / "none.parquet"), "--device", "cpu"])
    assert result.exit_code == 2 and "no .parquet file (names beginning with . or _ are skipped)" in result.stderr


def test_types_the_csv_writer_has_no_text_for_are_written_as_their_values(tmp_path: Path, source: pa.Table) -> None:
    """A uuid (an extension type) carried into a CSV output is its text, not an internal error at the merge."""
    if not hasattr(pa, "uuid"):
        pytest.skip("pyarrow without the uuid type")
    ids = [bytes(15) + bytes([i]) for i in range(source.num_rows)]
    pq.write_table(source.append_column("u", pa.array(ids, pa.uuid())), tmp_path / "q.parquet")
    run_ok(tmp_path / "q.parquet", "-o", tmp_path / "out.csv")
    assert pacsv.read_csv(tmp_path / "out.csv").column("u")[1].as_py() == "00000000-0000-0000-0000-000000000001"


def test_a_table_parquet_cannot_hold_is_a_kevscore_error(source: pa.Table) -> None:
    """Scorer.score writes a table as Parquet first: a column Parquet has no type for is the user's to change."""
    from kevscore import KevscoreError, Scorer

    table = source.append_column("gap", pa.array([pa.MonthDayNano([0, 1, 0])] * source.num_rows))
    with pytest.raises(KevscoreError, match=r"^<questions>: cannot be written as Parquet, which kevscore reads \("):
        Scorer("demo", device="cpu").score(table)


def test_a_column_named_like_ours_in_another_case_is_warned_about(tmp_path: Path, source: pa.Table) -> None:
    """'Labels' is not 'labels': the run scores --labels and carries it, and says so (a rename reads it)."""
    n = source.num_rows
    table = source.rename_columns([c.upper() if c == "question_id" else c for c in source.column_names])
    pq.write_table(table.append_column("Labels", pa.array([["A", "B"]] * n)), tmp_path / "q.parquet")
    result = CliRunner().invoke(app, ["run", str(tmp_path / "q.parquet"), "--device", "cpu", "-o",
                                      str(tmp_path / "out.parquet")])
    assert result.exit_code == 0, result.stderr
    assert (f"warning: {tmp_path / 'q.parquet'}: column 'Labels' is not read as 'labels' (column names are "
            "case-sensitive); --labels-column Labels reads it") in result.stderr
    assert "column 'QUESTION_ID' is not read as 'question_id'" in result.stderr
    run_ok(tmp_path / "q.parquet", "-o", tmp_path / "renamed.parquet", "--labels-column", "Labels", "--overwrite")
    assert pq.read_table(tmp_path / "renamed.parquet").column("labels")[0].as_py() == ["A", "B"]
