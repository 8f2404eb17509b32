"""Train the built-in demo model on the demo task (`kevscore.demo.task`), reproducibly from a seed.

    python -m kevscore.demo.train --out /tmp/demo-trained      # the shipped weights: ~55 min on 2 CPU cores
    python -m kevscore.demo.train --out /tmp/smoke --steps 20 --recall-steps 10    # a smoke run

It starts from deterministic initial weights made here (`demo_weights`: SplitMix64 over seed, tensor name
and element index; with long-memory DeltaNet decays) and trains transformers' Qwen3_5ForCausalLM (the Kev architecture) with
AdamW: first a dense recall warm-up ("did this word occur before?"), then freshly generated task
examples (`--pack` questions per document, documents and noun vocabulary growing over a curriculum),
with the loss on the answer token ("Yes" / "No" after the prompt kevscore itself builds: prefix and
branch tokenized separately, exactly as the runner does) and on the same answer at the question's key
word. It writes a complete checkpoint directory (config, fp32 safetensors, tokenizer) plus
`training.json`: the options, the loss and validation accuracy per family along the way, and how many
validation and example documents also occurred in training (expected: none). docs/demo-training.md says
why each piece is there.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import random
import shutil
import struct
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kevscore.demo import task as demo_task
from kevscore.durable import file_sha256
from kevscore.kernels import gdr_ref
from kevscore.model import demo
from kevscore.model.config import FULL, LINEAR, KevConfig, weight_shapes

SMALL = dataclasses.replace(demo.DEMO_CONFIG, hidden_size=64, intermediate_size=128,
                            layer_types=(LINEAR, LINEAR, LINEAR, FULL), num_attention_heads=2, num_key_value_heads=1,
                            linear_num_key_heads=1, linear_num_value_heads=2)
VALIDATION_SEED = 1 << 40   # validation examples; training seeds are seed * 2**20 + step, far below
EXAMPLES_SEED = 1 << 41     # examples/demo-task.parquet (see examples/make_demo_task.py)
SHIPPED_FAMILIES = ("mention", "number")  # what the shipped demo was trained on (`order` is not learnt yet)
EXAMPLE_ROWS, EXAMPLE_PER_DOCUMENT = 200, 4


# ---------------------------------------------------------------- initial weights

SEED = 0x4B657653636F7265  # "KevScore": the initial weights' seed
LN_16 = 2.772588722239781  # log(16), written out so no libm is involved


def tied_weight_shapes(cfg: KevConfig) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of transformers' Qwen3_5ForCausalLM (tied embeddings: no lm_head)."""
    shapes = weight_shapes(cfg)
    if cfg.tie_word_embeddings:
        del shapes["lm_head.weight"]
    return shapes


def uniform(seed: int, name: str, size: int) -> np.ndarray:
    """`size` floats uniform in [-1, 1) from SplitMix64 of (seed, sha256(name), index); exact in fp32."""
    key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    z = np.arange(1, size + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed ^ key)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(40)).astype(np.float64) / float(1 << 23) - 1.0


def _init(name: str, shape: tuple[int, ...], u: np.ndarray) -> np.ndarray:
    """Scale uniform [-1, 1) noise like a sensible init for this parameter (uniform std = range/sqrt(3))."""
    if name.endswith("embed_tokens.weight"):
        return u * (0.05 * math.sqrt(3.0))  # tied lm_head: keeps next-token distributions broad
    if name.endswith("A_log"):
        return (u + 1.0) * (LN_16 / 2)  # log of values in [1, 16)
    if name.endswith("dt_bias"):
        return 1.0 + 0.25 * u
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + 0.1 * u  # plain x * w
    if len(shape) == 1:
        return 0.1 * u  # zero-centred RMSNorm x * (1 + w)
    fan_in = math.prod(shape[1:])
    return u * math.sqrt(0.75 / fan_in)  # std 0.5 / sqrt(fan_in): well-conditioned in fp32


def demo_weights(cfg: KevConfig = demo.DEMO_CONFIG, seed: int = SEED) -> dict[str, np.ndarray]:
    """Deterministic fp32 weights for every parameter of `cfg`."""
    out = {}
    for name, shape in tied_weight_shapes(cfg).items():
        u = uniform(seed, name, math.prod(shape))
        out[name] = _init(name, shape, u).astype(np.float32).reshape(shape)
    return out


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file with names and JSON keys sorted, so its bytes depend only on the tensors."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name], dtype="<f4").tobytes())


def initial_checkpoint(dest: Path, config: KevConfig) -> None:
    """The demo's config and tokenizer with the deterministic initial weights of `config`, in `dest`."""
    demo.write_demo_files(dest, config)
    write_safetensors(dest / "model.safetensors", demo_weights(config))



def example_rows(families: tuple[str, ...] = SHIPPED_FAMILIES) -> list[demo_task.Example]:
    """The rows of examples/demo-task.parquet."""
    return demo_task.examples(EXAMPLE_ROWS, EXAMPLES_SEED, families, per_document=EXAMPLE_PER_DOCUMENT)


def encode(tok, template, groups: list[list[demo_task.Example]], pad: int, answer_ids: dict[str, int],
           with_keys: bool = False):
    """Sequences of one document then its questions, each followed by its answer token (except the
    last), prefix and branches tokenized apart exactly as the runner does.

    Returns (ids [B, T] right-padded, answer positions [B, Q] (-1: none), targets [B, Q]); a group of one
    question is exactly the runner's `prefix + branch` sequence. With `with_keys`, each question's key
    word position follows its answer position, with the same target (an auxiliary target that supervises
    the first step, "is this word in the document", where the word is; none for `order`).
    """
    prefixes = tok([template.prefix(g[0].document) for g in groups], add_special_tokens=False)["input_ids"]
    flat = [e for g in groups for e in g]
    branches = iter(tok([template.branch(e.question) for e in flat], add_special_tokens=False)["input_ids"])
    # tokens of the branch up to its key word: BPE works word by word, so this is a prefix of the branch
    keys = iter(len(ids) for ids in tok([template.branch(e.question[: e.key_end]).split(e.question[: e.key_end])[0]
                                         + e.question[: e.key_end] for e in flat], add_special_tokens=False)["input_ids"])
    seqs, where, targets = [], [], []
    for prefix, group in zip(prefixes, groups):
        seq, pos, tgt = list(prefix), [], []
        for k, e in enumerate(group):
            key = len(seq) + next(keys) - 1
            seq += next(branches)
            pos.append(len(seq) - 1)
            tgt.append(answer_ids[e.answer])
            if with_keys:
                pos.append(key)
                tgt.append(answer_ids[e.answer] if e.family != "order" else -1)
            if k + 1 < len(group):
                seq.append(answer_ids[e.answer])
        seqs.append(seq)
        where.append(pos)
        targets.append(tgt)
    width = -(-max(map(len, seqs)) // 64) * 64  # few distinct shapes: each new one costs Triton an autotune
    q = max(map(len, where))
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    positions = torch.full((len(seqs), q), -1, dtype=torch.long)
    tgts = torch.full((len(seqs), q), -1, dtype=torch.long)
    for i, (s, p, t) in enumerate(zip(seqs, where, targets)):
        ids[i, : len(s)] = torch.tensor(s)
        positions[i, : len(p)] = torch.tensor(p)
        tgts[i, : len(t)] = torch.tensor(t)
    return ids, positions, tgts


def group(rows: list[demo_task.Example]) -> list[list[demo_task.Example]]:
    """Consecutive examples of one document, as `demo_task.examples` yields them."""
    out: list[list[demo_task.Example]] = []
    for e in rows:
        if out and out[-1][0].document == e.document:
            out[-1].append(e)
        else:
            out.append([e])
    return out


def answer_logits(model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [B, Q, V] at the answer positions (causal: trailing pads change nothing)."""
    hidden = model.model(input_ids=ids).last_hidden_state
    rows = torch.arange(len(ids), device=ids.device)[:, None]
    return model.lm_head(hidden[rows, positions.clamp(min=0)])


def recall_batch(tok, rng: random.Random, answer_ids: dict[str, int], batch: int, items: int = 24,
                 pool: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Warm-up sequences that teach the task's first step densely: nouns and two-digit numbers drawn with
    repeats from a small pool, with a target after each item: Yes if it occurred before, else No.
    Returns (ids [B, T], targets [B, T] with -1 where none)."""
    seqs, tgts = [], []
    for _ in range(batch):
        words = rng.sample(demo_task.NOUNS, pool // 2) + [str(n) for n in rng.sample(range(10, 100), pool - pool // 2)]
        seq, tgt, seen = [], [], set()
        for _ in range(items):
            w = rng.choice(words)
            ids = tok(" " + w, add_special_tokens=False)["input_ids"]
            seq += ids
            tgt += [-1] * (len(ids) - 1) + [answer_ids["Yes" if w in seen else "No"]]
            seen.add(w)
        seqs.append(seq)
        tgts.append(tgt)
    width = max(map(len, seqs))
    ids = torch.full((batch, width), tok.pad_token_id, dtype=torch.long)
    targets = torch.full((batch, width), -1, dtype=torch.long)
    for i, (s, t) in enumerate(zip(seqs, tgts)):
        ids[i, : len(s)] = torch.tensor(s)
        targets[i, : len(t)] = torch.tensor(t)
    return ids, targets


def training_stream(steps: int, batch: int, pack: int, seed: int, families: tuple[str, ...], curriculum: float,
                    start_vocabulary: int):
    """The task examples of each training step, grouped by document, exactly as `train` draws them."""
    for step in range(steps):
        sentences, vocabulary = curriculum_at(step, steps, curriculum, start_vocabulary)
        yield group(demo_task.examples(batch * pack, seed * (1 << 20) + step, families, pack, sentences, vocabulary))


def doc_hash(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


@torch.no_grad()
def accuracy(model, tok, template, rows: list[demo_task.Example], answer_ids: dict[str, int], device,
             batch: int = 256) -> dict[str, float]:
    """Accuracy per family and overall, predicting the more likely of the two answer tokens."""
    model.eval()
    hits: dict[str, list[bool]] = {}
    yes, no = answer_ids["Yes"], answer_ids["No"]
    for s in range(0, len(rows), batch):
        chunk = rows[s: s + batch]
        ids, positions, _ = encode(tok, template, [[e] for e in chunk], tok.pad_token_id, answer_ids)
        logits = answer_logits(model, ids.to(device), positions.to(device))[:, 0]
        pred = torch.where(logits[:, yes] >= logits[:, no], 0, 1).tolist()
        for e, p in zip(chunk, pred):
            hits.setdefault(e.family, []).append(demo_task.ANSWERS[p] == e.answer)
    model.train()
    out = {f: sum(h) / len(h) for f, h in sorted(hits.items())}
    out["all"] = sum(sum(h) for h in hits.values()) / sum(len(h) for h in hits.values())
    return out


def _chunk_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                            use_qk_l2norm_in_kernel=False, **_):
    """transformers' chunked gated delta rule, computed by kevscore's vectorised reference (triangular
    solves instead of transformers' row-by-row loop): the same arithmetic, several times faster to train."""
    out, final = gdr_ref.chunk_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                                output_final_state=output_final_state,
                                                use_qk_l2norm=use_qk_l2norm_in_kernel)
    return out.to(value.dtype), final


def training_init(model, seed: int) -> None:
    """The demo's initial weights give DeltaNet decays of exp(-1.3 A) per token (memories of one or two
    tokens); start training from long memories instead, as Mamba-style models do: dt = softplus(dt_bias)
    log-uniform in [1e-3, 1e-1]."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("dt_bias"):
                dt = torch.exp(torch.rand(p.shape, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus


def build_model(init_dir: Path, device):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    from kevscore.reference import KERNELS

    # transformers' own torch kernels on every device: fla-core 0.5.2 refuses the gated delta rule's
    # backward under Triton < 3.7.1 on Hopper (wrong results, its issue #640), and these shapes are tiny
    for name in KERNELS:
        fn = getattr(modeling, name, None)
        if fn is not None:
            setattr(modeling, name, getattr(fn, "__wrapped__", fn))
    modeling.torch_chunk_gated_delta_rule = _chunk_gated_delta_rule
    config = modeling.Qwen3_5TextConfig(**json.loads((init_dir / "config.json").read_text()))
    model = modeling.Qwen3_5ForCausalLM.from_pretrained(init_dir, config=config, dtype=torch.float32)
    return model.to(device).train()


def _update(model, opt, loss: torch.Tensor) -> None:
    """One optimiser step on `loss`, gradients clipped to norm 1."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def warm_opt_lr(opt, lr: float, step: int, steps: int) -> None:
    """The recall warm-up's learning rate: linear warm-up over its first 10%, then constant."""
    for group_ in opt.param_groups:
        group_["lr"] = lr * min(1.0, (step + 1) / max(1, steps // 10))


def curriculum_at(step: int, steps: int, curriculum: float, start_vocabulary: int) -> tuple[tuple[int, int], int]:
    """(document sentences (min, max), noun vocabulary) at `step`: from (1, 2) sentences over
    `start_vocabulary` nouns up to the task's (3, 12) over all nouns, linearly over the first `curriculum`
    fraction of training."""
    f = 1.0 if curriculum <= 0 else min(1.0, step / (curriculum * steps))
    vocabulary = round(start_vocabulary + (len(demo_task.NOUNS) - start_vocabulary) * f)
    return (round(1 + 2 * f), round(2 + 10 * f)), vocabulary


def train(out: Path, steps: int, batch: int, lr: float, seed: int, device: str, eval_every: int,
          validation: int, max_seconds: float = math.inf, pack: int = 4, curriculum: float = 0.6,
          families: tuple[str, ...] = SHIPPED_FAMILIES, config: KevConfig = demo.DEMO_CONFIG,
          lm_weight: float = 0.0, start_vocabulary: int = 8, key_loss: bool = True, recall_steps: int = 300,
          start_from: Path | None = None, log=print) -> dict:
    from kevscore.model.checkpoint import load_tokenizer
    from kevscore.model.prompt import load_template

    torch.manual_seed(seed)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory() as tmp:
        init = Path(tmp)
        initial_checkpoint(init, config)
        if start_from is not None:  # a second stage: go on from an earlier run's weights
            shutil.copyfile(Path(start_from) / "model.safetensors", init / "model.safetensors")
        tok = load_tokenizer(init)
        model = build_model(init, device)
    if start_from is None:
        training_init(model, seed)
    template = load_template(None, tok)
    answer_ids = {a: tok.convert_tokens_to_ids(a) for a in demo_task.ANSWERS}
    valid = demo_task.examples(validation, VALIDATION_SEED, families)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    seen: set[bytes] = set()
    history = []
    t0, loss_sum, loss_n = time.perf_counter(), 0.0, 0
    rng = random.Random(seed)
    for step in range(recall_steps):  # warm-up: "did this word occur before?" at every word
        ids, y = recall_batch(tok, rng, answer_ids, batch * pack)
        ids, y = ids.to(device), y.to(device)
        logits = model.lm_head(model.model(input_ids=ids).last_hidden_state)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1)
        warm_opt_lr(opt, lr, step, recall_steps)
        _update(model, opt, loss)
        if (step + 1) % eval_every == 0 or step + 1 == recall_steps:
            log(json.dumps({"recall_step": step + 1, "loss": round(loss.item(), 4)}))
    for group_ in opt.param_groups:
        group_["lr"] = lr * sched.lr_lambdas[0](0)
    stream = training_stream(steps, batch, pack, seed, families, curriculum, start_vocabulary)
    for step, groups in enumerate(stream):
        seen.update(doc_hash(g[0].document) for g in groups)
        ids, positions, y = encode(tok, template, groups, tok.pad_token_id, answer_ids, with_keys=key_loss)
        ids, positions, y = ids.to(device), positions.to(device), y.to(device)
        logits = model.lm_head(model.model(input_ids=ids).last_hidden_state)  # [B, T, V]
        rows = torch.arange(len(ids), device=device)[:, None]
        loss = F.cross_entropy(logits[rows, positions.clamp(min=0)].flatten(0, 1), y.flatten(), ignore_index=-1)
        if lm_weight:  # next-token loss on the prompt text: teaches copying document words early
            nxt = ids[:, 1:].masked_fill(ids[:, 1:] == tok.pad_token_id, -1)
            loss = loss + lm_weight * F.cross_entropy(logits[:, :-1].flatten(0, 1), nxt.flatten(), ignore_index=-1)
        _update(model, opt, loss)
        sched.step()
        loss_sum, loss_n = loss_sum + loss.item(), loss_n + 1
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            acc = accuracy(model, tok, template, valid, answer_ids, device)
            entry = {"step": step + 1, "loss": round(loss_sum / loss_n, 4), "lr": sched.get_last_lr()[0],
                     "seconds": round(time.perf_counter() - t0, 1), "validation": {k: round(v, 4) for k, v in acc.items()}}
            history.append(entry)
            log(json.dumps(entry))
            loss_sum, loss_n = 0.0, 0
            if time.perf_counter() - t0 > max_seconds:
                log(f"stopping at step {step + 1}: over --max-seconds {max_seconds}")
                break
    examples = example_rows(families)
    examples_docs = {doc_hash(e.document) for e in examples}
    report = {
        "seed": seed, "steps": steps, "steps_done": history[-1]["step"], "batch": batch, "lr": lr, "device": device,
        "pack": pack, "curriculum": curriculum, "lm_weight": lm_weight, "start_vocabulary": start_vocabulary,
        "key_loss": key_loss, "recall_steps": recall_steps,
        "start_from": None if start_from is None else file_sha256(Path(start_from) / "model.safetensors"),
        "families": list(families), "config": config.to_hf(),
        "torch": torch.__version__, "seconds": round(time.perf_counter() - t0, 1),
        "final_validation": history[-1]["validation"], "history": history,
        "examples_accuracy": accuracy(model, tok, template, examples, answer_ids, device),
        "training_documents": len(seen),
        "validation_documents_seen_in_training": sum(doc_hash(e.document) in seen for e in valid),
        "example_documents_seen_in_training": len(examples_docs & seen),
    }
    save(model, out, report, config)
    return report


def save(model, out: Path, report: dict, config: KevConfig = demo.DEMO_CONFIG) -> None:
    """A complete checkpoint directory: the demo's config and tokenizer, the trained fp32 weights."""
    out.mkdir(parents=True, exist_ok=True)
    demo.write_demo_files(out, config)
    state = model.state_dict()
    names = tied_weight_shapes(config)
    tensors = {n: state[n].detach().float().cpu().numpy().astype(np.float32) for n in names}
    write_safetensors(out / "model.safetensors", tensors)
    report["model_sha256"] = file_sha256(out / "model.safetensors")
    (out / "training.json").write_text(json.dumps(report, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--batch", type=int, default=16, help="documents per step (each with --pack questions)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu (how the shipped weights were made) or cuda")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--validation", type=int, default=512, help="validation examples")
    ap.add_argument("--max-seconds", type=float, default=math.inf, help="stop early (at an evaluation) after this")
    ap.add_argument("--pack", type=int, default=4, help="questions per training document (each answered in turn)")
    ap.add_argument("--curriculum", type=float, default=0.6, help="fraction of training over which documents grow")
    ap.add_argument("--families", default=",".join(SHIPPED_FAMILIES), help=f"of {','.join(demo_task.FAMILIES)}")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (the shipped weights: 2)")
    ap.add_argument("--lm-weight", type=float, default=0.0, help="weight of the next-token loss on the prompt text")
    ap.add_argument("--start-from", type=Path, help="a second stage: start from this run's output (with "
                    "--recall-steps 0 --curriculum 0)")
    ap.add_argument("--recall-steps", type=int, default=300, help="warm-up steps of the dense recall task")
    ap.add_argument("--no-key-loss", action="store_true", help="no auxiliary answer target at the key word")
    ap.add_argument("--start-vocabulary", type=int, default=8, help="nouns at the curriculum's start")
    ap.add_argument("--small", action="store_true", help="experiments: a 4-layer, 64-wide model, not the demo's")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = train(args.out, args.steps, args.batch, args.lr, args.seed, args.device, args.eval_every,
                   args.validation, args.max_seconds, args.pack, args.curriculum, tuple(args.families.split(",")),
                   SMALL if args.small else demo.DEMO_CONFIG, args.lm_weight, args.start_vocabulary,
                   not args.no_key_loss, args.recall_steps, args.start_from)
    print(json.dumps({"out": str(args.out), "steps_done": report["steps_done"], "seconds": report["seconds"],
                      "final_validation": report["final_validation"], "examples": report["examples_accuracy"]}))


if __name__ == "__main__":
    main()
