"""Scoring a job's windows: each read ahead on one thread, scored, its part written on another.

A window is read and tokenized ahead on one thread, run through the engine wave by wave, and its part
written on another while the next window is scored."""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import numpy as np
import pyarrow as pa

from kevscore.engine.bank_store import BankStore
from kevscore.engine.pipeline import Engine, Reporter, RunStats, Scores
from kevscore.engine.plan import Windows
from kevscore.faults import StopSignals
from kevscore.job.data import output_table
from kevscore.job.options import RunOptions
from kevscore.job.parts import PartStore, errors_table
from kevscore.job.rows import RowReader
from kevscore.job.scan import InputScan


def make_engine(opts: RunOptions, runner, store: BankStore | None = None, stop: StopSignals | None = None) -> Engine:
    """The engine a job scores with: one row per batch and one document per prefill with --batch-invariant."""
    return Engine(runner, max_rows=1 if opts.batch_invariant else opts.batch_rows, store=store, stop=stop,
                  prefill_tokens=1 if opts.batch_invariant else runner.prefill_tokens, skip_failed=opts.skip_invalid)


def read_window(reader: RowReader, windows: Windows, encode: Callable, w: int):
    """Window w's rows and their encoding (`encode`: the job's kevscore.model.prompt.encode)."""
    table = reader.read(windows.rows_of(w))
    return table, encode(table)


def score_windows(opts: RunOptions, scan: InputScan, windows: Windows, engine: Engine, parts: PartStore, encode: Callable,
                  stats: RunStats, progress: Reporter, rank: int = 0, first: Future | None = None) -> None:
    """Score every window of `rank` without a completed part. The next window is read and tokenized on one
    worker thread while this one is scored, and the last window's part is written on another (at most two
    windows' inputs and one window's output in memory); a failure on either thread ends the run with its error.
    `first`: window 0 already being read (`read_window`), used if it is the first to score."""
    mine = windows.of_rank(rank)
    todo = [w for w in mine if w not in parts.done]
    resumed_rows = sum(parts.done[w] for w in mine if w in parts.done)
    total_rows = int(windows.rows[mine].sum())
    progress.start("prefill", int(windows.docs[todo].sum()))
    progress.start("score", total_rows, done=total_rows - int(windows.rows[todo].sum()))
    progress.event("start", rows=total_rows, windows=len(mine), windows_done=len(mine) - len(todo),
                   rows_done=resumed_rows, set_aside=len(scan.invalid), parts=str(parts.dir))
    load = partial(read_window, RowReader(scan), windows, encode)

    def write(w: int, table, enc, scores: Scores) -> None:  # on the writing thread
        t0 = time.perf_counter()
        parts.write(w, *part_tables(table, enc, scores))
        stats.write_s += time.perf_counter() - t0  # only this thread adds to it while windows are scored
        progress.event("part", window=w, rows=len(enc) - len(scores.failed), failed=len(scores.failed),
                       windows_done=len(parts.done.keys() & set(mine)), windows=len(mine))

    reading = ThreadPoolExecutor(1, thread_name_prefix="kevscore-read")
    writing = ThreadPoolExecutor(1, thread_name_prefix="kevscore-write")
    last_write = writing.submit(lambda: None)  # the part before the first window's: none
    try:
        upcoming = first if todo[:1] == [0] else None  # window 0 read while the runner was built, or none
        for k, w in enumerate(todo):
            t0 = time.perf_counter()
            table, enc = (upcoming if upcoming is not None else reading.submit(load, w)).result()
            stats.read_s += time.perf_counter() - t0  # the time scoring waited for its window
            upcoming = reading.submit(load, todo[k + 1]) if k + 1 < len(todo) else None
            progress.event("window", window=w, rows=len(enc), documents=len(enc.prefixes))
            scores = Scores.empty(len(enc), stats)
            engine.run_waves(enc, opts.state_read, scores, progress, table.doc_ids)
            progress.advance("prefill", max(0, int(windows.docs[w]) - len(enc.prefixes)))  # duplicate texts
            last_write.result()  # the previous part is on disk (or its error is raised here)
            last_write = writing.submit(write, w, table, enc, scores)
        last_write.result()
    finally:
        reading.shutdown(wait=False, cancel_futures=True)
        writing.shutdown(wait=True)  # a stopped or failed run keeps the part being written


def part_tables(table, enc, scores: Scores) -> tuple[pa.Table, pa.Table]:
    """A window's scores in output form, and its rows that failed on their own (none: an empty table), split
    off the window's output table (a failed row has no labels scored)."""
    failed = np.asarray(sorted(scores.failed), dtype=np.int64)
    labels = [[] if i in scores.failed else ls for i, ls in enumerate(enc.labels)]
    part = output_table(table, labels, scores.probs, scores.label_mass)
    ids = part.take(failed).to_pydict()
    errors = errors_table(ids["row"], [scores.failed[i] for i in failed.tolist()], ids["doc_id"], ids["question_id"])
    return part.filter(np.isin(np.arange(len(enc)), failed, invert=True)), errors
