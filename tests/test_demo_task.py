"""The demo task generator, the training script's encoding, and the wrong-entry fault hook (CPU)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from kevscore.cli import app
from kevscore.demo import task as demo_task
from kevscore.demo import train as demo_train
from kevscore.model.checkpoint import load_checkpoint
from kevscore.model.prompt import encode, load_template


def test_examples_are_deterministic_and_balanced() -> None:
    a = demo_task.examples(3000, 7)
    assert a == demo_task.examples(3000, 7)
    assert a != demo_task.examples(3000, 8)
    counts = Counter((e.family, e.answer) for e in a)
    for family in demo_task.FAMILIES:
        yes, no = counts[family, "Yes"], counts[family, "No"]
        assert abs(yes - no) < 0.12 * (yes + no), (family, yes, no)
        assert 0.25 < (yes + no) / len(a) < 0.42


@pytest.mark.parametrize("seed", range(5))
def test_answers_follow_from_the_document(seed: int) -> None:
    """Recompute every answer from the document text alone."""
    for e in demo_task.examples(400, seed, per_document=3):
        words = e.document.replace(".", " ").split()
        if e.family == "mention":
            noun = e.question.split("the ")[-1].rstrip("?").split()[0]
            truth = noun in words
        elif e.family == "number":
            n = [w.rstrip("?") for w in e.question.split() if w.rstrip("?").isdigit()][0]
            truth = n in words
        else:
            a, b = [w.rstrip("?") for w in e.question.split() if w.rstrip("?") in demo_task.NOUNS]
            assert a in words and b in words
            truth = words.index(a) < words.index(b)
        assert e.answer == ("Yes" if truth else "No"), e


def test_nouns_are_single_tokens_and_not_in_the_fixed_sentences(demo) -> None:
    for noun in demo_task.NOUNS:
        assert len(demo.tokenizer.encode(" " + noun, add_special_tokens=False)) == 1, noun
        assert all(noun not in s.replace("{a}", "").replace("{b}", "").split() for s in demo_task.SENTENCES)


def test_training_encoding_is_the_runners(demo) -> None:
    """A group of one question is exactly the sequence `kevscore run` scores, answer position last."""
    tok = demo.tokenizer
    template = load_template(None, tok)
    rows = demo_task.examples(40, 3, per_document=2)
    answer_ids = {a: tok.convert_tokens_to_ids(a) for a in demo_task.ANSWERS}
    ids, positions, targets = demo_train.encode(tok, template, [[e] for e in rows], tok.pad_token_id, answer_ids)

    class Table:  # the fields prompt.encode reads from an InputTable
        documents = [e.document for e in rows]
        questions = [e.question for e in rows]
        labels = None
        sources = []

        def __len__(self):
            return len(rows)

    enc = encode(Table(), tok, template, ["Yes", "No"], 4096)
    for i, e in enumerate(rows):
        seq = enc.prefixes[enc.row_prefix[i]] + enc.branches[i]
        assert ids[i, : len(seq)].tolist() == seq
        assert positions[i, 0] == len(seq) - 1
        assert targets[i, 0] == answer_ids[e.answer]
    # packed: each later question follows the previous answer token
    groups = demo_train.group(rows)
    assert all(len(g) == 2 for g in groups)
    ids, positions, targets = demo_train.encode(tok, template, groups, tok.pad_token_id, answer_ids)
    for i, g in enumerate(groups):
        assert ids[i, positions[i, 0] + 1] == targets[i, 0]  # the first answer, then the second question
        assert ids[i, positions[i, 1]] == ids[i, positions[i, 0]]  # both branches end alike


def test_key_positions_hold_the_deciding_word(demo) -> None:
    tok = demo.tokenizer
    template = load_template(None, tok)
    answer_ids = {a: tok.convert_tokens_to_ids(a) for a in demo_task.ANSWERS}
    groups = demo_train.group(demo_task.examples(60, 5, per_document=3))
    ids, positions, targets = demo_train.encode(tok, template, groups, tok.pad_token_id, answer_ids, with_keys=True)
    for i, g in enumerate(groups):
        for k, e in enumerate(g):
            last, key = positions[i, 2 * k], positions[i, 2 * k + 1]
            word = e.question[: e.key_end].split()[-1]
            assert tok.decode(ids[i, key]).strip() == (word[-1] if word.isdigit() else word), e
            assert key < last and targets[i, 2 * k] == answer_ids[e.answer]
            assert targets[i, 2 * k + 1] == (-1 if e.family == "order" else answer_ids[e.answer])


def test_recall_batch_targets() -> None:
    import random

    from kevscore.model.checkpoint import load_checkpoint as load

    tok = load("demo").tokenizer
    answer_ids = {a: tok.convert_tokens_to_ids(a) for a in demo_task.ANSWERS}
    ids, targets = demo_train.recall_batch(tok, random.Random(0), answer_ids, 4)
    for row, tgt in zip(ids.tolist(), targets.tolist()):
        text, seen, answers = "", set(), []
        for t, y in zip(row, tgt):
            text += tok.decode([t])
            if y >= 0:
                word = text.split()[-1]
                answers.append(("Yes" if word in seen else "No", y))
                seen.add(word)
        assert len(answers) == 24 and all(answer_ids[a] == y for a, y in answers)
        assert 0 < sum(a == "Yes" for a, _ in answers) < 24


def test_training_runs_and_reproduces_its_weights(tmp_path: Path) -> None:
    """A few CPU steps, twice: the loss falls, the checkpoint loads, and a rerun writes the same bytes."""
    def run(name: str) -> dict:
        return demo_train.train(tmp_path / name, steps=10, batch=6, lr=3e-3, seed=0, device="cpu", eval_every=5,
                                validation=16, pack=2, recall_steps=3, log=lambda _: None)

    report = run("a")
    losses = [h["loss"] for h in report["history"]]
    assert losses[-1] < losses[0]
    assert report["validation_documents_seen_in_training"] == 0 and report["example_documents_seen_in_training"] == 0
    saved = json.loads((tmp_path / "a" / "training.json").read_text())
    assert saved["model_sha256"] == report["model_sha256"] and saved["steps_done"] == 10
    ckpt = load_checkpoint(str(tmp_path / "a"))
    assert torch.isfinite(ckpt.weights["model.embed_tokens.weight"]).all()
    assert run("b")["model_sha256"] == report["model_sha256"]


def test_wrong_entry_fault_reads_the_next_document(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the fault every row is scored exactly as its question asked about the next document."""
    rows = demo_task.examples(24, 11, per_document=3)
    docs = list(dict.fromkeys(e.document for e in rows))
    shifted = {d: docs[(i + 1) % len(docs)] for i, d in enumerate(docs)}
    src, moved = tmp_path / "q.parquet", tmp_path / "moved.parquet"
    pq.write_table(pa.table({"document": [e.document for e in rows], "question": [e.question for e in rows]}), src)
    pq.write_table(pa.table({"document": [shifted[e.document] for e in rows],
                             "question": [e.question for e in rows]}), moved)
    cli = CliRunner()

    def probs(path: Path, out: str) -> list[list[float]]:
        res = cli.invoke(app, ["run", str(path), "-o", str(tmp_path / out), "--device", "cpu", "--quiet",
                               "--batch-invariant"])
        assert res.exit_code == 0, (res.stderr, res.exception)
        return pq.read_table(tmp_path / out).column("probs").to_pylist()

    right = probs(src, "right.parquet")
    expected = probs(moved, "moved.scores.parquet")
    monkeypatch.setenv("KEVSCORE_TEST_WRONG_ENTRY", "1")
    wrong = probs(src, "wrong.parquet")
    assert wrong == expected
    assert wrong != right
