"""Provenance: a Parquet output records how it was made, and `kevscore info` prints it (80 columns, or JSON)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rich.console import Console
from typer.testing import CliRunner

from kevscore.cli import app
from kevscore.display import provenance_table
from kevscore.job.options import RunOptions
from kevscore.job.provenance import output_provenance
from kevscore.job.run import run_job

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "demo-task.parquet"


def scored(tmp_path: Path, suffix: str = ".parquet", **options) -> Path:
    src = tmp_path / "q.parquet"
    shutil.copy(EXAMPLE, src)
    out = tmp_path / f"out{suffix}"
    run_job(RunOptions(input=src, output=out, device="cpu", limit=12, **options))
    return out


def test_an_output_records_how_it_was_made(tmp_path):
    out = scored(tmp_path, labels=["No", "Yes"], batch_rows=5)
    record = output_provenance(out)
    assert record["kevscore"] and record["dtype"] == "float32" and len(record["job"]) == 64
    assert record["input"]["name"] == "q.parquet" and len(record["input"]["sha256"]) == 64
    assert record["model"]["name"] == "demo" and record["model"]["fingerprint"]
    opts = record["options"]
    assert (opts["device"], opts["state_read"], opts["labels"], opts["batch_rows"], opts["limit"]) == \
        ("cpu", "indexed", ["No", "Yes"], 5, 12)
    assert record["plan"]["rows"] == 12
    # the metadata keys are part of the file format: outputs of earlier versions must stay readable

    meta = pq.read_schema(out).metadata
    assert meta[b"kevscore.job"].decode() == record["job"] and b"kevscore.provenance" in meta


def test_info_prints_it_at_80_columns_or_as_json(tmp_path):
    out = scored(tmp_path)
    res = CliRunner().invoke(app, ["info", str(out)])
    assert res.exit_code == 0, res.output
    assert "q.parquet" in res.output and "demo" in res.output and "'Yes', 'No'" in res.output
    console = Console(width=80, record=True)
    console.print(provenance_table(output_provenance(out)))
    text = console.export_text()
    assert "…" not in text and max(len(line.rstrip()) for line in text.splitlines()) <= 80
    res = CliRunner().invoke(app, ["info", str(out), "--json"])
    assert res.exit_code == 0 and json.loads(res.output) == output_provenance(out)


def test_info_shows_control_characters_in_recorded_names_escaped(tmp_path):
    record = output_provenance(scored(tmp_path))
    record["input"]["name"] = "q\x1b[2J[bold].parquet"  # a file name with a terminal code and rich markup
    console = Console(width=80, record=True)
    console.print(provenance_table(record))
    text = console.export_text()
    assert "\x1b" not in text and "q\\x1b[2J[bold].parquet" in text


@pytest.mark.parametrize("record", ['[]', '"x"', '{"options": 5}', 'not json'])
def test_info_on_a_record_kevscore_did_not_write_is_one_line(tmp_path, record):
    table = pq.read_table(scored(tmp_path))
    pq.write_table(table.replace_schema_metadata({b"kevscore.provenance": record.encode()}), tmp_path / "odd.parquet")
    res = CliRunner().invoke(app, ["info", str(tmp_path / "odd.parquet")])
    assert res.exit_code == 2 and res.stderr.strip() == \
        f"error: {tmp_path / 'odd.parquet'}: its kevscore.provenance record is not one kevscore writes", res.stderr
    record = output_provenance(scored(tmp_path, suffix=".x.parquet"))
    record["options"]["labels"] = None
    console = Console(width=80, record=True)
    console.print(provenance_table(record))  # what a record of fewer fields shows: nothing, not an error
    assert "labels" in console.export_text()


@pytest.mark.parametrize("damage, what", [
    (lambda r: r["input"].pop("sha256"), "input"), (lambda r: r.update(documents=["x"]), "documents"),
    (lambda r: r["plan"].update(rows="many"), "plan rows"), (lambda r: r["options"].update(labels=5), "labels")])
def test_info_on_a_damaged_record_is_one_line(tmp_path, damage, what):
    out = scored(tmp_path)
    table = pq.read_table(out)
    record = json.loads(table.schema.metadata[b"kevscore.provenance"])
    damage(record)
    meta = table.schema.metadata | {b"kevscore.provenance": json.dumps(record).encode()}
    pq.write_table(table.replace_schema_metadata(meta), tmp_path / "odd.parquet")
    res = CliRunner().invoke(app, ["info", str(tmp_path / "odd.parquet")])
    assert res.exit_code == 2 and res.stderr.strip() == \
        f"error: {tmp_path / 'odd.parquet'}: its kevscore.provenance record is damaged ({what})", res.stderr


def test_info_on_other_files_is_one_line(tmp_path):
    csv = scored(tmp_path, suffix=".csv")
    for path, words in ((csv, "only Parquet outputs record"), (EXAMPLE, "records no provenance"),
                        (Path(__file__), "not a readable Parquet file"), (tmp_path / "none.parquet", "")):
        res = CliRunner().invoke(app, ["info", str(path)])
        assert res.exit_code == 2, (path, res.output)
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], res.output
