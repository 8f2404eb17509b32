"""The scoring pipeline: documents in waves through the bank, rows in batches, probabilities out."""
from __future__ import annotations

import sys
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from kevscore import faults
from kevscore.engine.backend import queue_mark, release_cache, synchronize
from kevscore.engine.label_scoring import Scoring, scorings
from kevscore.engine.plan import Batch, plan_batches, plan_waves
from kevscore.engine.runner import PAD_WASTE
from kevscore.errors import KevscoreFailure, first_line
from kevscore.model.prompt import Encoded


class Reporter:
    """What a run reports as it goes: progress counts per phase, events, warnings. The CLI passes its
    progress bars or JSON log (kevscore.cli); tests and libraries this quiet one (warnings to stderr)."""

    def start(self, phase: str, total: int, done: int = 0) -> None: ...

    def advance(self, phase: str, n: int) -> None: ...

    def event(self, name: str, **fields) -> None:
        """Something a log should record (a wave's bank use, a part written, an OOM retry, ...)."""

    def warn(self, message: str) -> None:
        """A problem the run recovers from (e.g. a corrupt on-disk bank entry), on one line."""
        print(f"warning: {message}", file=sys.stderr)

    def phase(self, name: str) -> AbstractContextManager:
        """Wraps the launches of one prefill or scoring phase (benchmarks time the GPU between phases)."""
        return nullcontext()


QUIET = Reporter()  # the default reporter: no progress display, warnings to stderr


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
    capture_s: float = 0.0  # of score_s: capturing new graph buckets (their eager warm-up runs included)
    captures: int = 0       # graph buckets captured
    oom_retries: int = 0  # batches or prefill groups split after running out of memory
    read_s: float = 0.0   # jobs: reading and tokenizing windows
    write_s: float = 0.0  # jobs: writing parts and merging the output


@dataclass(slots=True)
class Scores:
    probs: list[list[float]]
    label_mass: list[float]
    stats: RunStats = field(default_factory=RunStats)
    failed: dict[int, str] = field(default_factory=dict)  # row -> why it failed on its own (skip_failed)

    @classmethod
    def empty(cls, rows: int, stats: RunStats | None = None) -> Scores:
        """No row scored yet; `stats` (a job's, accumulating over its windows), else new ones."""
        return cls([[] for _ in range(rows)], [0.0] * rows, stats or RunStats(rows=rows))


class Engine:
    def __init__(self, runner, max_rows: int = 64, max_tokens: int = 16384, prefill_tokens: int = 8192,
                 store=None, stop=None, skip_failed: bool = False):
        self.runner, self.max_rows, self.max_tokens, self.prefill_tokens = runner, max_rows, max_tokens, prefill_tokens
        self.store = store  # a kevscore.engine.bank_store.BankStore: entries loaded from / saved to disk
        self.stop = stop    # a kevscore.faults.StopSignals: checked between batches and prefill groups
        self.skip_failed = skip_failed  # a row that fails alone (out of memory) is reported, not fatal
        self.prefill_queued = None  # the last prefill's (queue mark at its end, host time then, its stats)

    def run(self, enc: Encoded, path: str, progress: Reporter = QUIET) -> Scores:
        scores = Scores.empty(len(enc))
        progress.start("prefill", len(enc.prefixes))
        progress.start("score", len(enc))
        self.run_waves(enc, path, scores, progress)
        return scores

    def run_waves(self, enc: Encoded, path: str, scores: Scores, progress: Reporter = QUIET, doc_ids=None) -> None:
        """Every row of `enc`, wave by wave through the bank, into `scores` (its stats accumulate). A store is told
        the rows' document ids (`doc_ids`: a list of str, None without them), which its index records with their
        entries."""
        if self.store is not None:
            self.store.note_documents(enc.prefixes, enc.row_prefix, doc_ids)
        doc_tokens = [len(p) for p in enc.prefixes]
        stats = scores.stats
        stats.prefixes += len(enc.prefixes)
        stats.prefix_tokens += sum(doc_tokens)
        stats.branch_tokens += sum(len(b) for b in enc.branches)
        rows_of: list[list[int]] = [[] for _ in enc.prefixes]
        for r, p in enumerate(enc.row_prefix):
            rows_of[p].append(r)
        for wave in plan_waves(doc_tokens, self.runner.bank.layout.entries, self.runner.bank.layout.tokens):
            stats.waves += 1
            slot_of = self.prefill_wave(enc, wave, stats, progress)
            self.score_rows(enc, [r for d in wave for r in rows_of[d]], slot_of, path, scores, progress)

    def _between(self, point: str) -> None:
        """After a prefill group or a batch: the fault point a test may name, then a requested stop."""
        faults.point(point)
        if self.stop is not None:
            self.stop.check()

    def prefill_wave(self, enc: Encoded, wave: list[int], stats: RunStats, progress: Reporter = QUIET) -> dict[int, int]:
        """Reset the bank and prefill the wave's documents; returns each document's bank slot. With a
        store, entries it has are loaded into their slots instead, and the prefilled ones saved."""
        bank = self.runner.bank
        bank.reset()
        slot_of = {d: bank.alloc(len(enc.prefixes[d])) for d in wave}
        bank.publish()
        progress.event("wave", documents=len(wave), entries=bank.used_entries, entry_capacity=bank.layout.entries,
                       tokens=bank.used_tokens, token_capacity=bank.layout.tokens)
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
                     progress: Reporter = QUIET) -> None:
        """Prefill `docs` into their bank slots, already allocated and published by the caller. Returns once the
        work is queued (scoring queues behind it); the scoring that follows adds to `stats.prefill_s` the seconds
        the GPU worked on past that (`_settle_prefill`)."""
        t0 = time.perf_counter()
        try:
            with progress.phase("prefill"):
                for group in self._prefill_groups(enc, docs):
                    self._prefill_group(enc, group, slot_of, stats, progress)
                    progress.advance("prefill", len(group))
                    self._between("prefill")
        finally:
            stats.prefill_s += time.perf_counter() - t0
            self.prefill_queued = (queue_mark(self.runner.device), time.perf_counter(), stats)
        stats.prefilled += len(docs)

    def _settle_prefill(self, end: torch.cuda.Event | None, now: float) -> float:
        """Charge the prefill queued before this scoring the seconds its GPU work ran past its launches (`end`:
        the queue's mark at the scoring's end, done at `now`); returns when that prefill ended (0: none)."""
        (mark, launched, stats), self.prefill_queued = self.prefill_queued or (None, 0.0, RunStats()), None
        ended = now - mark.elapsed_time(end) / 1000 if mark is not None else launched
        stats.prefill_s += max(0.0, ended - launched)
        return ended

    def _prefill_group(self, enc: Encoded, group: list[int], slot_of: dict[int, int], stats: RunStats,
                       progress: Reporter) -> None:
        """Prefill a group; out of memory, prefill it as two halves (each document's entry does not depend
        on its group-mates), down to one document, which then fails the run."""
        try:
            faults.inject_oom("docs", len(group))
            self.runner.prefill([enc.prefixes[d] for d in group], [slot_of[d] for d in group])
        except torch.OutOfMemoryError as exc:
            release_cache(self.runner.device)
            tokens = sum(len(enc.prefixes[d]) for d in group)
            if len(group) == 1:
                raise KevscoreFailure(f"out of memory prefilling one document of {tokens} tokens "
                                    f"({first_line(exc)}); lower --bank-capacity or --window") from exc
            half = len(group) // 2
            stats.oom_retries += 1
            progress.warn(f"out of memory prefilling {len(group)} documents ({tokens} tokens); retrying as "
                          f"{half} + {len(group) - half}")
            progress.event("oom", phase="prefill", rows=len(group), tokens=tokens, split=[half, len(group) - half])
            self._prefill_group(enc, group[:half], slot_of, stats, progress)
            self._prefill_group(enc, group[half:], slot_of, stats, progress)

    def _prefill_groups(self, enc: Encoded, wave: list[int]) -> list[list[int]]:
        """Documents sorted by length, packed into groups of at most `prefill_tokens` tokens (as waves are planned;
        for a runner that asks for `similar_lengths`, also padded to their longest by at most PAD_WASTE)."""
        order = sorted(wave, key=lambda d: len(enc.prefixes[d]))
        lengths = [len(enc.prefixes[d]) for d in order]
        waste = PAD_WASTE if getattr(self.runner, "similar_lengths", False) else None
        return [[order[i] for i in group] for group in plan_waves(lengths, len(order), self.prefill_tokens, waste)]

    def score_rows(self, enc: Encoded, rows: list[int], slot_of: dict[int, int], path: str,
                   scores: Scores, progress: Reporter = QUIET) -> None:
        """Score `rows` (whose documents are in the bank at `slot_of`) into `scores`: rows whose labels are one
        token each first, then the others (`kevscore.engine.label_scoring`)."""
        other = faults.wrong_entry(list(slot_of))  # identity unless a test injects the fault
        slot_of = {d: slot_of[other[d]] for d in slot_of}
        prefix_len = {r: len(enc.prefixes[other[enc.row_prefix[r]]]) for r in rows}
        t0, captured = time.perf_counter(), getattr(self.runner, "capture_s", 0.0)
        graphs = len(getattr(self.runner, "graphs", ()))
        try:
            with progress.phase("score"):
                for scoring in scorings(enc, rows):
                    pending = None  # the batch launched before: finished while the GPU runs the next one
                    for batch in self._batches(scoring, scoring.units, prefix_len, self.max_rows):
                        launched = self._score_batch(enc, scoring, batch, slot_of, prefix_len, path, scores, progress)
                        self._finish_batch(scoring, pending, scores, progress)
                        pending = launched
                        self._between("score")
                    self._finish_batch(scoring, pending, scores, progress)
        finally:
            end = queue_mark(self.runner.device)
            synchronize(self.runner.device)
            now = time.perf_counter()
            scores.stats.score_s += now - max(t0, self._settle_prefill(end, now))
            scores.stats.capture_s += getattr(self.runner, "capture_s", 0.0) - captured
            scores.stats.captures += len(getattr(self.runner, "graphs", ())) - graphs

    def _batches(self, scoring: Scoring, units: list[int], prefix_len: dict[int, int], max_rows: int) -> list[Batch]:
        """A scoring's `units` in batches (`plan_batches`) by their branch lengths, their documents' lengths (`prefix_len`
        of each row) and their positions to score, within the engine's limits."""
        return plan_batches(units, {u: len(scoring.tokens(u)) for u in units},
                            {u: prefix_len[scoring.row(u)] for u in units}, max_rows, self.max_tokens,
                            {u: scoring.scored(u) for u in units}, self.runner.exact_from)

    def _score_batch(self, enc: Encoded, scoring: Scoring, batch: Batch, slot_of: dict[int, int],
                     prefix_len: dict[int, int], path: str, scores: Scores, progress: Reporter):
        """Launch one batch of a scoring's units and its scores' copy to the host; returns what `_finish_batch`
        takes once the copy is done (None when this call finished the batch itself). Out of memory, score it as
        two smaller batches (and plan later ones no larger), down to one unit, whose row then fails: reported
        with skip_failed, else the run stops."""
        rows = [scoring.row(u) for u in batch.rows]
        try:
            faults.inject_oom("rows", len(batch.rows))
            hidden = self.runner.score(batch, [scoring.tokens(u) for u in batch.rows],
                                       [slot_of[enc.row_prefix[r]] for r in rows], [prefix_len[r] for r in rows], path)
            out = scoring.device_scores(self.runner, batch, hidden)
        except torch.OutOfMemoryError as exc:
            release_cache(self.runner.device)
            n = len(batch.rows)
            if n == 1:
                r = rows[0]
                why = (f"out of memory scoring this row alone ({len(enc.branches[r])} question tokens, "
                       f"{prefix_len[r]} document tokens)")
                if not self.skip_failed:
                    raise KevscoreFailure(f"{why}: {first_line(exc)}; pass --skip-invalid to report such rows "
                                        "and go on") from exc
                scores.failed[r] = why
                progress.warn(f"{why}; reported in the errors file")
                progress.advance("score", scoring.fail(batch.rows[0]))
                return None
            half = n // 2
            self.max_rows = min(self.max_rows, max(half, n - half))
            scores.stats.oom_retries += 1
            progress.warn(f"out of memory scoring a batch of {n} rows x {batch.length} tokens; retrying as "
                          f"{half} + {n - half} rows, later batches at most {self.max_rows} rows")
            progress.event("oom", phase="score", rows=n, length=batch.length, split=[half, n - half])
            for part in (batch.rows[:half], batch.rows[half:]):  # each half one batch, whatever its rows
                sub, = self._batches(scoring, part, prefix_len, max(self.max_rows, len(part)))
                launched = self._score_batch(enc, scoring, sub, slot_of, prefix_len, path, scores, progress)
                self._finish_batch(scoring, launched, scores, progress)
            return None
        if not out.is_cuda:
            return batch, out.clone(), None  # the runner may reuse its output buffer for the next batch
        # one read back, queued behind the batch (so before a next replay overwrites the graph's output)
        host = out.to("cpu", non_blocking=True)
        return batch, host, torch.cuda.current_stream().record_event()

    def _finish_batch(self, scoring: Scoring, launched: tuple | None, scores: Scores, progress: Reporter) -> None:
        """The scores of a batch `_score_batch` launched (None: none to finish), once its copy to the host is done:
        into `scores`, float64 on the host."""
        if launched is None:
            return
        batch, host, copied = launched
        if copied is not None:
            copied.synchronize()
        done = scoring.finish(batch, host.double())
        for r, probs, mass in done:
            if r not in scores.failed:  # a row of several branches, one of which failed alone
                scores.probs[r], scores.label_mass[r] = probs, mass
        scores.stats.batches += 1
        progress.advance("score", len(done))
