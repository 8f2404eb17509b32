"""The transformers baselines compute kevscore's probabilities, and the prefix-cached one prefills each
document once."""
import importlib.util
import random
from pathlib import Path

import pytest
import torch
from conftest import cpu_engine, reference_scores

from kevscore.baselines import length_batches, naive_call
from kevscore.model.prompt import Encoded
from kevscore.reference import reference_model

# the prefix-cached baseline lives with the benchmark that times it (benchmarks/ is not a package)
_spec = importlib.util.spec_from_file_location("bench_job", Path(__file__).parent.parent / "benchmarks" / "bench_job.py")
bench_job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_job)
prefix_cached_call = bench_job.prefix_cached_call

# per document its question lengths: one-token questions, a document of one question, one whose
# questions are all a single token (the cache's decode path), and one with more questions than a batch
QUESTIONS = {1: [1, 5, 20], 40: [7], 97: [1, 3, 30, 64, 65], 150: [1, 1]}
BATCH = 3
BASELINES = {"naive": naive_call, "prefix-cached": prefix_cached_call}


@pytest.fixture(scope="module")
def enc():
    rng = random.Random(0)
    docs, rows, branches, label_ids = [], [], [], []
    for d, (doc_len, lens) in enumerate(QUESTIONS.items()):
        docs.append([rng.randrange(1000) for _ in range(doc_len)])
        for n in lens:
            rows.append(d)
            branches.append([rng.randrange(1000) for _ in range(n)])
            label_ids.append([361, 383] if n % 2 else [361, 383, 10])  # rows of 2 and 3 labels
    return Encoded(docs, rows, branches, [["x"] * len(x) for x in label_ids], label_ids)


@pytest.fixture(scope="module")
def model(tiny):
    return reference_model(tiny)


@pytest.fixture(scope="module")
def reference(model, enc):
    return [reference_scores(model, enc.prefixes[enc.row_prefix[r]], enc.branches[r], enc.label_ids[r])[0]
            for r in range(len(enc))]


def probs_lists(logits, enc, rows):
    p = torch.softmax(logits.double(), -1)  # over each row's label logits (0 past its own labels)
    return [p[i, :len(enc.label_ids[r])].tolist() for i, r in enumerate(rows)]


@pytest.mark.parametrize("name", list(BASELINES))
def test_probs_equal_transformers_and_kevscore(tiny, model, enc, reference, name):
    logits = BASELINES[name](model, enc, "cpu", BATCH)()
    assert logits.dtype == torch.float32 and logits.shape == (len(enc), 3)
    assert torch.isinf(logits[[r for r in range(len(enc)) if len(enc.label_ids[r]) == 2], 2]).all()
    kevscore = cpu_engine(tiny, docs=enc.prefixes, max_rows=4).run(enc, "indexed").probs
    for r, probs in enumerate(probs_lists(logits, enc, range(len(enc)))):
        assert probs == pytest.approx(reference[r], abs=1e-5), f"row {r}"
        assert probs == pytest.approx(kevscore[r], abs=1e-5), f"row {r}"
    assert len({round(p[0], 4) for p in probs_lists(logits, enc, range(len(enc)))}) > 5  # rows really differ


def test_prefix_cached_prefills_each_document_once(model, enc):
    prefills, continued = [], []

    def hook(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        ids = kwargs["input_ids"]
        if cache.get_seq_length() == 0:
            prefills.append(tuple(ids[0].tolist()))
            assert ids.shape[0] == 1
        else:
            continued.append(ids.shape[0])

    handle = model.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        prefix_cached_call(model, enc, "cpu", BATCH)()
    finally:
        handle.remove()
    assert sorted(prefills) == sorted(map(tuple, enc.prefixes))
    assert continued == [3, 1, 3, 2, 2]  # a document's questions in batches of at most 3, each row once


@pytest.mark.parametrize("call", [naive_call, prefix_cached_call])
def test_a_sample_of_rows_in_its_order(model, enc, reference, call):
    rows = [9, 0, 4, 3, 10]
    probs = probs_lists(call(model, enc, "cpu", 2, rows)(), enc, rows)
    for i, r in enumerate(rows):
        assert probs[i] == pytest.approx(reference[r], abs=1e-5)


def test_length_batches_longest_first():
    assert length_batches([3, 9, 1, 9, 4], 2) == [[1, 3], [4, 0], [2]]
    assert length_batches([], 4) == []


def whole_documents(enc: Encoded, rows: int, seed: int = 0) -> list[int]:
    """Rows of randomly chosen documents, every question of each, until at least `rows` rows (a sample the
    prefix-cached baseline can run without prefilling a document for a part of its questions)."""
    by_doc: dict[int, list[int]] = {}
    for r, d in enumerate(enc.row_prefix):
        by_doc.setdefault(d, []).append(r)
    docs = list(by_doc)
    random.Random(seed).shuffle(docs)
    out: list[int] = []
    for d in docs:
        if len(out) >= rows:
            break
        out.extend(by_doc[d])
    return sorted(out)


def test_whole_documents_keeps_every_question(enc):
    rows = whole_documents(enc, 4, seed=1)
    docs = {enc.row_prefix[r] for r in rows}
    assert len(rows) >= 4 and rows == sorted(rows)
    assert rows == [r for r in range(len(enc)) if enc.row_prefix[r] in docs]
    assert whole_documents(enc, 100) == list(range(len(enc)))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_baselines_on_cuda_close_to_cpu(tiny, enc, reference):
    """In bf16 on the GPU (transformers routes to FLA there), as close to the CPU fp32 probabilities as
    transformers' own bf16 forward of each full sequence."""
    gpu = reference_model(tiny, device="cuda", dtype=torch.bfloat16)
    theirs = max(max(abs(a - b) for a, b in zip(reference_scores(gpu, enc.prefixes[enc.row_prefix[r]],
                                                                 enc.branches[r], enc.label_ids[r])[0], reference[r]))
                 for r in range(len(enc)))
    for name, call in BASELINES.items():
        logits = call(gpu, enc, "cuda", BATCH)()
        assert logits.device.type == "cuda" and logits.dtype == torch.float32
        ours = max(max(abs(a - b) for a, b in zip(p, reference[r]))
                   for r, p in enumerate(probs_lists(logits, enc, range(len(enc)))))
        print(f"{name}: max |p - p_cpu| {ours:.4g}, transformers bf16 {theirs:.4g}")
        assert ours <= 2 * theirs + 0.01, name
