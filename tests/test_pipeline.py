"""The CPU bank/branch pipeline against transformers on the full sequence, and its invariants."""
import dataclasses
import math

import pytest
import torch
from conftest import cpu_engine, material_masses, reference_scores, synthetic

from kevscore.engine.pipeline import Scores
from kevscore.model.checkpoint import Checkpoint, random_weights
from kevscore.reference import reference_model

DOC_LENS = [1, 63, 64, 65, 300]
BRANCH_LENS = [1, 17, 64, 65, 130]


@pytest.fixture(scope="module")
def enc():
    return synthetic(DOC_LENS, BRANCH_LENS)


@pytest.fixture(scope="module")
def reference(tiny, enc):
    model = reference_model(tiny)
    return [reference_scores(model, enc.prefixes[enc.row_prefix[r]], enc.branches[r], enc.label_ids[r])
            for r in range(len(enc))]


@pytest.mark.parametrize("path", ["indexed", "gathered"])
def test_probs_match_transformers_on_full_sequence(tiny, enc, reference, path):
    # 7 rows per batch: 25 rows do not divide evenly, and batches mix documents
    scores = cpu_engine(tiny, docs=enc.prefixes, max_rows=7).run(enc, path)
    for r, (probs, mass) in enumerate(reference):
        assert scores.probs[r] == pytest.approx(probs, abs=1e-5), f"row {r}"
        assert scores.label_mass[r] == pytest.approx(mass, rel=1e-4)
        assert sum(scores.probs[r]) == pytest.approx(1.0, abs=1e-12)
    assert len({round(p[0], 4) for p in scores.probs}) > 10  # rows really differ


@pytest.mark.parametrize("path", ["indexed", "gathered"])
def test_label_mass_matches_transformers_where_it_is_material(demo, path):
    enc, reference = material_masses(demo)
    masses = [mass for _, mass in reference]
    # every mass material, and in >= 3 rows below 0.5: there the labels leave out the top token (or it is below
    # 0.5), so the rest of the vocabulary holds > 1e-3 and a max for its log-sum-exp would be off by > rel 1e-3
    assert min(masses) > 1e-3 and max(masses) > 0.5 and sum(m < 0.5 for m in masses) >= 3
    scores = cpu_engine(demo, docs=enc.prefixes, max_rows=4).run(enc, path)
    for r, (probs, mass) in enumerate(reference):
        assert scores.probs[r] == pytest.approx(probs, abs=1e-5), f"row {r}"
        # fp32 on the CPU: kinds of CPU round otherwise (1.1e-5 seen on an AMD EPYC); a max in place of the
        # log-sum-exp would be off by > 1e-3
        assert scores.label_mass[r] == pytest.approx(mass, rel=5e-5), f"row {r}"


def test_paths_identical_and_bank_unchanged(tiny, enc):
    engine = cpu_engine(tiny, docs=enc.prefixes, max_rows=6)
    slot_of = engine.prefill_wave(enc, list(range(len(enc.prefixes))), Scores.empty(0).stats)
    before = [t.clone() for t in engine.runner.bank.used()]
    results = {}
    for path in ("gathered", "indexed", "gathered"):
        results[path] = Scores.empty(len(enc))
        engine.score_rows(enc, list(range(len(enc))), slot_of, path, results[path])
        assert all(map(torch.equal, before, engine.runner.bank.used()))  # question rows never write the bank
    assert results["indexed"].probs == results["gathered"].probs  # exact equality
    assert results["indexed"].label_mass == results["gathered"].label_mass


def test_each_document_prefilled_once(tiny):
    enc = synthetic([5, 40, 70], [3, 9, 20, 33, 50, 64])  # six questions per document
    engine = cpu_engine(tiny, docs=enc.prefixes, max_rows=4)
    calls = []
    original = engine.runner.prefill
    engine.runner.prefill = lambda docs, slots: (calls.extend(map(tuple, docs)), original(docs, slots))
    scores = engine.run(enc, "indexed")
    assert sorted(calls) == sorted(map(tuple, enc.prefixes))
    assert scores.stats.prefilled == 3 and scores.stats.rows == 18


def test_waves_when_bank_is_smaller_than_input(tiny, enc):
    full = cpu_engine(tiny, docs=enc.prefixes).run(enc, "indexed")
    waves = cpu_engine(tiny, entries=2, tokens=400).run(enc, "indexed")
    assert waves.stats.waves == 3
    for a, b in zip(full.probs, waves.probs):
        assert a == pytest.approx(b, abs=1e-5)  # other padding, other fp32 rounding


def test_last_layer_runs_only_at_the_scored_positions(tiny, monkeypatch):
    """The last layer's output projection and MLP see one position per row (its last) and never a prefill's
    tokens, and the scores equal those of running every position through the last layer and selecting
    afterwards."""
    from kevscore.model.kev import Block

    enc = synthetic([30, 64], [5, 17, 40])
    engine = cpu_engine(tiny, docs=enc.prefixes)
    shapes = []
    engine.runner.model.layers[-1].mlp.register_forward_hook(lambda mod, args, out: shapes.append(args[0].shape))
    kept = engine.run(enc, "indexed").probs
    assert shapes and all(len(s) == 2 for s in shapes)  # [rows, hidden]: no token axis left, no prefill
    assert sum(s[0] for s in shapes) >= len(enc)

    full_forward = Block.forward

    def select_after(self, hidden, ctx, cos, sin, keep=None):
        hidden = full_forward(self, hidden, ctx, cos, sin)
        return hidden if keep is None else hidden[keep]

    monkeypatch.setattr(Block, "forward", select_after)
    full = cpu_engine(tiny, docs=enc.prefixes).run(enc, "indexed").probs
    assert max(abs(a - b) for ra, rb in zip(kept, full) for a, b in zip(ra, rb)) < 1e-5


@pytest.mark.parametrize("last_kind", ["full_attention", "linear_attention"])
def test_a_prefills_last_layer_writes_the_same_entries_alone(tiny, last_kind, monkeypatch):
    """A prefill's last layer writes its bank entry and computes nothing after it (attention projects only k
    and v): the entries equal those of the whole layer's forward, for either kind of last layer."""
    from kevscore.model.kev import Block

    types = tiny.config.layer_types
    cut = max(i for i, kind in enumerate(types) if kind == last_kind) + 1
    cfg = dataclasses.replace(tiny.config, layer_types=types[:cut])
    ckpt = Checkpoint("cut", cfg, random_weights(cfg, 1, torch.float32, "cpu"), tiny.tokenizer)
    enc = synthetic([7, 30, 64], [5])

    def bank():
        engine = cpu_engine(ckpt, docs=enc.prefixes)
        engine.prefill_wave(enc, list(range(len(enc.prefixes))), Scores.empty(0).stats)
        return engine.runner.bank

    alone = bank()
    monkeypatch.setattr(Block, "write_bank", lambda self, hidden, ctx, cos, sin: self(hidden, ctx, cos, sin))
    whole = bank()
    for name in ("state", "conv", "kv"):
        a, b = getattr(alone, name), getattr(whole, name)
        assert a.abs().max() > 0 and torch.allclose(a, b, rtol=1e-5, atol=1e-6), (name, (a - b).abs().max())


def test_branches_past_one_chunk_pad_by_less_than_8_tokens():
    """Branch lengths pad to the ladder up to 64 tokens, to a multiple of 8 through 128 (the second chunk, where
    most templated questions fall), and batches of sorted rows take their longest row's bucket."""
    from kevscore.engine.plan import ladder, length_bucket, plan_batches

    buckets = [length_bucket(n) for n in range(1, 400)]
    assert all(b >= n for n, b in enumerate(buckets, 1)) and buckets == sorted(buckets)
    assert all(length_bucket(n) == ladder(n) for n in (*range(1, 65), *range(129, 400)))
    assert all(b % 8 == 0 and b - n < 8 for n, b in enumerate(buckets, 1) if 64 < n <= 128)
    lengths = [70, 71, 79, 83, 85, 86, 96, 97]
    batches = plan_batches(list(range(8)), lengths, [1700] * 8, max_rows=2, max_tokens=1 << 20)
    assert [b.length for b in batches] == [72, 88, 88, 104]


def test_a_batch_of_eager_size_keeps_its_own_shape():
    """A batch whose padded size comes to `exact_from` tokens or more is planned at its rows' own count and longest
    length (rounded up to even) and marked exact (it runs eagerly, with no graph); a smaller one keeps its graph
    bucket, and so does every batch by default."""
    from kevscore.engine.plan import plan_batches

    for lengths, rows, exact in (([121] * 64, 64, True), ([121] * 47, 48, False), ([70] * 3 + [85] * 90, 93, True),
                                 ([85] * 50, 64, False)):
        ids, prefix = list(range(len(lengths))), [1700] * len(lengths)
        batch, = plan_batches(ids, lengths, prefix, max_rows=128, max_tokens=1 << 20, exact_from=64 * 128)
        assert batch.exact == exact, lengths
        if exact:
            assert (batch.size, batch.length) == (len(lengths), max(lengths) + 1)
        else:
            assert (batch.size, batch.length) == (rows, 128 if lengths[0] == 121 else 88)
        assert not plan_batches(ids, lengths, prefix, max_rows=128, max_tokens=1 << 20)[0].exact


def test_the_eager_size_follows_the_models_work_per_layer():
    """A GPU runs a batch eagerly from a fixed amount of weight-matmul work a layer: a wide model from fewer tokens
    than a narrow one, in inverse proportion to its weights a layer."""
    from kevscore.engine.plan import EAGER_LAYER_FLOPS, eager_tokens

    narrow, wide = eager_tokens(20.75e6), eager_tokens(111.6e6)  # Kev-0.8B's and Kev-4B's weights a layer
    assert 8192 < narrow < 16384 and 1024 < wide < 4096
    assert 2 * 111.6e6 * wide >= EAGER_LAYER_FLOPS > 2 * 111.6e6 * (wide - 1)
    assert narrow / wide == pytest.approx(111.6 / 20.75, rel=1e-3)


def test_the_cpu_runs_every_batch_at_its_own_shape(tiny, enc, monkeypatch):
    """A CPU runner has no graphs and no warm-up to match: every batch is planned at its rows' own count and
    (even) longest length, and scores as the padded buckets do, to fp32 rounding."""
    engine = cpu_engine(tiny, docs=enc.prefixes, max_rows=7)
    assert engine.runner.exact_from == 0
    shapes, score = [], engine.runner.score
    monkeypatch.setattr(engine.runner, "score", lambda batch, branches, *rest: (
        shapes.append((batch.exact, batch.size, batch.length, len(branches), max(map(len, branches)))),
        score(batch, branches, *rest))[1])
    exact = engine.run(enc, "indexed").probs
    assert shapes and all(e and size == n and length == longest + longest % 2 for e, size, length, n, longest in shapes)
    shapes.clear()
    engine.runner.exact_from = math.inf  # as a GPU plans these small batches: padded to their buckets
    padded = engine.run(enc, "indexed").probs
    assert not any(e for e, *_ in shapes) and any(size > n or length > longest for _, size, length, n, longest in shapes)
    for a, b in zip(exact, padded):
        assert a == pytest.approx(b, abs=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_a_model_is_built_without_the_process_wide_default_dtype(tiny, monkeypatch, tied):
    """The warm-up builds its model on a thread while the job builds its own: torch's default dtype is
    process-wide, so building one must not set it. Parameters come in the model's dtype (norm scales and the
    decay's in fp32), on the model's device, and the embedding stays tied to the head."""
    from kevscore.kernels import torch_ops
    from kevscore.model.kev import FP32_PARAMS, KevModel

    def refuse(dtype):
        raise AssertionError(f"set_default_dtype({dtype}) while building a model")

    monkeypatch.setattr(torch, "set_default_dtype", refuse)
    cfg = dataclasses.replace(tiny.config, tie_word_embeddings=tied)
    weights = random_weights(cfg, 0, torch.bfloat16, "cpu")
    model = KevModel.from_weights(cfg, weights, torch_ops, torch.bfloat16, "cpu")
    for name, param in model.named_parameters():
        assert param.device.type == "cpu"
        assert param.dtype == (torch.float32 if name.endswith(FP32_PARAMS) else torch.bfloat16), name
    assert (model.lm_head is model.embed) == tied
    assert torch.equal(model.embed, weights["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head, weights["lm_head.weight"])
    assert model.rotary.inv_freq.dtype == torch.float32 and model.rotary.inv_freq.isfinite().all()


def test_building_a_model_imports_no_compiler_stack():
    """Built on the meta device, a model's construction must stay plain tensor code: an op that torch runs
    through its Python references there (arange, empty_like, to_empty) imports torch._dynamo or sympy, seconds
    on a job's start."""
    import subprocess
    import sys

    code = ("import dataclasses, sys, torch\n"
            "from kevscore.kernels import torch_ops\n"
            "from kevscore.model.checkpoint import random_weights\n"
            "from kevscore.model.config import SHAPES\n"
            "from kevscore.model.kev import KevModel\n"
            "cfg = dataclasses.replace(SHAPES['kev-0.8b'], vocab_size=512)\n"
            "KevModel.from_weights(cfg, random_weights(cfg, 0, torch.bfloat16, 'cpu'), torch_ops, torch.bfloat16)\n"
            "print([m for m in ('torch._dynamo', 'sympy') if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
