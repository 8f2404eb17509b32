import inspect
import os
import random
from pathlib import Path

# One torch thread in the tests and the processes they start (unless the caller chose): these small ops gain
# little from a second thread, and on a shared 2-core machine a second, spinning one made runs up to 10x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kevscore.engine.bank import BankLayout, StateBank
from kevscore.engine.pipeline import Engine, Scores
from kevscore.engine.runner import EagerRunner
from kevscore.kernels import torch_ops
from kevscore.model.checkpoint import Checkpoint, load_checkpoint, random_weights
from kevscore.model.kev import KevModel
from kevscore.model.prompt import Encoded


@pytest.fixture(scope="session")
def example_rows() -> list[dict]:
    """The rows of examples/questions.parquet."""
    import pyarrow.parquet as pq

    return pq.read_table(Path(__file__).resolve().parent.parent / "examples" / "questions.parquet").to_pylist()


@pytest.fixture(scope="session")
def demo():
    return load_checkpoint("demo")


@pytest.fixture(scope="session")
def tiny(demo):
    """A small random Kev model in fp32 (the demo's shape and tokenizer, other weights)."""
    return Checkpoint("tiny", demo.config, random_weights(demo.config, 0, torch.float32, "cpu"), demo.tokenizer)


def cpu_engine(ckpt, entries=None, tokens=None, max_rows=64, max_tokens=8192, docs=None):
    model = KevModel.from_weights(ckpt.config, ckpt.weights, torch_ops)
    if entries is None:
        layout = BankLayout.plan(ckpt.config, torch.float32, [len(d) for d in docs], 1 << 30)
    else:
        layout = BankLayout(entries, tokens)
    runner = EagerRunner(model, StateBank(ckpt.config, layout, "cpu", torch.float32), pad_id=0)
    return Engine(runner, max_rows=max_rows, max_tokens=max_tokens)


def gpu_engine(ckpt, docs, eager=False, max_rows=64, max_tokens=8192, entries=None, prefill_tokens=4096,
               dtype=torch.bfloat16):
    from kevscore.engine.cuda_runner import build_cuda_runner

    runner = build_cuda_runner(ckpt, torch.device("cuda"), [len(d) for d in docs], entries, eager, dtype)
    return Engine(runner, max_rows=max_rows, max_tokens=max_tokens, prefill_tokens=prefill_tokens)


def both_paths(engine, enc: Encoded) -> dict:
    """Prefill every document, then score every row through each state-read path: {path: Scores}. Asserts
    that scoring never writes the bank."""
    slot_of = engine.prefill_wave(enc, list(range(len(enc.prefixes))), Scores.empty(0).stats)
    before = [t.clone() for t in engine.runner.bank.used()]
    out = {}
    for path in ("gathered", "indexed"):
        out[path] = Scores.empty(len(enc))
        engine.score_rows(enc, list(range(len(enc))), slot_of, path, out[path])
        assert all(map(torch.equal, before, engine.runner.bank.used()))  # branches never write the bank
    return out


def synthetic(doc_lens, branch_lens, vocab=1000, seed=0, labels=(361, 383)) -> Encoded:
    """Every document gets one row per branch length, with random token ids."""
    rng = random.Random(seed)
    docs = [[rng.randrange(vocab) for _ in range(n)] for n in doc_lens]
    rows, branches = [], []
    for d in range(len(docs)):
        for n in branch_lens:
            rows.append(d)
            branches.append([rng.randrange(vocab) for _ in range(n)])
    n = len(branches)
    return Encoded(docs, rows, branches, [["Yes", "No"]] * n, [list(labels)] * n)


# Label sets (token ids) that `labelled` gives rows in turn: one token each (the one-position path); a label of
# three tokens beside one of one; labels sharing a prefix, one the prefix of another; labels sharing their first
# token only
LABEL_SETS = [
    [(361,), (383,)],
    [(361, 17, 905), (383,)],
    [(361, 17), (361, 17, 905), (361,), (44, 52, 9, 3)],
    [(12, 7), (12, 8), (99, 100, 101)],
]


def labelled(enc: Encoded, sets=LABEL_SETS) -> Encoded:
    """`enc` with row r labelled by sets[r % len(sets)] (token ids; labels of several tokens)."""
    from kevscore.model.prompt import first_and_tails

    pairs = [first_and_tails(sets[r % len(sets)]) for r in range(len(enc))]
    return Encoded(enc.prefixes, enc.row_prefix, enc.branches, [[f"l{j}" for j in range(len(f))] for f, _ in pairs],
                   [f for f, _ in pairs], [t for _, t in pairs])


@torch.no_grad()
def reference_scores(model, prefix: list[int], branch: list[int], label_ids: list[int]) -> tuple[list[float], float]:
    """transformers on the full sequence, the oracle of the scores: (softmax over the label logits,
    full-vocabulary mass of the labels) at the last position."""
    device = next(model.parameters()).device
    ids = torch.tensor([prefix + branch], device=device)
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].double()
    label = logits[label_ids]
    mass = torch.exp(torch.logsumexp(label, 0) - torch.logsumexp(logits, 0))
    return torch.softmax(label, 0).tolist(), float(mass)


@torch.no_grad()
def reference_sequence_scores(model, prefix: list[int], branch: list[int],
                              labels: list[list[int]]) -> tuple[list[float], float]:
    """Labels of any number of tokens, each on its own full sequence `prefix + branch + label[:-1]`: (softmax
    over the labels' summed token log-probabilities, the labels' total probability)."""
    device = next(model.parameters()).device
    summed = []
    for label in labels:
        ids = torch.tensor([prefix + branch + list(label[:-1])], device=device)
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(label)).logits[0].double()
        summed.append(torch.log_softmax(logits, -1)[range(len(label)), list(label)].sum())
    logprob = torch.stack(summed)
    return torch.softmax(logprob, 0).tolist(), float(torch.exp(torch.logsumexp(logprob, 0)))


def sequence_reference(model, enc: Encoded) -> list[tuple[list[float], float]]:
    """transformers' (probs, label mass) per row, each label of any length on its own full sequence."""
    return [reference_sequence_scores(model, enc.prefixes[enc.row_prefix[r]], enc.branches[r],
                                      [list(t) for t in enc.label_tokens(r)]) for r in range(len(enc))]


def material_masses(ckpt):
    """The example questions on the demo model (its chat template), each row labelled by two tokens that hold
    a material share of transformers' distribution at its last position: where the runner-up token has
    probability >= 1e-3, the runner-up and the third (mass 1e-3 to 0.5, the top token left out of the labels
    but in the vocabulary's log-sum-exp), else the top two (mass near 1). A row's labels are chosen by its
    probabilities, not its number: a confident model gives few rows a material runner-up.
    Returns the encoded rows and transformers' (probs, label mass) per row."""
    from pathlib import Path

    from kevscore.job.data import read_input
    from kevscore.model.prompt import encode, load_template
    from kevscore.reference import reference_model

    table = read_input(Path(__file__).resolve().parent.parent / "examples" / "questions.parquet")
    enc = encode(table, ckpt.tokenizer, load_template(None, ckpt.tokenizer), ["Yes", "No"],
                 ckpt.config.max_position_embeddings)
    model = reference_model(ckpt)
    refs = []
    for r in range(len(enc)):
        ids = torch.tensor([enc.prefixes[enc.row_prefix[r]] + enc.branches[r]])
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].double()
        top = torch.softmax(logits, 0).topk(3)
        enc.label_ids[r] = top.indices[1:].tolist() if top.values[1] >= 1e-3 else top.indices[:2].tolist()
        enc.labels[r] = [ckpt.tokenizer.decode([i]) for i in enc.label_ids[r]]
        refs.append(reference_scores(model, enc.prefixes[enc.row_prefix[r]], enc.branches[r], enc.label_ids[r]))
    return enc, refs


def transformers_states(ckpt, doc: list[int]) -> tuple[list, list, list]:
    """transformers' own cache after the document: per DeltaNet layer its recurrent state [HV, K, V] and its
    last k - 1 conv inputs [C, k - 1]; per attention layer its K/V [2, L, Hkv, D]."""
    from transformers import DynamicCache

    from kevscore.reference import reference_model

    model = reference_model(ckpt)
    cache = DynamicCache(config=model.config)
    keyword = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"  # 5.2x
    with torch.no_grad():
        model(input_ids=torch.tensor([doc]), **{keyword: cache}, use_cache=True)
    states, convs, kvs = [], [], []
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            states.append(layer.recurrent_states[0][0])
            convs.append(layer.conv_states[0][0][:, 1:])
        else:
            kvs.append(torch.stack([layer.keys[0], layer.values[0]]).transpose(1, 2))
    return states, convs, kvs


def with_oracle(ckpt, swap: str, enc) -> tuple[list, dict]:
    """The GPU engine's probabilities with the fla_ops functions of the A/B `swap` replaced by FLA's own
    (tests/fla_oracles.py; indexed), then with ours (both paths)."""
    from fla_oracles import swapped

    with swapped(swap):
        base = gpu_engine(ckpt, enc.prefixes, max_rows=8).run(enc, "indexed").probs
    return base, {p: gpu_engine(ckpt, enc.prefixes, max_rows=8).run(enc, p).probs for p in ("indexed", "gathered")}


def branch_inputs(rows, t, h, hv, dk, dv, dtype, seed):
    """q, k (l2-normalized), v, gate (a: a slice of a projection output), beta as `branch_conv` leaves them,
    a bank of fp32 states and slots as a strided upload-buffer column with repeated entries."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device="cuda")  # noqa: E731
    q, k = (torch.nn.functional.normalize(rand(rows, t, h, dk), dim=-1).to(dtype) for _ in range(2))
    v = rand(rows, t, hv, dv).to(dtype)
    beta = torch.rand(rows, t, hv, generator=gen, device="cuda").to(dtype)
    proj = (rand(rows, t, 2 * hv + 8) * 2).to(dtype)
    gate = (proj[..., 8: 8 + hv], rand(hv) * 0.5, rand(hv))
    bank = rand(7, hv, dk, dv) * 0.3
    upload = torch.randint(0, 1000, (rows, 9), device="cuda")
    upload[:, 3] = torch.tensor([(5 * r) % 7 if r % 3 else 1 for r in range(rows)], device="cuda")
    return q, k, v, gate, beta, bank, upload[:, 3]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
