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
# the conversation `chat_template` renders (one user turn, the document then the question) and how it renders it
CHAT_TURN = [{"role": "user", "content": f"{DOC}\n\n{QUESTION}"}]
CHAT_OPTIONS = {"tokenize": False, "add_generation_prompt": True, "enable_thinking": False}


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
    return Template.parse(tokenizer.apply_chat_template(CHAT_TURN, **CHAT_OPTIONS), "the checkpoint's chat template")


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
    label_ids: list[list[int]]  # per row, each label's first token (scored at the question's last token)
    label_tails: list[list[tuple[int, ...]]] | None = None  # per row, each label's tokens after its first;
                                                          # None: every label of the run is one token

    def __len__(self) -> int:
        return len(self.branches)

    def one_token_labels(self, row: int) -> bool:
        return self.label_tails is None or not any(self.label_tails[row])

    def label_tokens(self, row: int) -> list[tuple[int, ...]]:
        """Each label's token ids, as they continue the row's prompt."""
        tails = self.label_tails[row] if self.label_tails is not None else [()] * len(self.label_ids[row])
        return [(first, *tail) for first, tail in zip(self.label_ids[row], tails)]


def prefix_key(ids: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()


def tokenize(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens."""
    if not texts:
        return []
    # verbose=False: no transformers warning about the tokenizer's model_max_length; lengths are
    # checked against the model's positions by PromptCheck, with a one-line error
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]]


def tokenize_labels(tokenizer, labels: Sequence[str]) -> tuple[list[list[int]], str | None]:
    """Each label's token ids, each label tokenized on its own (the answer as it continues the prompt), and why
    the labels cannot be scored (a label of no tokens, two labels of the same tokens: a normalizing tokenizer's
    'é' and 'e\u0301', which would split one answer's probability between them) or None."""
    ids = tokenize(tokenizer, list(labels))
    if empty := [label for label, t in zip(labels, ids) if not t]:
        return ids, f"label {empty[0]!r} tokenizes to no tokens"
    first: dict[tuple[int, ...], str] = {}
    same = [(first[key], label) for label, key in zip(labels, map(tuple, ids)) if first.setdefault(key, label) != label]
    return ids, f"labels {same[0][0]!r} and {same[0][1]!r} tokenize to the same tokens" if same else None


def label_token_ids(tokenizer, labels: Sequence[str], where: str) -> list[list[int]]:
    """Each label's token ids (`tokenize_labels`); a label of no tokens is an error."""
    ids, reason = tokenize_labels(tokenizer, labels)
    if reason:
        raise KevscoreError(f"{where}: {reason}")
    return ids


def first_and_tails(label_ids: Sequence[Sequence[int]]) -> tuple[list[int], list[tuple[int, ...]]]:
    """Each label's first token and its tokens after the first (`Encoded.label_ids`, `Encoded.label_tails`)."""
    return [ids[0] for ids in label_ids], [tuple(ids[1:]) for ids in label_ids]


def prompt_parts(tail: int) -> str:
    """What a prompt's length counts, for messages: the labels' tokens too when they add any."""
    return "document + question + label" if tail else "document + question"


class PromptCheck:
    """The checks a row's prompt must pass, for the streaming token pass and `encode` alike: per row, the
    reason it cannot be scored (or None); at the end, the one-line error naming every such input row."""

    def __init__(self, tokenizer, source: str, max_positions: int):
        self.tokenizer, self.source, self.max_positions = tokenizer, source, max_positions
        self.empty: list[int] = []    # input rows whose branch has no token
        self.long: list[int] = []     # input rows whose prompt exceeds the model's positions
        self.longest = 0
        self.tail = 0                 # the most label tokens counted in a prompt found too long
        self._labels: dict[tuple[str, ...], tuple[str | None, list[int], list[tuple[int, ...]]]] = {}

    def label_tokens(self, labels: Sequence[str]) -> tuple[str | None, list[int], list[tuple[int, ...]]]:
        """Why a row's labels cannot be scored (or None), each label's first token and its tokens after the first
        (`first_and_tails`); tokenized once per distinct list, whose rows then share these lists."""
        key = tuple(labels)
        if key not in self._labels:
            ids, reason = tokenize_labels(self.tokenizer, key)
            self._labels[key] = (reason, [], []) if reason else (None, *first_and_tails(ids))
        return self._labels[key]

    def label_error(self, row: int, reason: str) -> KevscoreError:
        return KevscoreError(f"{self.source}: column 'labels' (row {row}): {reason}")

    def prompt(self, row: int, prefix_tokens: int, branch_tokens: int, tails: Sequence[tuple[int, ...]]) -> str | None:
        """Why input row `row`'s prompt cannot be scored (an empty branch, too many tokens), or None. `tails`: its
        labels' tokens after their first (`label_tokens`); the longest adds to its length."""
        if branch_tokens == 0:
            self.empty.append(row)
            return "the prompt branch (template and question) is empty"
        tail = max(map(len, tails), default=0)
        n = prefix_tokens + branch_tokens + tail
        if n <= self.max_positions:
            return None
        self.long.append(row)
        self.longest, self.tail = max(self.longest, n), max(self.tail, tail)
        return f"prompt ({prompt_parts(tail)}) is {n} tokens, longer than the model's {self.max_positions} positions"

    def error(self) -> KevscoreError | None:
        """The error for the rows `prompt` found wanting (empty branches first), or None."""
        if self.empty:
            return KevscoreError(f"{self.source}: column 'question': the prompt branch is empty at "
                                 f"{rows_phrase(self.empty)}")
        if self.long:
            return KevscoreError(f"{self.source}: prompt ({prompt_parts(self.tail)}) longer than the model's "
                                 f"{self.max_positions} positions at {rows_phrase(self.long)} "
                                 f"(longest {self.longest} tokens)")
        return None


def encode(table, tokenizer, template: Template, default_labels: Sequence[str], max_positions: int) -> Encoded:
    """Tokenize an `InputTable`; documents are tokenized once per distinct text, then deduplicated by ids."""
    texts = list(dict.fromkeys(table.documents))
    slots: dict[str, tuple[int, list[int]]] = {}  # prefix key -> (its slot, its ids): texts of the same ids share it
    slot_of_text = {text: slots.setdefault(prefix_key(ids), (len(slots), ids))[0]
                    for text, ids in zip(texts, tokenize(tokenizer, [template.prefix(t) for t in texts]))}
    prefixes = [ids for _, ids in slots.values()]
    row_prefix = [slot_of_text[doc] for doc in table.documents]
    branches = tokenize(tokenizer, [template.branch(q) for q in table.questions])
    labels = table.labels or [list(default_labels)] * len(table)
    check = PromptCheck(tokenizer, table.sources[0].name if table.sources else "input", max_positions)
    label_ids, label_tails = [], []
    for i, (row, branch) in enumerate(zip(labels, branches)):
        reason, firsts, tails = check.label_tokens(row)
        if reason:
            raise check.label_error(i, reason) if table.labels else KevscoreError(f"--labels: {reason}")
        label_ids.append(firsts)
        label_tails.append(tails)
        check.prompt(i, len(prefixes[row_prefix[i]]), len(branch), tails)
    if error := check.error():
        raise error
    return Encoded(prefixes, row_prefix, branches, [list(x) for x in labels], label_ids,
                   label_tails if any(any(tails) for tails in label_tails) else None)
