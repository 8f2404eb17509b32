"""The demo model's tokenizer files: a byte-level BPE whose merges are counted over a small corpus.

    python -m kevscore.demo.tokenizer    # writes kevscore/model/demo_model/tokenizer.json, tokenizer_config.json

The files ship beside the demo's trained weights (the weights were trained with them), and the runtime copies
them (`kevscore.model.demo`); it never imports this. Written as plain JSON by this module, not by a library, so
no library version changes them; a test checks that the shipped files are the ones this module makes.
"""
from __future__ import annotations

import heapq
import json
import math
from collections import Counter, defaultdict

from tokenizers.pre_tokenizers import ByteLevel

from kevscore.model.demo import TRAINED_DIR

CORPUS = TRAINED_DIR / "corpus.txt"  # the text the tokenizer's merges are counted over
NUM_MERGES = 1000  # learned merges; with bytes, forced merges and specials the tokenizer stays in (1216, 1280]
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
SINGLE_TOKEN_WORDS = ("Yes", "No", "yes", "no", " Yes", " No", " yes", " no")

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


def tokenizer_files() -> dict[str, bytes]:
    """The bytes of the files `kevscore.model.demo.TOKENIZER_FILES` names."""
    def text(obj: dict) -> bytes:
        return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")

    return {"tokenizer.json": text(tokenizer_json()), "tokenizer_config.json": text(tokenizer_config())}


if __name__ == "__main__":
    for name, data in tokenizer_files().items():
        (TRAINED_DIR / name).write_bytes(data)
