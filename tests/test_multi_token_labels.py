"""Labels of several tokens: each scored by the sum of its tokens' log-probabilities given the prompt, along
branches that continue the question (kevscore.engine.label_scoring), against transformers on full sequences; labels
of one token keep the one-position path to the bit."""
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import both_paths, cpu_engine, labelled, sequence_reference, synthetic
from typer.testing import CliRunner

from kevscore.cli import app
from kevscore.engine.label_scoring import label_branches
from kevscore.engine.pipeline import Reporter, Scores
from kevscore.model.prompt import Encoded
from kevscore.reference import reference_model

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
GOLDEN = Path(__file__).resolve().parent / "data" / "single_token_scores.json"


def reference_rows(ckpt, enc: Encoded) -> list[tuple[list[float], float]]:
    return sequence_reference(reference_model(ckpt), enc)


def assert_matches(scores: Scores, reference) -> None:
    for r, (probs, mass) in enumerate(reference):
        assert scores.probs[r] == pytest.approx(probs, abs=1e-5), f"row {r}"
        assert scores.label_mass[r] == pytest.approx(mass, rel=1e-4), f"row {r}"
        assert sum(scores.probs[r]) == pytest.approx(1.0, abs=1e-12)


@pytest.fixture(scope="module")
def enc():
    # branches of 64 tokens and more: a continuation crosses the gated delta rule's 64-token chunks
    return labelled(synthetic([1, 63, 64, 65, 300], [1, 17, 63, 64, 130]))


@pytest.fixture(scope="module")
def reference(tiny, enc):
    return reference_rows(tiny, enc)


# ---------------------------------------------------------------- planning

@pytest.mark.parametrize("labels, branches, of_label", [
    ([(1,), (2,)], [()], [0, 0]),                                # one token each: the question alone
    ([(1,), (2, 3, 4)], [(2, 3)], [0, 0]),                       # a one-token label rides on any branch
    ([(1, 2), (1, 3)], [(1,)], [0, 0]),                          # the same tokens but the last: one branch
    ([(1, 2, 3), (1, 2), (1,), (4, 5)], [(1, 2), (4,)], [0, 0, 0, 1]),  # prefixes of a longer continuation
    ([(1, 2), (3, 4)], [(1,), (3,)], [0, 1]),
])
def test_label_branches(labels, branches, of_label):
    assert label_branches(labels) == (branches, of_label)


# ---------------------------------------------------------------- against transformers

@pytest.mark.parametrize("path", ["indexed", "gathered"])
def test_summed_log_probabilities_match_transformers_on_full_sequences(tiny, enc, reference, path):
    # 5 rows per batch: branches of several rows and documents, and of one row, share batches
    scores = cpu_engine(tiny, docs=enc.prefixes, max_rows=5).run(enc, path)
    assert_matches(scores, reference)
    assert len({round(p[0], 4) for p in scores.probs}) > 10  # rows really differ
    several = [r for r in range(len(enc)) if not enc.one_token_labels(r)]
    assert min(scores.label_mass[r] for r in several) < 1e-4  # random weights: mass is spread over the vocabulary


def test_paths_identical_and_bank_unchanged(tiny, enc):
    results = both_paths(cpu_engine(tiny, docs=enc.prefixes, max_rows=6), enc)
    assert results["indexed"].probs == results["gathered"].probs  # exact equality
    assert results["indexed"].label_mass == results["gathered"].label_mass


def test_rows_of_one_document_and_waves(tiny, enc, reference):
    """Every row of one document in one batch, and the bank smaller than the input (waves)."""
    assert_matches(cpu_engine(tiny, docs=enc.prefixes, max_rows=64).run(enc, "indexed"), reference)
    waves = cpu_engine(tiny, entries=2, tokens=400).run(enc, "indexed")
    assert waves.stats.waves == 3
    assert_matches(waves, reference)


def test_demo_labels_through_the_tokenizer(demo):
    """The demo model and tokenizer, labels as a user writes them: mixed, sharing prefixes, per row."""
    from kevscore.job.data import read_input
    from kevscore.model.prompt import encode, load_template

    table = read_input(EXAMPLES / "questions.parquet")
    choices = [["Yes", "No", "maybe"], ["Yes sir", "Yes", "No way"], ["No way", "No thanks", "Not at all"]]
    table.labels = [choices[r % 3] for r in range(len(table))]
    enc = encode(table, demo.tokenizer, load_template(None, demo.tokenizer), ["Yes", "No"], 4096)
    assert all(not enc.one_token_labels(r) for r in range(len(enc)))
    scores = {p: cpu_engine(demo, docs=enc.prefixes, max_rows=4).run(enc, p) for p in ("indexed", "gathered")}
    assert scores["indexed"].probs == scores["gathered"].probs
    assert_matches(scores["indexed"], reference_rows(demo, enc))


# ---------------------------------------------------------------- one token: the one-position path, bit for bit

@pytest.mark.parametrize("path", ["indexed", "gathered"])
def test_one_token_labels_keep_their_bits(demo, path, monkeypatch):
    """The demo task's examples with labels of one token (Yes/No, every third row three labels) give the bits
    the one-position path recorded (same torch, CPU capability and CPU model: two AVX512 CPUs of other models
    round fp32 otherwise, 7.6e-6 relative apart: another machine is held to 3e-5)."""
    from kevscore.engine.runner import EagerRunner
    from kevscore.job.data import read_input
    from kevscore.model.prompt import encode, load_template

    golden = json.loads(GOLDEN.read_text())
    table = read_input(EXAMPLES / "demo-task.parquet")
    table.labels = [["No", "Yes", " yes"] if r % 3 == 0 else ["Yes", "No"] for r in range(len(table))]
    enc = encode(table, demo.tokenizer, load_template(None, demo.tokenizer), ["Yes", "No"], 4096)
    assert enc.label_tails is None
    monkeypatch.setattr(EagerRunner, "token_scores", None)  # never reached: one position per row
    scores = cpu_engine(demo, docs=enc.prefixes, max_rows=7).run(enc, path)
    probs = [[float.fromhex(p) for p in row["probs"]] for row in golden["rows"]]
    mass = [float.fromhex(row["label_mass"]) for row in golden["rows"]]
    machine = (torch.__version__, torch.backends.cpu.get_cpu_capability(), cpu_model())
    if (golden["torch"], golden["cpu"], golden["cpu_model"]) == machine:
        assert scores.probs == probs and scores.label_mass == mass
    else:
        for a, b in zip(scores.probs + [scores.label_mass], probs + [mass]):
            assert a == pytest.approx(b, rel=3e-5, abs=1e-12)


def cpu_model() -> str:
    """The CPU's model name as Linux reports it ('' elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")


def test_rows_of_one_token_labels_keep_their_bits_beside_rows_of_several(tiny, enc):
    """Rows whose labels are one token each are batched among themselves, as in a job without the others."""
    one = [r for r in range(len(enc)) if enc.one_token_labels(r)]
    alone = Encoded(enc.prefixes, [enc.row_prefix[r] for r in one], [enc.branches[r] for r in one],
                    [enc.labels[r] for r in one], [enc.label_ids[r] for r in one])
    mixed = cpu_engine(tiny, docs=enc.prefixes, max_rows=5).run(enc, "indexed")
    single = cpu_engine(tiny, docs=enc.prefixes, max_rows=5).run(alone, "indexed")
    assert [mixed.probs[r] for r in one] == single.probs
    assert [mixed.label_mass[r] for r in one] == single.label_mass


# ---------------------------------------------------------------- faults

class Quiet(Reporter):
    """Counts the rows scored; keeps warnings off stderr."""
    done = 0

    def advance(self, phase, n):
        self.done += n if phase == "score" else 0

    def warn(self, message):
        pass


def test_out_of_memory_splits_branches_and_a_failing_branch_fails_its_row(tiny, enc, reference, monkeypatch):
    monkeypatch.setenv("KEVSCORE_TEST_OOM_ROWS", "2")
    split = cpu_engine(tiny, docs=enc.prefixes, max_rows=8).run(enc, "indexed", Quiet())
    assert split.stats.oom_retries > 0
    assert_matches(split, reference)

    monkeypatch.setenv("KEVSCORE_TEST_OOM_ROWS", "0")
    engine = cpu_engine(tiny, docs=enc.prefixes)
    engine.skip_failed = True
    progress = Quiet()
    scores = engine.run(enc, "indexed", progress)
    assert sorted(scores.failed) == list(range(len(enc)))
    assert all(p == [] for p in scores.probs)
    assert progress.done == len(enc)  # each row counted once, whatever its number of branches


# ---------------------------------------------------------------- the command line and compare

def test_cli_labels_column_of_mixed_labels(tmp_path, demo, example_rows):
    labels = [[["Yes", "No"], ["Yes", "No", "maybe"], ["No way", "Yes"]][i % 3] for i in range(len(example_rows))]
    src = tmp_path / "q.parquet"
    pq.write_table(pa.Table.from_pylist(example_rows).append_column("labels", pa.array(labels)), src)
    out = {}
    for path in ("indexed", "gathered"):
        result = CliRunner().invoke(app, ["run", str(src), "--device", "cpu", "--state-read", path,
                                          "-o", str(tmp_path / f"{path}.parquet")])
        assert result.exit_code == 0, result.stderr
        out[path] = pq.read_table(tmp_path / f"{path}.parquet").to_pylist()
    assert [r["probs"] for r in out["indexed"]] == [r["probs"] for r in out["gathered"]]
    assert [r["label_mass"] for r in out["indexed"]] == [r["label_mass"] for r in out["gathered"]]
    from kevscore.job.data import read_input
    from kevscore.model.prompt import encode, load_template

    enc = encode(read_input(src), demo.tokenizer, load_template(None, demo.tokenizer), ["Yes", "No"], 4096)
    reference = reference_rows(demo, enc)
    for r, row in enumerate(out["indexed"]):
        assert row["labels"] == labels[r]
        assert row["probs"] == pytest.approx(reference[r][0], abs=1e-5)
        assert row["label_mass"] == pytest.approx(reference[r][1], rel=1e-4)
        assert row["prediction"] == labels[r][max(range(len(labels[r])), key=row["probs"].__getitem__)]


def test_cli_too_long_counts_the_labels_tokens(tmp_path, demo, example_rows):
    """The streaming check counts a label's tokens but its last into the prompt, as `encode` does."""
    from kevscore.job.scan import scan_input
    from kevscore.job.tokens import measure_tokens
    from kevscore.model.prompt import load_template

    src = tmp_path / "q.parquet"
    pq.write_table(pa.Table.from_pylist(example_rows[:1]), src)
    template = load_template(None, demo.tokenizer)
    prompt = int(measure_tokens(scan_input(src), demo.tokenizer, template, ["Yes", "No"], 4096)[0].max()) + len(
        demo.tokenizer(template.branch(example_rows[0]["question"]), add_special_tokens=False)["input_ids"])
    extra = len(demo.tokenizer.encode("No way", add_special_tokens=False)) - 1
    measure_tokens(scan_input(src), demo.tokenizer, template, ["Yes", "No way"], prompt + extra)  # at the limit
    with pytest.raises(Exception, match=r"prompt \(document \+ question \+ label\) longer than the model's "
                                        rf"{prompt + extra - 1} positions at row 0 \(longest {prompt + extra} tokens"):
        measure_tokens(scan_input(src), demo.tokenizer, template, ["Yes", "No way"], prompt + extra - 1)


def test_compare_with_labels_of_several_tokens(tmp_path, example_rows):
    labels = [["Yes", "No", "maybe"] if i % 2 else ["Yes", "No"] for i in range(len(example_rows))]
    src = tmp_path / "q.parquet"
    pq.write_table(pa.Table.from_pylist(example_rows).append_column("labels", pa.array(labels)), src)
    args = ["compare", "--device", "cpu", "--reps", "1", "--warmup", "1", "--data", str(src), "--cases", "mixed"]
    result = CliRunner().invoke(app, [*args, "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["parity"] is True and report["cases"][0]["rows"] == len(example_rows)
    result = CliRunner().invoke(app, [*args, "--baseline", "hf"])
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == ("error: q.parquet: --baseline hf times labels of one token; labels of "
                                     "several tokens at rows 1, 3, 5, 7, 9, 11, 13")
