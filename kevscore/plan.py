"""Planning: documents into waves that fit the bank, rows into padded (rows x length x prefix) batches."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def ladder(n: int, start: int = 16) -> int:
    """The smallest bucket >= n among start * {1, 1.5, 2, 3, 4, 6, 8, ...}: at most 50% padding."""
    if n <= start:
        return start
    size = start
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def row_bucket(n: int, max_rows: int) -> int:
    """Row counts are padded to 1, 2, 4, 8, 12, 16, 24, 32, 48, ... capped at max_rows."""
    return n if n <= 2 else min(ladder(n, start=4) if n > 4 else 4, max_rows)


@dataclass(slots=True)
class Batch:
    rows: list[int]   # indices into the run's rows, the real rows of this batch
    size: int         # padded row count (>= len(rows))
    length: int       # padded branch length
    prefix: int       # padded document length of the K/V gather


def plan_batches(rows: Sequence[int], branch_len: Sequence[int], prefix_len: Sequence[int],
                 max_rows: int, max_tokens: int) -> list[Batch]:
    """Sort rows by branch length and cut them into batches of similar length.

    `branch_len[r]` / `prefix_len[r]` are indexed by row id; a batch holds at most `max_rows` rows and
    at most `max_tokens` padded branch tokens (but always at least one row).
    """
    order = sorted(rows, key=lambda r: (branch_len[r], prefix_len[r], r))
    groups: list[list[int]] = []
    current: list[int] = []
    for r in order:  # ascending length: the newest row sets the batch's padded length
        cap = max(1, min(max_rows, max_tokens // ladder(branch_len[r])))
        if current and len(current) >= cap:
            groups.append(current)
            current = []
        current.append(r)
    if current:
        groups.append(current)
    return [Batch(rows=g, size=row_bucket(len(g), max(max_rows, len(g))),
                  length=ladder(max(branch_len[r] for r in g)),
                  prefix=ladder(max(prefix_len[r] for r in g))) for g in groups]


def plan_waves(doc_tokens: Sequence[int], entries: int, tokens: int) -> list[list[int]]:
    """Group documents (in order) into waves of at most `entries` documents and `tokens` K/V tokens."""
    waves: list[list[int]] = []
    current: list[int] = []
    used = 0
    for d, n in enumerate(doc_tokens):
        if current and (len(current) == entries or used + n > tokens):
            waves.append(current)
            current, used = [], 0
        current.append(d)
        used += n
    if current:
        waves.append(current)
    return waves
