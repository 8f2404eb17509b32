"""Planning: documents into waves that fit the bank, rows into batches (padded to graph buckets, or their own shape)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def ladder(n: int, start: int = 16) -> int:
    """The smallest bucket >= n among start * {1, 1.5, 2, 3, 4, 6, 8, ...}: at most 50% padding."""
    size = start
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


# a batch whose weight matmuls come to this many FLOPs a layer or more runs eagerly at its own shape on a GPU: its
# GPU work then outlasts the host's launches of the layer, so a graph would only add padding and a capture
# (benchmarks/NOTES.md 117-120)
EAGER_LAYER_FLOPS = 5e11


def eager_tokens(layer_weights: float) -> int:
    """Padded branch tokens from which a batch runs eagerly at its own shape, through layers of `layer_weights`
    matmul weights each (two FLOPs a weight a token)."""
    return math.ceil(EAGER_LAYER_FLOPS / (2 * layer_weights))


def length_bucket(n: int) -> int:
    """A branch's padded length: the ladder up to one chunk of the gated delta rule (64 tokens), steps of 8
    tokens through the second chunk (where most questions with a template fall: 72, 80, ..., 128), then the
    ladder again. Padding costs the whole model; one more graph bucket costs one capture."""
    return -(-n // 8) * 8 if 64 < n <= 128 else ladder(n)


def prefill_group_tokens(free_bytes: int, bytes_per_token: int, most: int = 65536, least: int = 2048) -> int:
    """Document tokens per prefill group: enough for the GEMMs to run at their rate and for each group's
    launches to hide behind the GPU work of the one before, as many as half the free memory holds, between
    `least` and `most` (a multiple of 64, the chunk of the gated delta rule)."""
    fits = free_bytes // 2 // max(1, bytes_per_token)
    return max(least, min(most, fits // 64 * 64))


def row_bucket(n: int, max_rows: int) -> int:
    """Row counts are padded to 1, 2, 4, 8, 12, 16, 24, 32, 48, ... capped at max_rows."""
    return n if n <= 2 else min(ladder(n, start=4), max_rows)


def scored_bucket(n: int) -> int:
    """Positions scored per row: 1 (each row's last token), else 2, 3, 4, 6, 8, 12, ..."""
    return 1 if n <= 1 else ladder(n, start=2)


@dataclass(slots=True)
class Batch:
    rows: list[int]   # indices into the run's rows (or a scoring's branches), the real rows of this batch
    size: int         # padded row count (>= len(rows))
    length: int       # padded branch length
    prefix: int       # padded document length of the K/V gather
    scored: int = 1   # positions scored per row: its last `scored` tokens (a label's continuation: several)
    exact: bool = False  # the rows' own count and (even) length, no graph bucket: run eagerly


def plan_batches(rows: Sequence[int], branch_len: Sequence[int], prefix_len: Sequence[int],
                 max_rows: int, max_tokens: int, scored: Sequence[int] | None = None,
                 exact_from: float = math.inf) -> list[Batch]:
    """Sort rows by branch length and cut them into batches of similar length, padded to graph buckets unless
    their padded size comes to `exact_from` tokens (0: every batch at its own shape; inf: none).

    `branch_len[r]` / `prefix_len[r]` (and `scored[r]`, positions to score, default 1) are indexed by row id;
    a batch holds at most `max_rows` rows and at most `max_tokens` padded branch tokens (but always at least
    one row).
    """
    order = sorted(rows, key=lambda r: (branch_len[r], prefix_len[r], r))
    groups: list[list[int]] = []
    for r in order:  # ascending length: the newest row sets the batch's padded length
        cap = max(1, min(max_rows, max_tokens // length_bucket(branch_len[r])))
        if not groups or len(groups[-1]) >= cap:
            groups.append([])
        groups[-1].append(r)
    # each group a batch, its sizes padded to their buckets (a group holds at most max_rows rows, or one),
    # unless that comes to exact_from or more: then its own rows and its longest length rounded up to even (the
    # upload buffer's columns then sit at the byte alignment that Triton specializes on, as at a bucket's length)
    batches = []
    for g in groups:
        size, longest = row_bucket(len(g), max_rows), max(branch_len[r] for r in g)
        exact = size * length_bucket(longest) >= exact_from
        batches.append(Batch(g, len(g) if exact else size, longest + longest % 2 if exact else length_bucket(longest),
                             ladder(max(prefix_len[r] for r in g)),
                             1 if scored is None else scored_bucket(max(scored[r] for r in g)), exact))
    return batches


def plan_waves(doc_tokens: Sequence[int], entries: int, tokens: int, waste: float | None = None) -> list[list[int]]:
    """Group documents (in order) into waves of at most `entries` documents and `tokens` K/V tokens; with
    `waste` (documents in ascending length), also none that its documents padded to its longest would fill more
    than `waste` times."""
    waves: list[list[int]] = []
    used = 0  # K/V tokens of the last wave
    for d, n in enumerate(doc_tokens):
        size = len(waves[-1]) if waves else 0
        padded = waste is not None and (size + 1) * n > waste * (used + n)
        if not waves or size == entries or used + n > tokens or padded:
            waves.append([])
            used = 0
        waves[-1].append(d)
        used += n
    return waves


@dataclass(slots=True)
class Windows:
    """A job cut into windows of documents: all rows of a window's documents are scored together."""
    of_row: np.ndarray   # int32 [input rows]: each row's window; -1 for a row not scored (set aside, other rank)
    rows: np.ndarray     # int64 per window: its rows
    docs: np.ndarray     # int64 per window: its documents
    tokens: np.ndarray   # int64 per window: its documents' prefix tokens
    rank: np.ndarray | None = None  # int64 per window: the rank that scores it (None: one process scores all)
    order: np.ndarray | None = None
    bounds: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def of_rank(self, rank: int) -> list[int]:
        """The windows `rank` scores (every window when one process scores all)."""
        return list(range(len(self))) if self.rank is None else np.flatnonzero(self.rank == rank).tolist()

    def rows_of(self, window: int) -> np.ndarray:
        """The window's input rows, ascending."""
        if self.order is None:  # rows grouped by window, input order inside each: 8 bytes a row, once
            self.order = np.argsort(self.of_row, kind="stable")
            self.bounds = np.searchsorted(self.of_row[self.order], np.arange(len(self.rows) + 1))
        return self.order[self.bounds[window]:self.bounds[window + 1]]

    def digest(self) -> str:
        """A fingerprint of the plan: which row goes to which window."""
        import hashlib

        return hashlib.sha256(np.ascontiguousarray(self.of_row, dtype="<i4").tobytes()).hexdigest()


def join_windows(plans: Sequence[Windows]) -> Windows:
    """One plan of the windows of several ranks, rank 0's first: window w of rank r becomes window
    w + (windows of the ranks before r), and `rank` says whose each one is."""
    sizes = [len(p) for p in plans]
    of_row = np.full(len(plans[0].of_row), -1, dtype=np.int32)
    for p, offset in zip(plans, np.cumsum([0, *sizes])):  # in place: one pass over each rank's rows
        mine = p.of_row >= 0
        of_row[mine] = p.of_row[mine] + offset
    rank = np.repeat(np.arange(len(plans), dtype=np.int64), sizes)
    cat = lambda name: np.concatenate([getattr(p, name) for p in plans]).astype(np.int64)  # noqa: E731
    return Windows(of_row, cat("rows"), cat("docs"), cat("tokens"), rank)


def plan_windows(doc_of_row: np.ndarray, doc_tokens: Sequence[int], max_docs: int, max_rows: int,
                 max_tokens: int) -> Windows:
    """Cut documents, in the order they first appear in the input, into consecutive windows of at most
    `max_docs` documents, `max_rows` rows and `max_tokens` prefix tokens (but at least one document).
    A document with more than `max_rows` rows gets windows of its own, its rows split in input order."""
    n_docs = len(doc_tokens)
    live = doc_of_row >= 0
    counts = np.bincount(doc_of_row[live], minlength=n_docs) if n_docs else np.zeros(0, np.int64)
    first = np.full(max(n_docs, 1), -1, dtype=np.int64)
    rows, docs, tokens = [], [], []  # per window
    accepting = False  # the last window takes more documents (not one of a split document's)
    for d in np.flatnonzero(counts).tolist():
        n, t = int(counts[d]), int(doc_tokens[d])
        # the document joins the last window when it fits there
        if accepting and docs[-1] < max_docs and rows[-1] + n <= max_rows and tokens[-1] + t <= max_tokens:
            first[d] = len(rows) - 1
            rows[-1] += n
            docs[-1] += 1
            tokens[-1] += t
            continue
        first[d] = len(rows)  # a new window, or a document of more than max_rows rows: windows of its own
        pieces = range(0, n, max_rows)
        rows += [min(max_rows, n - k) for k in pieces]
        docs += [1] * len(pieces)
        tokens += [t] * len(pieces)
        accepting = n <= max_rows
    of_row = np.where(live, first[doc_of_row], -1).astype(np.int32)
    if len(chunked := np.flatnonzero(counts > max_rows)):  # the split documents
        split = np.flatnonzero(np.isin(doc_of_row, chunked))
        split = split[np.argsort(doc_of_row[split], kind="stable")]  # their rows by document, input order in each
        doc = doc_of_row[split]
        rank = np.arange(len(split)) - np.searchsorted(doc, doc)  # each row's place among its document's rows
        of_row[split] += (rank // max_rows).astype(np.int32)
    return Windows(of_row, np.asarray(rows, np.int64), np.asarray(docs, np.int64), np.asarray(tokens, np.int64))
