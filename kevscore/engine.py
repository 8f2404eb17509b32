"""The scoring pipeline: documents in waves through the bank, rows in padded batches, probabilities out."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

from kevscore.plan import plan_batches, plan_waves
from kevscore.prompt import Encoded


class Progress:
    """Callbacks for long phases; the CLI passes a rich implementation, tests and libraries this no-op."""

    def start(self, phase: str, total: int) -> None: ...

    def advance(self, phase: str, n: int) -> None: ...

    def warn(self, message: str) -> None:
        """A problem the run recovers from (e.g. a corrupt on-disk bank entry), on one line."""
        print(f"warning: {message}", file=sys.stderr)


@dataclass(slots=True)
class RunStats:
    rows: int = 0
    prefixes: int = 0
    prefix_tokens: int = 0
    branch_tokens: int = 0
    prefilled: int = 0
    waves: int = 0
    batches: int = 0
    prefill_s: float = 0.0
    score_s: float = 0.0


@dataclass(slots=True)
class Scores:
    probs: list[list[float]]
    label_mass: list[float]
    stats: RunStats = field(default_factory=RunStats)

    @classmethod
    def empty(cls, rows: int) -> Scores:
        return cls([[] for _ in range(rows)], [0.0] * rows, RunStats(rows=rows))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    def __init__(self, runner, max_rows: int = 64, max_tokens: int = 8192, prefill_tokens: int = 8192,
                 store=None):
        self.runner = runner
        self.max_rows, self.max_tokens, self.prefill_tokens = max_rows, max_tokens, prefill_tokens
        self.store = store  # a kevscore.bank_store.BankStore: entries loaded from / saved to disk

    def run(self, enc: Encoded, path: str, progress: Progress | None = None) -> Scores:
        progress = progress or Progress()
        bank = self.runner.bank
        doc_tokens = [len(p) for p in enc.prefixes]
        scores = Scores.empty(len(enc))
        stats = scores.stats
        stats.prefixes, stats.prefix_tokens = len(enc.prefixes), sum(doc_tokens)
        stats.branch_tokens = sum(len(b) for b in enc.branches)
        rows_of: list[list[int]] = [[] for _ in enc.prefixes]
        for r, p in enumerate(enc.row_prefix):
            rows_of[p].append(r)
        progress.start("prefill", len(enc.prefixes))
        progress.start("score", len(enc))
        for wave in plan_waves(doc_tokens, bank.layout.entries, bank.layout.tokens):
            stats.waves += 1
            slot_of = self.prefill_wave(enc, wave, stats, progress)
            self.score_rows(enc, [r for d in wave for r in rows_of[d]], slot_of, path, scores, progress)
        return scores

    def prefill_wave(self, enc: Encoded, wave: list[int], stats: RunStats,
                     progress: Progress | None = None) -> dict[int, int]:
        """Reset the bank and prefill the wave's documents; returns each document's bank slot. With a
        store, entries it has are loaded into their slots instead, and the prefilled ones saved."""
        progress = progress or Progress()
        bank = self.runner.bank
        bank.reset()
        slot_of = {d: bank.alloc(len(enc.prefixes[d])) for d in wave}
        bank.publish()
        cold = wave
        if self.store is not None:
            loaded = self.store.load(bank, enc.prefixes, wave, slot_of)
            progress.advance("prefill", len(loaded))
            cold = [d for d in wave if d not in loaded]
        self.prefill_into(enc, cold, slot_of, stats, progress)
        if self.store is not None:
            self.store.save(bank, enc.prefixes, cold, slot_of)
        return slot_of

    def prefill_into(self, enc: Encoded, docs: list[int], slot_of: dict[int, int], stats: RunStats,
                     progress: Progress | None = None) -> None:
        """Prefill `docs` into their bank slots, already allocated and published by the caller."""
        progress = progress or Progress()
        t0 = time.perf_counter()
        for group in self._prefill_groups(enc, docs):
            self.runner.prefill([enc.prefixes[d] for d in group], [slot_of[d] for d in group])
            progress.advance("prefill", len(group))
        _sync(self.runner.device)
        stats.prefill_s += time.perf_counter() - t0
        stats.prefilled += len(docs)

    def _prefill_groups(self, enc: Encoded, wave: list[int]) -> list[list[int]]:
        """Documents sorted by length, packed into groups of at most `prefill_tokens` tokens."""
        groups: list[list[int]] = []
        used = 0
        for d in sorted(wave, key=lambda d: len(enc.prefixes[d])):
            n = len(enc.prefixes[d])
            if not groups or used + n > self.prefill_tokens:
                groups.append([])
                used = 0
            groups[-1].append(d)
            used += n
        return groups

    def score_rows(self, enc: Encoded, rows: list[int], slot_of: dict[int, int], path: str,
                   scores: Scores, progress: Progress | None = None) -> None:
        """Score `rows` (whose documents are in the bank at `slot_of`) into `scores`."""
        progress = progress or Progress()
        branch_len = {r: len(enc.branches[r]) for r in rows}
        prefix_len = {r: len(enc.prefixes[enc.row_prefix[r]]) for r in rows}
        t0 = time.perf_counter()
        for batch in plan_batches(rows, branch_len, prefix_len, self.max_rows, self.max_tokens):
            hidden = self.runner.score(batch, [enc.branches[r] for r in batch.rows],
                                       [slot_of[enc.row_prefix[r]] for r in batch.rows],
                                       [prefix_len[r] for r in batch.rows], path)
            logits, lse = self.runner.label_scores(hidden, [enc.label_ids[r] for r in batch.rows])
            probs = torch.softmax(logits.double(), -1).cpu()
            mass = torch.exp(torch.logsumexp(logits.double(), -1) - lse.double()).cpu()
            for i, r in enumerate(batch.rows):
                scores.probs[r] = probs[i, : len(enc.label_ids[r])].tolist()
                scores.label_mass[r] = float(mass[i])
            scores.stats.batches += 1
            progress.advance("score", len(batch.rows))
        _sync(self.runner.device)
        scores.stats.score_s += time.perf_counter() - t0
