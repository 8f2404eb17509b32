"""Prompts: a template split into a document prefix and a question branch, tokenized separately."""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kevscore.errors import KevscoreError, rows_phrase

DOC, QUESTION = "{document}", "{question}"
PLAIN_TEMPLATE = "Document:\n{document}\n\nQuestion: {question}\nAnswer:"


@dataclass(frozen=True, slots=True)
class Template:
    """`head + document` is the prefix; `tail` with the question substituted is the branch."""
    head: str
    tail: str

    @classmethod
    def parse(cls, text: str, source: str) -> "Template":
        if text.count(DOC) != 1 or text.count(QUESTION) != 1:
            raise KevscoreError(f"{source}: the template must contain {DOC} and {QUESTION} exactly once each")
        head, tail = text.split(DOC)
        if QUESTION not in tail:
            raise KevscoreError(f"{source}: {DOC} must come before {QUESTION} in the template")
        return cls(head, tail)

    def prefix(self, document: str) -> str:
        return self.head + document

    def branch(self, question: str) -> str:
        return self.tail.replace(QUESTION, question)


def chat_template(tokenizer) -> Template:
    """The checkpoint's chat template: a user turn holding document then question, generation prompt,
    thinking disabled; split at the document's end."""
    messages = [{"role": "user", "content": f"{DOC}\n\n{QUESTION}"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False)
    return Template.parse(text, "the checkpoint's chat template")


def load_template(path: Path | None, tokenizer) -> Template:
    if path is not None:
        try:
            return Template.parse(Path(path).read_text(), str(path))
        except OSError as exc:
            raise KevscoreError(f"{path}: cannot read the template ({exc.strerror})") from exc
        except UnicodeDecodeError as exc:
            raise KevscoreError(f"{path}: the template is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} "
                                f"at offset {exc.start})") from None
    if getattr(tokenizer, "chat_template", None):
        return chat_template(tokenizer)
    return Template.parse(PLAIN_TEMPLATE, "the default template")


@dataclass(slots=True)
class Encoded:
    """Token ids of a run: unique document prefixes, and per row its prefix, branch and labels."""
    prefixes: list[list[int]]
    row_prefix: list[int]
    branches: list[list[int]]
    labels: list[list[str]]
    label_ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.branches)


def prefix_key(ids: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()


def tokenize(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens."""
    if not texts:
        return []
    # verbose=False: no transformers warning about the tokenizer's model_max_length; lengths are
    # checked against the model's positions by PromptCheck, with a one-line error
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]]


def label_problem(tokenizer, labels: Sequence[str]) -> str | None:
    """Why `labels` cannot be scored (a label of several tokens), or None."""
    for label in labels:
        ids = tokenizer.encode(label, add_special_tokens=False)
        if len(ids) != 1:
            pieces = tokenizer.convert_ids_to_tokens(ids)
            return f"label {label!r} is {len(ids)} tokens {pieces} ({ids}); each label must be a single token"
    return None


def label_token_ids(tokenizer, labels: Sequence[str], where: str) -> list[int]:
    if reason := label_problem(tokenizer, labels):
        raise KevscoreError(f"{where}: {reason}")
    return [tokenizer.encode(label, add_special_tokens=False)[0] for label in labels]


class PromptCheck:
    """The checks a row's prompt must pass, for the streaming token pass and `encode` alike: per row, the
    reason it cannot be scored (or None); at the end, the one-line error naming every such input row."""

    def __init__(self, tokenizer, source: str, max_positions: int):
        self.tokenizer, self.source, self.max_positions = tokenizer, source, max_positions
        self.empty: list[int] = []    # input rows whose branch has no token
        self.long: list[int] = []     # input rows whose prompt exceeds the model's positions
        self.longest = 0
        self._labels: dict[tuple[str, ...], str | None] = {}

    def labels(self, labels: Sequence[str]) -> str | None:
        """Why a row's labels cannot be scored, or None (checked once per distinct list)."""
        key = tuple(labels)
        if key not in self._labels:
            self._labels[key] = label_problem(self.tokenizer, key)
        return self._labels[key]

    def label_error(self, row: int, reason: str) -> KevscoreError:
        return KevscoreError(f"{self.source}: column 'labels' (row {row}): {reason}")

    def prompt(self, row: int, prefix_tokens: int, branch_tokens: int) -> str | None:
        """Why input row `row`'s prompt cannot be scored (an empty branch, too many tokens), or None."""
        if branch_tokens == 0:
            self.empty.append(row)
            return "the prompt branch (template and question) is empty"
        n = prefix_tokens + branch_tokens
        if n <= self.max_positions:
            return None
        self.long.append(row)
        self.longest = max(self.longest, n)
        return f"prompt (document + question) is {n} tokens, longer than the model's {self.max_positions} positions"

    def error(self) -> KevscoreError | None:
        """The error for the rows `prompt` found wanting (empty branches first), or None."""
        if self.empty:
            return KevscoreError(f"{self.source}: column 'question': the prompt branch is empty at "
                                 f"{rows_phrase(self.empty)}")
        if self.long:
            return KevscoreError(f"{self.source}: prompt (document + question) longer than the model's "
                                 f"{self.max_positions} positions at {rows_phrase(self.long)} "
                                 f"(longest {self.longest} tokens)")
        return None


def encode(table, tokenizer, template: Template, default_labels: Sequence[str], max_positions: int) -> Encoded:
    """Tokenize an `InputTable`; documents are tokenized once per distinct text, then deduplicated by ids."""
    texts = list(dict.fromkeys(table.documents))
    text_ids = dict(zip(texts, tokenize(tokenizer, [template.prefix(t) for t in texts])))
    keys: dict[str, int] = {}
    prefixes: list[list[int]] = []
    row_prefix = []
    for doc in table.documents:
        ids = text_ids[doc]
        slot = keys.setdefault(prefix_key(ids), len(prefixes))
        if slot == len(prefixes):
            prefixes.append(ids)
        row_prefix.append(slot)
    branches = tokenize(tokenizer, [template.branch(q) for q in table.questions])
    labels = table.labels or [list(default_labels)] * len(table)
    label_ids = _label_ids(tokenizer, labels, table)
    check = PromptCheck(tokenizer, table.sources[0].name if table.sources else "input", max_positions)
    for i, b in enumerate(branches):
        check.prompt(i, len(prefixes[row_prefix[i]]), len(b))
    if error := check.error():
        raise error
    return Encoded(prefixes, row_prefix, branches, [list(x) for x in labels], label_ids)


def _label_ids(tokenizer, labels: list[list[str]], table) -> list[list[int]]:
    cache: dict[tuple[str, ...], list[int]] = {}
    source = f"{table.sources[0].name}: column 'labels'" if table.labels else "--labels"
    out = []
    for i, row in enumerate(labels):
        key = tuple(row)
        if key not in cache:
            where = f"{source} (row {i})" if table.labels else source
            cache[key] = label_token_ids(tokenizer, row, where)
        out.append(cache[key])
    return out
