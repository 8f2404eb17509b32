"""The `run` job: scan and validate the input, then score it window by window into resumable part files,
merged into the output in input order at the end.

    scan (validation, rows -> documents; kevscore.stream) -> load the model -> token lengths (validation)
      -> windows of documents (kevscore.plan) -> bank sized for one window
      -> per window not yet done: read its rows, encode, prefill + score (waves), write its part
      -> merge the parts into the output (atomically), remove them

Host memory is bounded by a window (its texts, token ids and scores) plus a few bytes per input row for
the plan; GPU memory by the bank (waves inside a window when it does not fit).
"""
from __future__ import annotations

import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kevscore.backend import build_runner, invariant_threads, resolve_device
from kevscore.bank_store import BankStats, BankStore, check_bank_dir, model_fingerprint
from kevscore.checkpoint import MODEL_NAMES, load_checkpoint, peek_config
from kevscore.data import check_output_path, default_output_path, output_table
from kevscore.engine import LOW_MASS, Engine, Progress, RunStats, Scores
from kevscore.errors import KevscoreError
from kevscore.faults import Interrupted, StopSignals
from kevscore.parts import (ERRORS_SCHEMA, PartStore, check_parts_dir, errors_path, file_sha256, job_digest,
                            merged_output, output_job)
from kevscore.plan import Windows, plan_windows
from kevscore.prompt import encode, load_template
from kevscore.shard import assign_documents
from kevscore.stream import InputScan, measure_tokens, scan_input
from kevscore.warmup import prepare_device

PATHS = ("indexed", "gathered")
WINDOW_DOCS = 1024          # documents per window (--window)
WINDOW_ROWS = 65536         # rows per window; a document with more rows is split over windows of its own
WINDOW_TOKENS = 1 << 20     # document tokens per window
WARM_UP_WAIT_S = 300        # the longest the job waits for its kernels' compilation (kevscore.warmup)


@dataclass(slots=True)
class RunOptions:
    input: Path
    documents: Path | None = None
    output: Path | None = None
    model: str = "demo"
    device: str = "auto"
    path: str = "indexed"
    labels: list[str] = field(default_factory=lambda: ["Yes", "No"])
    template: Path | None = None
    batch_rows: int = 64
    overwrite: bool = False
    bank_capacity: int | None = None
    eager: bool = False
    bank: Path | None = None          # on-disk bank directory (kevscore.bank_store)
    bank_max_gb: float | None = None  # LRU-evict the on-disk bank down to this size
    shard: tuple[int, int] | None = None  # (rank, world): score only this rank's documents (kevscore.shard)
    batch_invariant: bool = False  # one row per batch, one document per prefill: results independent of batch-mates
    window: int = WINDOW_DOCS     # documents per window: host memory is bounded by a window, not the input
    restart: bool = False         # discard the completed parts of an interrupted run instead of resuming it
    skip_invalid: bool = False    # rows that cannot be scored on their own go to an errors Parquet


@dataclass(slots=True)
class RunResult:
    output: Path
    stats: RunStats           # rows: the output's rows (resumed parts included); times: this call's work
    documents: int
    device: str
    model: str
    load_s: float
    bank: BankStats | None = None
    errors: Path | None = None    # the errors Parquet (--skip-invalid)
    set_aside: int = 0            # rows in it
    windows: int = 0
    resumed: int = 0              # windows an earlier, interrupted run had completed
    resumed_rows: int = 0
    wall_s: float = 0.0
    peak_rss: int = 0             # bytes: this process's peak resident set size (getrusage)
    peak_gpu: int | None = None   # bytes: torch.cuda.max_memory_allocated, on a GPU
    load_phases: dict[str, float] = field(default_factory=dict)  # load_s in parts: scan, checkpoint, tokens, runner, identity
    warm_up: dict | None = None   # the GPU warm-up thread's seconds and error (kevscore.warmup)
    already_complete: bool = False  # the output was this very job's, merged by an earlier run: nothing done
    warnings: list[str] = field(default_factory=list)  # about the results (e.g. labels holding little mass)


def check_options(opts: RunOptions) -> None:
    if opts.path not in PATHS:
        raise KevscoreError(f"--path {opts.path}: choose indexed or gathered")
    if opts.batch_rows < 1:
        raise KevscoreError(f"--batch-rows {opts.batch_rows}: must be at least 1")
    if opts.bank_capacity is not None and opts.bank_capacity < 1:
        raise KevscoreError(f"--bank-capacity {opts.bank_capacity}: must be at least 1")
    if opts.window < 1:
        raise KevscoreError(f"--window {opts.window}: must be at least 1")
    if not opts.labels or any(not label for label in opts.labels) or len(set(opts.labels)) != len(opts.labels):
        raise KevscoreError(f"--labels {','.join(opts.labels)}: give distinct, non-empty labels")
    if opts.bank_max_gb is not None and opts.bank is None:
        raise KevscoreError("--bank-max-gb needs --bank DIR")
    if opts.bank_max_gb is not None and not opts.bank_max_gb > 0:
        raise KevscoreError(f"--bank-max-gb {opts.bank_max_gb}: must be more than 0")
    if opts.bank is not None:
        check_bank_dir(Path(opts.bank), create=True)


def run_job(opts: RunOptions, progress: Progress | None = None) -> RunResult:
    with invariant_threads(resolve_device(opts.device), opts.batch_invariant):
        return _run_job(opts, progress)


def _run_job(opts: RunOptions, progress: Progress | None = None) -> RunResult:
    started = time.perf_counter()
    progress = progress or Progress()
    check_options(opts)
    output = Path(opts.output) if opts.output else default_output_path(opts.input)
    t0 = time.perf_counter()
    device = resolve_device(opts.device)
    # the GPU's context, imports and kernel compilation, on a thread while the input is read and the weights load
    warm_up = prepare_device(device, peek_config(opts.model), opts.path)
    scan = scan_input(Path(opts.input), Path(opts.documents) if opts.documents else None, opts.skip_invalid,
                      keep_texts=opts.shard is not None)
    ours = merged_output(output)  # a run killed after renaming its output, before removing its parts
    finished = None if opts.overwrite or ours or not output.is_file() else output_job(output)
    check_outputs(opts, scan, output, opts.overwrite or ours or finished is not None)
    load_phases: dict[str, float] = {}

    def lap(phase: str) -> None:  # the seconds since the last lap, as load_phases[phase]
        load_phases[phase] = time.perf_counter() - t0 - sum(load_phases.values())

    lap("scan")
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
    ckpt = load_checkpoint(opts.model, device)
    lap("checkpoint")
    template = load_template(opts.template, ckpt.tokenizer)
    max_positions = ckpt.config.max_position_embeddings
    doc_tokens = measure_tokens(scan, ckpt.tokenizer, template, opts.labels, max_positions, opts.skip_invalid)
    lap("tokens")
    doc_of_row = scan.doc_of_row
    if opts.shard is not None:  # one rank of a distributed job: the rows of its documents only
        doc_of_row = shard_documents(scan, *opts.shard)
    windows = plan_windows(doc_of_row, doc_tokens, opts.window, WINDOW_ROWS, WINDOW_TOKENS)
    runner = build_runner(ckpt, device, bank_documents(windows, doc_of_row, doc_tokens), opts.bank_capacity,
                          opts.eager)
    warm_up_report = warm_up.join(WARM_UP_WAIT_S) if warm_up is not None else None
    lap("runner")
    backend = runner.model.ops.__name__.rsplit(".", 1)[-1]
    fingerprint = model_fingerprint(ckpt, runner.bank.conv.dtype, backend)
    identity = job_identity(opts, scan, ckpt.name, fingerprint.digest, device.type, windows)
    lap("identity")
    if finished is not None:
        return finished_job(opts, output, finished == job_digest(identity), ckpt.name, str(device), windows,
                            time.perf_counter() - started)
    parts = PartStore(output, identity, windows.rows, opts.restart, progress.warn)
    store = None
    try:
        if not opts.overwrite and output.exists() and not parts.finished():
            check_output_path(output, scan.sources, False)  # --restart of another job over an existing output
        store = open_store(opts, fingerprint, progress) if opts.bank is not None else None
        load_s = time.perf_counter() - t0
        result = RunResult(output, RunStats(), len(np.unique(doc_of_row[windows.of_row >= 0])), str(device),
                           ckpt.name, load_s, windows=len(windows), resumed=len(parts.done),
                           resumed_rows=sum(parts.done.values()), load_phases=load_phases,
                           warm_up=warm_up_report)
        if parts.finished():
            result.stats.rows = parts.manifest["merged"]["rows"]
        else:
            engine = Engine(runner, max_rows=1 if opts.batch_invariant else opts.batch_rows,
                            prefill_tokens=1 if opts.batch_invariant else runner.prefill_tokens, store=store,
                            skip_failed=opts.skip_invalid)
            with StopSignals(progress.warn) as stop:
                engine.stop = stop
                score_windows(opts, scan, windows, engine, parts, ckpt.tokenizer, template, max_positions,
                              result.stats, progress)
            t1 = time.perf_counter()
            set_aside = set_aside_table(scan) if opts.skip_invalid and (opts.shard or (0, 1))[0] == 0 else None
            if opts.skip_invalid and set_aside is None:
                set_aside = ERRORS_SCHEMA.empty_table()
            result.stats.rows = parts.merge(windows.of_row, set_aside)
            result.stats.write_s += time.perf_counter() - t1
            progress.event("merged", output=str(output), rows=result.stats.rows)
    except Interrupted as exc:
        if parts.created and not parts.done:
            parts.remove()
            raise Interrupted(f"interrupted ({exc}) before any window was complete; nothing was written") from None
        parts.close()
        done = sum(parts.done.values())
        raise Interrupted(f"interrupted ({exc}): {len(parts.done)} of {len(windows)} windows ({done:,} rows) are kept "
                          f"in {parts.dir}; rerun the same command to resume") from None
    except BaseException:
        if parts.created and not parts.done:
            parts.remove()  # nothing completed: leave no trace
        else:
            parts.close()
        raise
    finally:
        if store is not None:
            store.close()
    parts.remove()
    scored = result.stats.rows - result.resumed_rows
    if result.stats.low_mass * 2 > scored:
        result.warnings.append(f"the labels ({', '.join(map(repr, opts.labels))} unless a labels column says "
                               f"otherwise) hold less than {LOW_MASS:.0%} of the model's probability on "
                               f"{result.stats.low_mass:,} of {scored:,} rows: the model would answer with other "
                               "tokens; check the labels' case and leading spaces (see label_mass)")
        progress.warn(result.warnings[-1])
    if opts.skip_invalid:
        result.errors = errors_path(output)
        result.set_aside = pq.read_metadata(result.errors).num_rows
    result.bank = store.stats if store is not None else None
    result.wall_s = time.perf_counter() - started
    result.peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    if device.type == "cuda":
        import torch

        result.peak_gpu = int(torch.cuda.max_memory_allocated(device))
    return result


def check_outputs(opts: RunOptions, scan: InputScan, output: Path, overwrite: bool) -> None:
    """The output, its errors file and its parts directory must not be (or hold) anything this run reads:
    the input files, the template, files of the model or bank directory."""
    inputs = scan.sources + ([Path(opts.template)] if opts.template else [])
    model = Path(opts.model)
    within = [d for d in (model if model.is_dir() and opts.model not in MODEL_NAMES else None,
                          opts.bank) if d is not None]
    check_output_path(output, inputs, overwrite, within)
    if opts.skip_invalid:
        check_output_path(errors_path(output), inputs, overwrite, within)
    check_parts_dir(output, inputs)


def finished_job(opts: RunOptions, output: Path, same: bool, model: str, device: str, windows: Windows,
                 wall_s: float) -> RunResult:
    """An existing output merged by a job: this very job (nothing to do), or another one (refused)."""
    errors = errors_path(output) if opts.skip_invalid else None
    if not same or (errors is not None and not errors.is_file()):
        raise KevscoreError(f"{output}: already exists (the output of another job); pass --overwrite to replace it")
    rows = pq.read_metadata(output).num_rows
    result = RunResult(output, RunStats(rows=rows), int(windows.docs.sum()), device, model, 0.0, errors=errors,
                       windows=len(windows), resumed=len(windows), resumed_rows=rows, wall_s=wall_s,
                       already_complete=True)
    if errors is not None:
        result.set_aside = pq.read_metadata(errors).num_rows
    return result


def score_windows(opts: RunOptions, scan: InputScan, windows: Windows, engine: Engine, parts: PartStore,
                  tokenizer, template, max_positions: int, stats: RunStats, progress: Progress) -> None:
    """Score every window without a completed part, writing each window's part as it completes. The next
    window is read and tokenized on a worker thread while this one is scored (two windows in memory)."""
    todo = [w for w in range(len(windows)) if w not in parts.done]
    resumed_rows = sum(parts.done.values())
    total_rows = int(windows.rows.sum())
    progress.start("prefill", int(windows.docs[todo].sum()) if todo else 0)
    progress.start("score", total_rows, done=total_rows - int(windows.rows[todo].sum()) if todo else total_rows)
    progress.event("start", rows=total_rows, windows=len(windows), windows_done=len(parts.done),
                   rows_done=resumed_rows, set_aside=len(scan.invalid), parts=str(parts.dir))
    reader = scan.reader()

    def load(w: int):
        table = reader.read(windows.rows_of(w))
        return table, encode(table, tokenizer, template, opts.labels, max_positions)

    pool = ThreadPoolExecutor(1, thread_name_prefix="kevscore-read")
    try:
        upcoming = pool.submit(load, todo[0]) if todo else None
        for k, w in enumerate(todo):
            t0 = time.perf_counter()
            table, enc = upcoming.result()
            stats.read_s += time.perf_counter() - t0  # the time scoring waited for its window
            upcoming = pool.submit(load, todo[k + 1]) if k + 1 < len(todo) else None
            progress.event("window", window=w, rows=len(enc), documents=len(enc.prefixes))
            if engine.store is not None:
                engine.store.note_documents(enc.prefixes, _doc_ids(table, enc))
            scores = Scores([[] for _ in range(len(enc))], [0.0] * len(enc), stats)
            engine.run_waves(enc, opts.path, scores, progress)
            progress.advance("prefill", max(0, int(windows.docs[w]) - len(enc.prefixes)))  # duplicate texts
            t1 = time.perf_counter()
            parts.write(w, *_part_tables(table, enc, scores))
            stats.write_s += time.perf_counter() - t1
            progress.event("part", window=w, rows=len(enc) - len(scores.failed), failed=len(scores.failed),
                           windows_done=len(parts.done), windows=len(windows))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _part_tables(table, enc, scores: Scores) -> tuple[pa.Table, pa.Table | None]:
    """A window's scores in output form, and its rows that failed on their own (or None)."""
    ok = [i for i in range(len(enc)) if i not in scores.failed]
    kept = table if len(ok) == len(enc) else table.take(ok)
    part = output_table(kept, [enc.labels[i] for i in ok], [scores.probs[i] for i in ok],
                        [scores.label_mass[i] for i in ok])
    if not scores.failed:
        return part, None
    failed = sorted(scores.failed)
    errors = pa.table({"row": [table.rows[i] for i in failed],
                       "doc_id": [table.doc_ids[i] if table.doc_ids else None for i in failed],
                       "question_id": [table.question_ids[i] if table.question_ids else None for i in failed],
                       "reason": [scores.failed[i] for i in failed]}, schema=ERRORS_SCHEMA)
    return part, errors


def _doc_ids(table, enc) -> list[list[str]]:
    doc_ids: list[list[str]] = [[] for _ in enc.prefixes]
    if table.doc_ids:
        for r, p in enumerate(enc.row_prefix):
            if table.doc_ids[r] not in doc_ids[p]:
                doc_ids[p].append(table.doc_ids[r])
    return doc_ids


def shard_documents(scan: InputScan, rank: int, world: int) -> np.ndarray:
    """doc_of_row keeping only the rows of documents that kevscore.shard assigns to `rank` (others -1)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in 0..{world - 1}")
    assignment = assign_documents(scan.costs(), world)
    mine = np.asarray([assignment[k] == rank for k in scan.doc_keys] + [False], dtype=bool)
    return np.where(mine[scan.doc_of_row], scan.doc_of_row, -1).astype(np.int32)


def bank_documents(windows: Windows, doc_of_row: np.ndarray, doc_tokens: np.ndarray) -> list[int]:
    """Document lengths standing for the largest window (most tokens; as many entries as the window with
    the most documents; the longest document included), so the bank is sized for a window, not the input."""
    if not len(windows):
        return []
    biggest = int(np.argmax(windows.tokens))
    docs = np.unique(doc_of_row[windows.of_row == biggest])
    lengths = sorted(int(doc_tokens[d]) for d in docs)
    longest = int(doc_tokens[doc_of_row[windows.of_row >= 0]].max())
    if lengths[-1] < longest:
        lengths[0] = longest
    return lengths + [0] * max(0, int(windows.docs.max()) - len(lengths))


def job_identity(opts: RunOptions, scan: InputScan, model: str, fingerprint: str, device: str,
                 windows: Windows) -> dict:
    """What a job's results depend on; a resumed run must match it exactly."""
    def file(path):
        return None if path is None else {"name": Path(path).name, "sha256": file_sha256(Path(path))}

    return {
        "input": file(scan.path), "documents": file(scan.documents_path), "template": file(opts.template),
        "model": {"name": model, "fingerprint": fingerprint},
        "options": {"device": device, "path": opts.path, "labels": list(opts.labels), "batch_rows": opts.batch_rows,
                    "bank_capacity": opts.bank_capacity, "eager": opts.eager, "batch_invariant": opts.batch_invariant,
                    "window": opts.window, "shard": list(opts.shard) if opts.shard else None,
                    "skip_invalid": opts.skip_invalid},
        "plan": {"windows": len(windows), "rows": int(windows.rows.sum()), "digest": windows.digest()},
    }


def set_aside_table(scan: InputScan) -> pa.Table:
    """The rows the scan set aside, with their ids and reasons."""
    rows = np.asarray(sorted(scan.invalid), dtype=np.int64)
    ids = {"doc_id": [None] * len(rows), "question_id": [None] * len(rows)}
    cols = [c for c, has in (("doc_id", scan.has_doc_id), ("question_id", scan.has_question_id)) if has]
    if cols and len(rows):
        from kevscore.stream import _Cursor

        ids.update(_Cursor(scan.path, cols).take(rows))
    return pa.table({"row": rows, **ids, "reason": [scan.invalid[int(r)] for r in rows]}, schema=ERRORS_SCHEMA)


def open_store(opts: RunOptions, fingerprint, progress: Progress | None) -> BankStore:
    """The on-disk bank for this model (fingerprint: config, weights, bank dtype, ops backend)."""
    max_bytes = int(opts.bank_max_gb * 1e9) if opts.bank_max_gb is not None else None
    try:
        return BankStore(Path(opts.bank), fingerprint, max_bytes, warn=(progress or Progress()).warn)
    except OSError as exc:
        raise KevscoreError(f"{opts.bank}: cannot open the bank ({exc.strerror or exc})") from exc

