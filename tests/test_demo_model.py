"""The shipped demo model answers its task: examples/demo-task.parquet through `kevscore run` on the CPU,
both paths, and a bank-index fault that sends rows to another document's entry drops it to chance."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kevscore.cli import app
from kevscore.demo import train as demo_train
from kevscore.model import demo

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TASK = EXAMPLES / "demo-task.parquet"


def score(tmp_path: Path, name: str, *args: str) -> pa.Table:
    out = tmp_path / f"{name}.parquet"
    res = CliRunner().invoke(app, ["run", str(TASK), "-o", str(out), "--device", "cpu", "--quiet", *args])
    assert res.exit_code == 0, (res.stderr, res.exception)
    table = pq.read_table(out)
    assert table.column("row").to_pylist() == list(range(table.num_rows))
    return table


def accuracy(table) -> float:
    expected = pq.read_table(TASK, columns=["expected"]).column("expected").to_pylist()
    got = table.column("prediction").to_pylist()
    return sum(a == b for a, b in zip(got, expected)) / len(expected)


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    return score(tmp_path_factory.mktemp("indexed"), "indexed", "--path", "indexed")


def test_examples_file_is_the_generators_and_unseen() -> None:
    table = pq.read_table(TASK)
    rows = demo_train.example_rows()
    assert table.column("question").to_pylist() == [e.question for e in rows]
    assert table.column("document").to_pylist() == [e.document for e in rows]
    assert table.column("expected").to_pylist() == [e.answer for e in rows]
    # replay the shipped run's training stream: none of its documents is an example's
    report = json.loads((demo.TRAINED_DIR / "training.json").read_text())
    stream = demo_train.training_stream(report["steps"], report["batch"], report["pack"], report["seed"],
                                        tuple(report["families"]), report["curriculum"], report["start_vocabulary"])
    trained = {g[0].document for groups in stream for g in groups}
    assert len(trained) == report["training_documents"]
    assert not trained & {e.document for e in rows}


def test_shipped_weights_are_the_recorded_ones() -> None:
    report = json.loads((demo.TRAINED_DIR / "training.json").read_text())
    data = (demo.TRAINED_DIR / "model.safetensors").read_bytes()
    assert hashlib.sha256(data).hexdigest() == report["model_sha256"]
    built = demo.demo_checkpoint_dir() / "model.safetensors"
    assert built.read_bytes() == data


def test_demo_answers_the_examples_on_both_paths(indexed, tmp_path: Path) -> None:
    gathered = score(tmp_path, "gathered", "--path", "gathered")
    assert gathered.column("probs").to_pylist() == indexed.column("probs").to_pylist()
    assert accuracy(indexed) >= 0.95
    assert min(indexed.column("label_mass").to_pylist()) > 0.5  # it answers with the labels, not other tokens


def test_rows_reading_another_documents_entry_fall_to_chance(indexed, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEVSCORE_TEST_WRONG_ENTRY", "1")
    wrong = score(tmp_path, "wrong")
    assert 0.35 <= accuracy(wrong) <= 0.65 < accuracy(indexed)
