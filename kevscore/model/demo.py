"""The built-in demo model: a small Kev checkpoint, byte-for-byte the same on every machine.

The tokenizer is a byte-level BPE whose merges are counted here over a small corpus (`demo_model/`), written as
plain JSON by this module, so no library version changes the files. The weights are trained on the demo
task (`kevscore.demo.task`, by `kevscore.demo.train`, which also makes the initial weights) and ship in
`demo_model/`.
"""
from __future__ import annotations

import heapq
import json
import math
import os
import shutil
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

from tokenizers.pre_tokenizers import ByteLevel

from kevscore.durable import cache_root, file_sha256, lock_file
from kevscore.errors import KevscoreError
from kevscore.model.config import FULL, LINEAR, KevConfig

DEMO_NAME = "demo-v4"
TRAINED_DIR = Path(__file__).parent / "demo_model"  # trained weights + training.json (kevscore.demo.train)
CORPUS = TRAINED_DIR / "corpus.txt"  # the text the tokenizer's merges are counted over
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


def write_demo_files(dest: Path, cfg: KevConfig = DEMO_CONFIG) -> None:
    """Write config.json and the tokenizer files of the demo model into `dest` (another `cfg` than the
    demo's: a model of the same tokenizer, for training experiments)."""
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


def build_demo_checkpoint(dest: Path) -> None:
    """Write the demo checkpoint into `dest`: config.json, the tokenizer files and the shipped trained weights."""
    write_demo_files(dest)
    shutil.copyfile(trained_weights(), Path(dest) / "model.safetensors")


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
