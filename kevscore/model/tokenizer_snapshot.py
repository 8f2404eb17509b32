"""A fast tokenizer without transformers: the snapshot its first load keeps, and the light tokenizer made of it.

A first load through transformers keeps, in `cache_root()/tokenizer-snapshots/` (one file per checkpoint
directory, under the load's key), the backend's whole pipeline as transformers set it up
(`tokenizers.Tokenizer.to_str()`: its added and special tokens included) and what kevscore reads of the tokenizer:
`split_special_tokens`, the pad and end-of-sequence ids, the chat template and the prompt `prompt.chat_template`
renders from it. A later load makes a `LightTokenizer` of it with `tokenizers` alone: no transformers import.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from pathlib import Path

from kevscore.durable import cache_root, write_cache_file
from kevscore.model.prompt import CHAT_OPTIONS, CHAT_TURN

SNAPSHOTS = "tokenizer-snapshots"
FORMAT = 1  # of a snapshot file: a line with the SHA-256 of the rest, a line of JSON (`save`'s meta), the pipeline
# transformers' encode path for our calls (TokenizersBackend's, in transformers 5): a class overriding any gets no snapshot
ENCODE_PATH = ("__call__", "encode", "_encode_plus", "set_truncation_and_padding", "_convert_encoding",
               "_get_padding_truncation_strategies", "_switch_to_input_mode", "_eventual_warn_about_too_long_sequence")
KEPT = ("split_special_tokens", "pad_token_id", "eos_token_id", "chat_template")  # attributes the snapshot answers


def snapshot_file(path: Path) -> Path:
    """Where the snapshot of checkpoint directory `path`'s tokenizer is kept (a later key replaces it)."""
    return cache_root() / SNAPSHOTS / f"{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]}.tok"


def save(path: Path, key: str, tokenizer) -> None:
    """Keep a snapshot of `tokenizer`, transformers' just loaded from `path`, under `key`: only a fast tokenizer
    that encodes as transformers' TokenizersBackend does. Best effort: a failed write costs a slow load next time."""
    try:
        from tokenizers import Tokenizer
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # not the transformers this mirrors
        return
    fast = isinstance(tokenizer, TokenizersBackend) and isinstance(getattr(tokenizer, "backend_tokenizer", None), Tokenizer)
    if not fast or any(getattr(type(tokenizer), m, None) is not getattr(TokenizersBackend, m, None) for m in ENCODE_PATH):
        return
    meta = {"format": FORMAT, "key": key, "chat": chat_call(tokenizer), **{name: getattr(tokenizer, name) for name in KEPT}}
    try:  # JSON cannot hold a value, a custom pipeline component cannot be serialized: no snapshot
        body = json.dumps(meta).encode() + b"\n" + tokenizer.backend_tokenizer.to_str().encode()
    except Exception:  # noqa: BLE001 - tokenizers raises plain Exceptions
        return
    write_cache_file(snapshot_file(path), hashlib.sha256(body).hexdigest().encode() + b"\n" + body)


def chat_call(tokenizer) -> list | None:
    """The call `prompt.chat_template` makes, [conversation, options, what the tokenizer renders], or None: no
    template, one that reads the clock (`strftime_now`), one that fails (transformers then fails alike)."""
    if not (template := tokenizer.chat_template) or "strftime_now" in json.dumps(template):
        return None
    try:
        return [CHAT_TURN, CHAT_OPTIONS, tokenizer.apply_chat_template(CHAT_TURN, **CHAT_OPTIONS)]
    except Exception:  # noqa: BLE001 - jinja and transformers raise many types
        return None


def load(path: Path, key: str, transformers_load: Callable[[], object]) -> LightTokenizer | None:
    """The light tokenizer of the snapshot kept under `key` for `path`; None when there is none, it is another
    key's, or it cannot be read (a normal load then replaces it)."""
    try:
        digest, _, body = snapshot_file(path).read_bytes().partition(b"\n")
        meta, _, pipeline = body.partition(b"\n")
        meta = json.loads(meta)
        if digest.decode() != hashlib.sha256(body).hexdigest() or meta["format"] != FORMAT or meta["key"] != key:
            return None
        from tokenizers import Tokenizer
        return LightTokenizer(Tokenizer.from_str(pipeline.decode()), meta, transformers_load)
    except Exception:  # noqa: BLE001 - a missing or corrupt snapshot, whatever the error, means a normal load
        return None


def kept_attribute(name: str) -> property:
    """A LightTokenizer's attribute `name`: the snapshot's value, or transformers' tokenizer's once loaded."""
    return property(lambda self: self._meta[name] if self._real is None else getattr(self._real, name),
                    doc=f"`{name}`, as the snapshot kept it")


class LightTokenizer:
    """A fast tokenizer's snapshot, answering kevscore's calls with transformers' ids: `tokenizer(texts,
    add_special_tokens=False)["input_ids"]` (`prompt.tokenize`, labels included; a single text too), the chat prompt
    and the attributes in KEPT. Any other call loads transformers' tokenizer, which from then on answers everything."""
    __slots__ = ("_backend", "_meta", "_load", "_real", "_lock")
    split_special_tokens, pad_token_id, eos_token_id, chat_template = map(kept_attribute, KEPT)

    def __init__(self, backend, meta: dict, transformers_load: Callable[[], object]):
        # as TokenizersBackend._encode_plus sets the backend for a call without truncation or padding
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = bool(meta["split_special_tokens"])
        for name, value in zip(self.__slots__, (backend, meta, transformers_load, None, threading.Lock())):
            object.__setattr__(self, name, value)

    def transformers_tokenizer(self):
        """Transformers' tokenizer, loaded on first use."""
        with self._lock:
            if self._real is None:
                object.__setattr__(self, "_real", self._load())
        return self._real

    def __call__(self, text=None, *args, add_special_tokens: bool = True, **kwargs):
        batch = isinstance(text, list) and text and all(isinstance(t, str) for t in text)
        if self._real is not None or args or add_special_tokens or set(kwargs) - {"verbose"} or not (
                batch or isinstance(text, str)):
            return self.transformers_tokenizer()(text, *args, add_special_tokens=add_special_tokens, **kwargs)
        # verbose: transformers only warns of long texts
        ids = [e.ids for e in self._backend.encode_batch(text if batch else [text], add_special_tokens=False)]
        return {"input_ids": ids if batch else ids[0]}

    def apply_chat_template(self, conversation, *args, **kwargs):
        if self._real is None and not args and self._meta["chat"] and self._meta["chat"][:2] == [conversation, kwargs]:
            return self._meta["chat"][2]
        return self.transformers_tokenizer().apply_chat_template(conversation, *args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in LightTokenizer.__slots__:  # copy's and pickle's probes; a slot unset
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer(), name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.transformers_tokenizer(), name, value)

    def __len__(self) -> int:
        return len(self.transformers_tokenizer())

    def __bool__(self) -> bool:  # as transformers' tokenizers answer, without asking `__len__`
        return True
