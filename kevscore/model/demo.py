"""The built-in demo model: a small Kev checkpoint, byte-for-byte the same on every machine.

The tokenizer is a byte-level BPE whose merges are counted here over a small corpus (`demo_model/`), written as
plain JSON by this module, so no library version changes the files. The weights are trained on the demo
task (`kevscore.demo.task`, by `kevscore.demo.train`) and ship in `demo_model/`; training starts from
the deterministic initial weights made here by a counter-based generator (SplitMix64 over seed, tensor
name and element index).
"""
from __future__ import annotations

import hashlib
import heapq
import json
import math
import os
import shutil
import struct
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
from tokenizers.pre_tokenizers import ByteLevel

from kevscore.durable import cache_root, file_sha256, lock_file
from kevscore.errors import KevscoreError
from kevscore.model import config
from kevscore.model.config import FULL, LINEAR, KevConfig

DEMO_NAME = "demo-v4"
TRAINED_DIR = Path(__file__).parent / "demo_model"  # trained weights + training.json (kevscore.demo.train)
CORPUS = TRAINED_DIR / "corpus.txt"  # the text the tokenizer's merges are counted over
SEED = 0x4B657653636F7265  # "KevScore"
NUM_MERGES = 1000  # learned merges; with bytes, forced merges and specials the tokenizer stays in (1216, 1280]
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
SINGLE_TOKEN_WORDS = ("Yes", "No", "yes", "no", " Yes", " No", " yes", " no")
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

DEMO_CONFIG = KevConfig(
    vocab_size=1280, hidden_size=128, intermediate_size=256, layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4, rope_theta=10_000.0, partial_rotary_factor=0.25,
    max_position_embeddings=4096, tie_word_embeddings=True,
)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}"
    "{{- '<think>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)



# ---------------------------------------------------------------- tokenizer


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, indexed by byte value (what ByteLevel uses)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _to_symbols(text: str) -> str:
    table = _byte_symbols()
    return "".join(table[b] for b in text.encode("utf-8"))


def _pretokenize(text: str) -> list[str]:
    """Words as the ByteLevel pre-tokenizer splits them (GPT-2 regex), already in byte symbols."""
    return [w for w, _ in ByteLevel(add_prefix_space=False).pre_tokenize_str(text)]


def _apply(seq: list[str], pair: tuple[str, str]) -> list[str]:
    out, i = [], 0
    while i < len(seq):
        if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
            out.append(seq[i] + seq[i + 1])
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return out


def learn_merges(words: Counter[str], count: int) -> list[tuple[str, str]]:
    """Greedy BPE: merge the most frequent pair, ties broken by the smaller (left, right) strings."""
    seqs, freqs = [list(w) for w in words], list(words.values())
    pairs: Counter[tuple[str, str]] = Counter()
    where: defaultdict[tuple[str, str], set[int]] = defaultdict(set)
    for i, seq in enumerate(seqs):
        for p in zip(seq, seq[1:]):
            pairs[p] += freqs[i]
            where[p].add(i)
    heap = [(-n, p) for p, n in pairs.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    while heap and len(merges) < count:
        n, best = heapq.heappop(heap)
        if -n != pairs.get(best, 0) or n == 0:
            continue  # stale entry
        merges.append(best)
        for i in sorted(where.pop(best)):
            old, f = seqs[i], freqs[i]
            seqs[i] = new = _apply(old, best)
            for p in zip(old, old[1:]):
                pairs[p] -= f
            for p in zip(new, new[1:]):
                pairs[p] += f
                where[p].add(i)
            for p in set(zip(old, old[1:])) | set(zip(new, new[1:])):
                if pairs[p] > 0:
                    heapq.heappush(heap, (-pairs[p], p))
        pairs.pop(best, None)
    return merges


def bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """Encode one pre-tokenized word: repeatedly merge the lowest-ranked pair (leftmost on ties)."""
    seq = list(word)
    while len(seq) > 1:
        best = min(zip(seq, seq[1:]), key=lambda p: ranks.get(p, math.inf))
        if best not in ranks:
            break
        seq = _apply(seq, best)
    return seq


def force_single_tokens(merges: list[tuple[str, str]], words: tuple[str, ...]) -> list[tuple[str, str]]:
    """Append merges so that each of `words` encodes to exactly one token."""
    merges = list(merges)
    ranks = {p: r for r, p in enumerate(merges)}
    for word in words:
        while len(pieces := bpe(_to_symbols(word), ranks)) > 1:
            ranks[(pieces[0], pieces[1])] = len(merges)
            merges.append((pieces[0], pieces[1]))
    return merges


def tokenizer_json() -> dict:
    """The full `tokenizer.json` dict: byte-level BPE over CORPUS, then the special tokens."""
    merges = learn_merges(Counter(_pretokenize(CORPUS.read_text(encoding="utf-8"))), NUM_MERGES)
    merges = force_single_tokens(merges, SINGLE_TOKEN_WORDS)
    vocab: dict[str, int] = {}
    for token in [*_byte_symbols(), *(a + b for a, b in merges)]:
        vocab.setdefault(token, len(vocab))
    added = [
        dict(id=len(vocab) + i, content=t, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
        for i, t in enumerate(SPECIAL_TOKENS)
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    model = {
        "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
        "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
        "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges],
    }
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": byte_level, "post_processor": {**byte_level, "trim_offsets": False},
        "decoder": byte_level, "model": model,
    }


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": 4096,
        "clean_up_tokenization_spaces": False, "add_prefix_space": False, "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


# ---------------------------------------------------------------- weights


def weight_shapes(cfg: KevConfig) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of transformers' Qwen3_5ForCausalLM (tied embeddings: no lm_head)."""
    shapes = config.weight_shapes(cfg)
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


LN_16 = 2.772588722239781  # log(16), written out so no libm is involved


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


def demo_weights(cfg: KevConfig = DEMO_CONFIG, seed: int = SEED) -> dict[str, np.ndarray]:
    """Deterministic fp32 weights for every parameter of `cfg`."""
    out = {}
    for name, shape in weight_shapes(cfg).items():
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


# ---------------------------------------------------------------- checkpoint


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def trained_weights() -> Path:
    """The shipped trained weights (kevscore/model/demo_model/model.safetensors), checked against the SHA-256
    that the training run recorded beside them (training.json)."""
    path = TRAINED_DIR / "model.safetensors"
    try:
        want = json.loads((TRAINED_DIR / "training.json").read_text())["model_sha256"]
        have = file_sha256(path)
    except (OSError, ValueError, KeyError) as exc:
        raise KevscoreError(f"{TRAINED_DIR}: the demo model's trained weights are missing or unreadable "
                            f"({exc}); reinstall kevscore") from exc
    if have != want:
        raise KevscoreError(f"{path}: SHA-256 {have[:12]}… is not the trained weights' {want[:12]}…; reinstall kevscore")
    return path


def build_demo_checkpoint(dest: Path, cfg: KevConfig = DEMO_CONFIG, trained: bool = True) -> None:
    """Write config.json, model.safetensors and the tokenizer files of the demo model into `dest`: the
    shipped trained weights, or with `trained=False` the deterministic initial ones that training starts
    from (another `cfg` than the demo's: a model of the same tokenizer, for training experiments)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_json()
    size = len(tok["model"]["vocab"]) + len(tok["added_tokens"])
    if -(-size // 64) * 64 != cfg.vocab_size:
        raise KevscoreError(f"demo tokenizer has {size} tokens; DEMO_CONFIG.vocab_size must be updated")
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    config = cfg.to_hf() | {
        "bos_token_id": None, "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
        "dtype": "float32",
    }
    _write_json(dest / "config.json", config)
    _write_json(dest / "tokenizer.json", tok)
    _write_json(dest / "tokenizer_config.json", tokenizer_config())
    if trained and cfg == DEMO_CONFIG:
        shutil.copyfile(trained_weights(), dest / "model.safetensors")
    else:
        write_safetensors(dest / "model.safetensors", demo_weights(cfg))


def _complete(path: Path) -> bool:
    return all((path / f).is_file() for f in FILES)


def demo_checkpoint_dir(root: Path | None = None) -> Path:
    """The demo checkpoint in the cache ($KEVSCORE_CACHE or ~/.cache/kevscore), built atomically on first use.

    Builders serialize on a flock and re-check under it, so a complete directory is never moved while another
    process reads it (parallel test workers all ask for it at once); only an incomplete one is replaced."""
    root = Path(root or cache_root())
    target = root / DEMO_NAME
    if _complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    fd = lock_file(root / f".{DEMO_NAME}.lock")
    try:
        if _complete(target):  # built by another process while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}.", dir=root))
        try:
            build_demo_checkpoint(tmp)
            if target.exists():  # incomplete (a build killed mid-way, by hand): move it aside, then rename
                stale = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}.stale.", dir=root))
                os.rename(target, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        os.close(fd)
    return target
