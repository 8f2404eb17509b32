"""Labels that cannot silently go wrong: `--labels` parsing, at least two labels, label mass in the summary."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kevscore.cli import app
from kevscore.errors import KevscoreError
from kevscore.job.labels import LabelTally, low_mass_warning, parse_labels

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def kevscore(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture
def questions(tmp_path: Path) -> Path:
    return Path(shutil.copy(EXAMPLES / "questions.parquet", tmp_path / "questions.parquet"))


@pytest.mark.parametrize("text, labels", [
    ("Yes,No", ["Yes", "No"]), ("Yes, No", ["Yes", "No"]), (" Yes ,  No ", ["Yes", "No"]),
    ('" Yes"," No"', [" Yes", " No"]), ('"a,b", c', ["a,b", "c"]), ("Yes,", ["Yes", ""]), ("Yes", ["Yes"]),
    ('["Yes", " No", "a,b"]', ["Yes", " No", "a,b"]), (' ["A"]', ["A"]), ("[A],[B]", ["[A]", "[B]"]),
])
def test_parse_labels(text: str, labels: list[str]) -> None:
    assert parse_labels(text) == labels


@pytest.mark.parametrize("text", ['"Yes,No', '"Yes"x,No'])
def test_parse_labels_refuses_broken_quotes(text: str) -> None:
    with pytest.raises(KevscoreError, match="quote"):
        parse_labels(text)


@pytest.mark.parametrize("text", ['["Yes", 3]', "[null]", '[["Yes"]]'])
def test_parse_labels_refuses_a_json_array_of_other_than_strings(text: str) -> None:
    with pytest.raises(KevscoreError, match="a JSON array, but not of strings"):
        parse_labels(text)


def test_spaces_around_labels_are_dropped(questions: Path, tmp_path: Path) -> None:
    plain, spaced = tmp_path / "plain.parquet", tmp_path / "spaced.parquet"
    assert kevscore("run", questions, "--device", "cpu", "-o", plain, "--quiet").exit_code == 0
    result = kevscore("run", questions, "--device", "cpu", "-o", spaced, "--quiet", "--labels", "Yes, No")
    assert result.exit_code == 0, result.stderr
    a, b = pq.read_table(plain), pq.read_table(spaced)
    assert b.column("labels").to_pylist() == [["Yes", "No"]] * a.num_rows
    assert b.column("probs").to_pylist() == a.column("probs").to_pylist()


def test_quoted_labels_keep_their_spaces(questions: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.parquet"
    result = kevscore("run", questions, "--device", "cpu", "-o", out, "--quiet", "--labels", '" Yes"," No"')
    assert result.exit_code == 0, result.stderr
    assert pq.read_table(out).column("labels").to_pylist()[0] == [" Yes", " No"]


def test_one_label_is_refused(questions: Path) -> None:
    result = kevscore("run", questions, "--device", "cpu", "--labels", "Yes")
    assert result.exit_code == 2 and "at least two labels" in result.stderr, result.stderr
    assert not (questions.parent / "questions.scores.parquet").exists()


def test_one_label_in_the_labels_column_is_refused(tmp_path: Path) -> None:
    table = pq.read_table(EXAMPLES / "questions.parquet")
    labels = [["Yes", "No"]] * table.num_rows
    labels[3] = ["Yes"]
    path = tmp_path / "q.parquet"
    pq.write_table(table.append_column("labels", pa.array(labels)), path)
    result = kevscore("run", path, "--device", "cpu")
    assert result.exit_code == 2, result.stderr
    assert "column 'labels'" in result.stderr and "single-label lists at row 3" in result.stderr


def test_summary_shows_label_mass_and_predictions(questions: Path) -> None:
    result = kevscore("run", questions, "--device", "cpu")
    assert result.exit_code == 0, result.stderr
    out = pq.read_table(questions.parent / "questions.scores.parquet")
    counts = {p: out.column("prediction").to_pylist().count(p) for p in ("Yes", "No")}
    assert "label mass" in result.stderr and "median" in result.stderr
    assert f"Yes {counts['Yes']}" in result.stderr and f"No {counts['No']}" in result.stderr
    assert "warning" not in result.stderr


def test_wrong_case_labels_warn(questions: Path) -> None:
    result = kevscore("run", questions, "--device", "cpu", "--labels", "yes,no", "--log-json")
    assert result.exit_code == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    warning = [e for e in events if e["event"] == "warning"]
    assert len(warning) == 1 and "leading spaces" in warning[0]["message"]
    done = events[-1]
    assert done["event"] == "done" and done["label_mass_median"] < 1e-3 and done["low_mass_rows"] == done["rows"]
    assert sum(done["predictions"].values()) == done["rows"]
    assert "warning: the labels ('yes', 'no' unless" in result.stderr


def test_low_mass_warning_needs_most_rows() -> None:
    tally = LabelTally()
    probs = [[0.6, 0.4], [0.3, 0.7], [0.9, 0.1], [0.8, 0.2]]
    tally.add(pa.table({"prediction": ["a", "b", "a", "a"], "probs": probs, "label_mass": [0.01, 0.02, 0.9, 0.95]}))
    summary = tally.summary()
    assert summary["predictions"] == {"a": 3, "b": 1} and summary["low_mass_rows"] == 2
    assert summary["label_mass_min"] == pytest.approx(0.01) and low_mass_warning(summary, 4, ["a", "b"]) is None
    tally.add(pa.table({"prediction": ["a"], "probs": [[0.5, 0.5]], "label_mass": [0.001]}))
    assert "on 3 of 5 rows" in low_mass_warning(tally.summary(), 5, ["a", "b"])
    many = low_mass_warning(tally.summary(), 5, [f"L{i}" for i in range(1000)])  # the first few named, not all
    assert "the labels ('L0', 'L1', 'L2', 'L3', 'L4', … (1000 labels) unless" in many and "'L5'" not in many


def test_non_finite_probabilities_are_counted_not_predicted(questions: Path, tmp_path: Path) -> None:
    """A model producing NaN (NaN embedding weights): each row's prediction null, the rows counted and warned
    about, the label mass statistics over the finite rows only (none here)."""
    import torch
    from safetensors.torch import load_file, save_file

    from kevscore.model.demo import demo_checkpoint_dir
    model = Path(shutil.copytree(demo_checkpoint_dir(), tmp_path / "nan-model"))
    weights = load_file(model / "model.safetensors")
    weights["model.embed_tokens.weight"] = torch.full_like(weights["model.embed_tokens.weight"], float("nan"))
    save_file(weights, model / "model.safetensors")
    result = kevscore("run", questions, "--device", "cpu", "--model", model, "--log-json")
    assert result.exit_code == 0, result.stderr
    out = pq.read_table(questions.parent / "questions.scores.parquet")
    assert out.num_rows > 0 and set(out.column("prediction").to_pylist()) == {None}
    done = json.loads(result.stdout.splitlines()[-1])
    assert done["non_finite_rows"] == out.num_rows and done["label_mass_min"] is None and done["predictions"] == {}
    assert f"{out.num_rows} rows have non-finite probabilities (the model produced NaN/inf)" in result.stderr


def test_non_finite_rows_leave_the_label_mass_statistics() -> None:
    tally = LabelTally()
    tally.add(pa.table({"prediction": [None, "a", None], "probs": [[float("nan")] * 2, [0.9, 0.1], [0.0, float("inf")]],
                        "label_mass": [float("nan"), 0.05, 0.5]}))
    summary = tally.summary()
    assert summary["non_finite_rows"] == 2 and summary["label_mass_min"] == pytest.approx(0.05)
    assert summary["predictions"] == {"a": 1} and summary["low_mass_rows"] == 1
    assert low_mass_warning(summary, 3, ["a", "b"]).startswith("2 rows have non-finite probabilities")
