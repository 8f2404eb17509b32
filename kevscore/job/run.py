"""The `run` job: the input checked, then scored window by window into resumable parts, merged at the end.

    scan (validation, rows -> documents; kevscore.job.scan) -> load the model -> token lengths (validation)
      -> windows of documents (kevscore.engine.plan) -> bank sized for one window
      -> per window not yet done: read its rows, encode, prefill + score (waves), write its part
      -> merge the parts into the output (atomically), remove them

Host memory is bounded by a window (its texts, token ids and scores) plus a few bytes per input row for
the plan; GPU memory by the bank (waves inside a window when it does not fit).
"""
from __future__ import annotations

import gc
import resource
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from kevscore.engine.backend import build_runner, job_threads, release_cache, resolve_device, resolve_dtype
from kevscore.engine.bank import BankLayout
from kevscore.engine.bank_entry import Fingerprint, model_fingerprint, weights_digest
from kevscore.engine.bank_store import BankStats, BankStore
from kevscore.engine.pipeline import Reporter, RunStats
from kevscore.engine.plan import Windows, join_windows, plan_windows
from kevscore.engine.warmup import WarmUp, prepare_device
from kevscore.errors import KevscoreError
from kevscore.faults import Interrupted, StopSignals
from kevscore.job.files import STDOUT, Carry, Inputs, check_output_path, file_format, opened_inputs, output_path, to_stdout
from kevscore.job.labels import LabelTally, low_mass_warning
from kevscore.job.options import WINDOW_ROWS, WINDOW_TOKENS, RunOptions, carries, check_options
from kevscore.job.parts import ERRORS_SCHEMA, PartStore, check_parts_dir, errors_path, errors_table, merged_output, parts_dir
from kevscore.job.provenance import job_digest, job_identity, output_job
from kevscore.job.rows import Cursor, RowReader
from kevscore.job.scan import InputScan, scan_input
from kevscore.job.shard import assign_documents
from kevscore.job.tokens import measure_tokens
from kevscore.job.windows import make_engine, read_window, score_windows
from kevscore.model.checkpoint import MODEL_NAMES, Checkpoint, load_checkpoint, peek_config
from kevscore.model.config import KevConfig
from kevscore.model.prompt import encode, load_template

WARM_UP_WAIT_S = 300        # the longest the job waits for its kernels' compilation (kevscore.engine.warmup)


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
    load_phases: dict[str, float] = field(default_factory=dict)  # load_s in parts (scan, checkpoint, tokens, ...)
    warm_up: dict | None = None   # the GPU warm-up thread's seconds and error (kevscore.engine.warmup)
    already_complete: bool = False  # the output was this very job's, merged by an earlier run: nothing done
    warnings: list[str] = field(default_factory=list)  # about the results (e.g. labels holding little mass)
    labels: dict | None = None    # label mass min / median, low-mass rows, predictions per label (LabelTally)


@dataclass(slots=True)
class LoadedModel:
    """A model kept loaded between jobs (kevscore.api.Scorer): its checkpoint, once loaded, and the last
    job's runner, reused while its bank serves the next job as a new one would (`reusable`)."""
    ckpt: Checkpoint | None = None
    runner: object | None = None


def run_job(opts: RunOptions, progress: Reporter | None = None, loaded: LoadedModel | None = None) -> RunResult:
    """Score the input into the output (`-o -`: JSON Lines on stdout, written at the end); with `loaded`,
    on the model it holds (loading it there the first time)."""
    progress = progress or Reporter()
    with job_threads(device := resolve_device(opts.device), opts.batch_invariant):
        started = time.perf_counter()
        check_options(opts)
        stdout = str(opts.output) == STDOUT
        output = None if stdout else output_path(opts)
        file_format(output or "", written=True)  # an extension kevscore cannot write stops the run now
        with opened_inputs(opts) as inputs:
            for warning in inputs.case_warnings():
                progress.warn(warning)
            job = start_job(opts, inputs, output or inputs.stage / "stdout.jsonl", loaded or LoadedModel())
            result = finished_job(job) if job.finished is not None else score_and_merge(job, progress)
            try:  # the output is complete (-o -: copied to stdout last)
                if warning := low_mass_warning(result.labels or {}, result.stats.rows, list(opts.labels)):
                    result.warnings.append(warning)
                    progress.warn(warning)
                if opts.skip_invalid:
                    result.errors = errors_path(job.output)
                    result.set_aside = errors_rows(job.output)
                result.wall_s = time.perf_counter() - started
                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                result.peak_rss = rss * (1 if sys.platform == "darwin" else 1024)
                if device.type == "cuda":
                    result.peak_gpu = int(torch.cuda.max_memory_allocated(device))
                if stdout:
                    to_stdout(result.output)
                    result.output = Path(STDOUT)
            except KeyboardInterrupt:
                raise Interrupted(STDOUT_CUT if stdout else completed(output)) from None
        return result


STDOUT_CUT = "interrupted while writing the scores to stdout: they may be cut short; rerun the same command"


def completed(output: Path, parts: Path | None = None, stopped: str = "interrupted") -> str:
    """What a stop (`stopped`: an interrupt, a rank's loss) says once the output is complete (only the clean-up
    or the summary was left); `parts`: its parts directory, unless it was removed."""
    where = "the scores written to stdout are" if str(output) == STDOUT else f"{output} is"
    rest = f"{parts} is left over and can be deleted" if parts and parts.exists() else "there is nothing to rerun"
    return f"{stopped} after the output was complete: {where} whole; {rest}"


class Laps:
    """Seconds per phase of a job's start, each since the one before (RunResult.load_phases)."""

    def __init__(self):
        self.t0, self.phases = time.perf_counter(), {}

    def lap(self, phase: str) -> None:
        self.phases[phase] = time.perf_counter() - self.t0 - sum(self.phases.values())


def in_background(fn: Callable, *args) -> Future:
    """fn(*args) on a daemon thread of its own: a job that fails meanwhile exits without waiting for it."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - raised again by future.result() in the job's thread
            future.set_exception(exc)

    threading.Thread(target=run, name=f"kevscore-{fn.__name__}", daemon=True).start()
    return future


@dataclass(slots=True)
class Job:
    """A job: its checked input, model and window plan (`prepare`: what a run and a dry run start from), then
    its runner and identity (`start_job`: what scoring its windows and merging them need)."""
    opts: RunOptions
    inputs: Inputs
    output: Path | None           # None: a dry run's
    scan: InputScan
    device: torch.device
    dtype: torch.dtype            # the model's (--dtype on this device)
    ckpt: Checkpoint
    encode: Callable              # an InputTable's prompts tokenized (kevscore.model.prompt.encode, this job's)
    doc_tokens: np.ndarray        # prefix tokens per document
    doc_keys: np.ndarray | None   # prefix key per document (kevscore.model.prompt.prefix_key), with --bank only
    windows: Windows              # the rows it scores (of_row >= 0; their documents: scan.doc_of_row), in windows
    laps: Laps                    # scan, checkpoint, tokens so far
    warming: WarmUp | None        # the GPU warm-up thread (kevscore.engine.warmup), joined once the runner is built
    ranks: int = 1                # processes the windows are split over (kevscore.job.distributed)
    finished: str | None = None   # the job digest an existing output records (kevscore.job.provenance.output_job)
    runner: object | None = None  # runner.EagerRunner or cuda_runner.GraphRunner (job_runner)
    warm_up: dict | None = None   # the GPU warm-up thread's report (job_runner)
    fingerprint: Fingerprint | None = None  # the model's (kevscore.engine.bank_store): the identity's and the bank's
    identity: dict | None = None  # what the results depend on (job_identity)
    first_window: Future | None = None  # window 0's read_window, begun while the runner was built (a new job's)

    def documents(self) -> np.ndarray:
        """The documents of the rows it scores, each once (one split over several windows too)."""
        return np.unique(self.scan.doc_of_row[self.windows.of_row >= 0])


def prepare(opts: RunOptions, inputs: Inputs, loaded: LoadedModel, output: Path | None = None, ranks: int = 1) -> Job:
    """Scan and check the input (and the output, when given), load the model into `loaded` (unless it holds it),
    measure every prompt's tokens and cut the documents into windows (of `ranks` ranks, each window scored
    by one of them)."""
    laps = Laps()
    device = resolve_device(opts.device)
    dtype = resolve_dtype(opts.dtype, device)
    # the GPU's context, imports and kernel compilation, on a thread while the input is read and the weights
    # load: for a model's first job only (a loaded model's kernels are compiled)
    warming = prepare_device(device, peek_config(opts.model), opts.state_read, dtype) if loaded.ckpt is None else None
    laps.lap("gpu imports")
    scan = scan_input(inputs.questions.path, inputs.documents.path if inputs.documents else None,
                      opts.skip_invalid, keep_texts=opts.shard is not None or ranks > 1, carried=carries(opts, ranks))
    finished = check_outputs(opts, inputs, output) if output is not None else None
    laps.lap("scan")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    template, token_pass = None, None  # the pass starts as soon as the tokenizer is loaded

    def measure(tokenizer, cfg: KevConfig) -> None:  # the input is tokenized while the weights load
        nonlocal template, token_pass
        template = load_template(opts.template, tokenizer)
        token_pass = in_background(measure_tokens, scan, tokenizer, template, opts.labels,
                                   cfg.max_position_embeddings, opts.skip_invalid, opts.bank is not None)

    if loaded.ckpt is not None:
        measure(loaded.ckpt.tokenizer, loaded.ckpt.config)
    loaded.ckpt = loaded.ckpt or load_checkpoint(opts.model, device, tokenizer_ready=measure)
    laps.lap("checkpoint")
    doc_tokens, doc_keys = token_pass.result()
    laps.lap("tokens")
    prompts = partial(encode, tokenizer=loaded.ckpt.tokenizer, template=template, default_labels=opts.labels,
                      max_positions=loaded.ckpt.config.max_position_embeddings)
    # a shard of a job: the rows of its documents only
    doc_of_row = shard_documents(scan, *opts.shard) if opts.shard is not None else scan.doc_of_row
    # each rank's documents cut into windows as its shard would be, rank 0's first
    windows = join_windows([plan_windows(shard_documents(scan, r, ranks) if ranks > 1 else doc_of_row, doc_tokens,
                                         opts.window, WINDOW_ROWS, WINDOW_TOKENS) for r in range(ranks)])
    return Job(opts, inputs, output, scan, device, dtype, loaded.ckpt, prompts, doc_tokens, doc_keys, windows, laps,
               warming, ranks, finished)


def start_job(opts: RunOptions, inputs: Inputs, output: Path, loaded: LoadedModel, ranks: int = 1) -> Job:
    """Prepare the job, build its runner (or reuse the loaded model's; then join the GPU warm-up) and
    compute its identity."""
    job = prepare(opts, inputs, loaded, output, ranks)
    if ranks == 1 and job.finished is None and len(job.windows) and not parts_dir(output).exists():  # a new job
        # its first window (window 0: it has no part yet), read and tokenized while the runner is built
        job.first_window = in_background(read_window, RowReader(job.scan), job.windows, job.encode, 0)
    # a checkpoint's first job hashes its weights' files (gigabytes): beside the runner's build and the warm-up
    weights = in_background(weights_digest, job.ckpt)
    runner = job_runner(job, loaded)
    job.laps.lap("runner")
    job.fingerprint = model_fingerprint(job.ckpt, runner.bank.conv.dtype, runner.model.ops.NAME, weights.result())
    job.identity = job_identity(opts, inputs, job.ckpt.name, job.fingerprint, job.device.type, job.windows, ranks)
    job.laps.lap("identity")
    return job


def job_runner(job: Job, loaded: LoadedModel) -> object:
    """The job's runner (job.runner): the loaded model's last one when its bank serves the job, else a new
    one (which the loaded model then keeps); once it is built, the GPU warm-up is joined (job.warm_up: its
    report, or None where there was none)."""
    docs = bank_documents(job.windows, job.scan.doc_of_row, job.doc_tokens)
    if loaded.runner is not None and not reusable(loaded.runner.bank.layout, job.ckpt, docs, job.opts.bank_capacity):
        loaded.runner = None  # its memory is freed before the new bank is sized from what is free
        gc.collect()
        release_cache(job.device)
    if loaded.runner is None:
        loaded.runner = build_runner(job.ckpt, job.device, docs, job.opts.bank_capacity, job.opts.eager, job.dtype)
    job.runner = loaded.runner
    job.warm_up = job.warming.join(WARM_UP_WAIT_S) if job.warming is not None else None
    return job.runner


def reusable(layout: BankLayout, ckpt: Checkpoint, doc_tokens: list[int], capacity: int | None) -> bool:
    """Whether a bank scores a job's windows in the waves a new bank would: the layout --bank-capacity
    gives (the memory budget plays no part in it), or else room for every document of a window at once."""
    if capacity is not None:
        return layout == BankLayout.plan(ckpt.config, torch.float32, doc_tokens, 0, capacity)
    return layout.entries >= len(doc_tokens) and layout.tokens >= sum(doc_tokens)


def score_and_merge(job: Job, progress: Reporter) -> RunResult:
    """Score the windows without a part (those an earlier run completed are resumed) and merge the parts into
    the output, then remove them; an interrupt says what was kept."""
    parts = open_parts(job, progress)
    try:
        if parts.finished():
            result = new_result(job, parts)
            result.stats.rows = parts.manifest["merged"]["rows"]
        else:
            result = score_job(job, parts, progress)
            merge_job(job, parts, result, progress)
        parts.remove()
    except BaseException as exc:
        parts.abandon()  # a directory this run created, holding no part yet, is removed
        if not isinstance(exc, KeyboardInterrupt):
            raise
        how = f"interrupted ({exc})" if str(exc) else "interrupted"  # an Interrupted names its signal
        if job.output.parent == job.inputs.stage:  # -o -: its parts were in a temporary directory
            raise Interrupted(f"{how}; nothing was written (-o - writes at the end)") from None
        # the merge renamed into place (its record kept in memory: the parts may be half removed)
        if merged_output(job.output, parts.manifest.get("merged")):
            raise Interrupted(completed(job.output, parts.dir)) from None
        if not isinstance(exc, Interrupted):
            raise  # outside the scoring and its merge's end: the CLI says it
        if not parts.dir.exists():
            raise Interrupted(f"{how} before any window was complete; nothing was written") from None
        raise Interrupted(f"{how}: {len(parts.done)} of {len(job.windows)} windows ({sum(parts.done.values()):,} rows) "
                          f"are kept in {parts.dir}; rerun the same command to resume") from None
    return result


def open_parts(job: Job, progress: Reporter, member: bool = False) -> PartStore:
    """The output's parts directory (kevscore.job.parts): opened, or joined by a rank other than 0 (`member`)."""
    refuse = None if member or job.opts.overwrite else job.inputs.files  # an output there, unless it is this job's
    return PartStore(job.output, job.identity, job.windows.rows, job.opts.restart, progress.warn, member, refuse)


def new_result(job: Job, parts: PartStore, rank: int = 0) -> RunResult:
    """A RunResult for `rank`'s windows before scoring: what was loaded, which windows are done."""
    mine = job.windows.of_rank(rank)
    done = [w for w in mine if w in parts.done]
    return RunResult(job.output, RunStats(), len(job.documents()), str(job.device), job.ckpt.name,
                     time.perf_counter() - job.laps.t0, windows=len(mine), resumed=len(done),
                     resumed_rows=sum(parts.done[w] for w in done), load_phases=job.laps.phases, warm_up=job.warm_up)


def score_job(job: Job, parts: PartStore, progress: Reporter, rank: int = 0) -> RunResult:
    """Score `rank`'s windows that have no part yet (with the on-disk bank when asked), writing their parts."""
    opts = job.opts
    max_bytes = int(opts.bank_max_gb * 1e9) if opts.bank_max_gb is not None else None
    # the on-disk bank for this model (fingerprint: config, weights, bank dtype, ops backend)
    # every document of the job kept from this run's eviction until loaded, a later window's too
    store = BankStore(Path(opts.bank), job.fingerprint, max_bytes, progress.warn,
                      wanted=job.doc_keys[job.documents()]) if opts.bank is not None else None
    with store or nullcontext(), StopSignals(progress.warn) as stop:
        result = new_result(job, parts, rank)
        engine = make_engine(opts, job.runner, store, stop)
        score_windows(opts, job.scan, job.windows, engine, parts, job.encode, result.stats, progress, rank, job.first_window)
    result.bank = store.stats if store is not None else None
    return result


def merge_job(job: Job, parts: PartStore, result: RunResult, progress: Reporter) -> None:
    """Merge every window's part into the output (and the rows set aside into its errors file), counting
    the label mass on the way."""
    opts, t1 = job.opts, time.perf_counter()
    set_aside = None
    if opts.skip_invalid:  # the scan's rows set aside, reported once: by a shard job's rank 0
        set_aside = set_aside_table(job.scan) if (opts.shard or (0, 1))[0] == 0 else ERRORS_SCHEMA.empty_table()
    tally = LabelTally()
    carry = Carry(job.inputs.questions, progress.warn, job.scan.stamps) if carries(opts, job.ranks) else None
    result.stats.rows = parts.merge(job.windows.of_row, set_aside, lambda chunks: map(
        tally.add, map(carry.add, chunks) if carry else chunks))
    result.stats.write_s += time.perf_counter() - t1
    result.labels = tally.summary()
    progress.event("merged", output=str(job.output), rows=result.stats.rows)


def check_outputs(opts: RunOptions, inputs: Inputs, output: Path) -> str | None:
    """The output, its errors file and its parts directory must not be (or hold) anything this run reads:
    the input files, the template, files of the model, bank or input directory. An existing output is refused unless
    --overwrite, or it is this job's merge left with its parts, or it records a job: that job's digest is
    returned (`finished_job` tells whether it is this job)."""
    ours = merged_output(output)  # a run killed after renaming its output, before removing its parts
    finished = None if opts.overwrite or ours or not output.is_file() else output_job(output)
    sources = inputs.files + ([Path(opts.template)] if opts.template else [])
    model = None if opts.model in MODEL_NAMES else Path(opts.model)
    within = [d for d in (model, opts.bank, *(s.given for s in inputs.sources())) if d is not None]
    for path in [output, errors_path(output)] if opts.skip_invalid else [output]:
        check_output_path(path, sources, opts.overwrite or ours or finished is not None, within)
    check_parts_dir(output, sources)
    return finished


def finished_job(job: Job) -> RunResult:
    """The job's output exists, merged by a job: this very job (nothing to do), or another one (refused)."""
    output = job.output
    if job.finished != job_digest(job.identity):
        raise KevscoreError(f"{output}: already exists (the output of another job); pass --overwrite to replace it")
    if job.opts.skip_invalid:
        errors_rows(output)  # its errors file is there
    rows, windows = pq.read_metadata(output).num_rows, len(job.windows)
    return RunResult(output, RunStats(rows=rows), len(job.documents()), str(job.device), job.ckpt.name, 0.0,
                     windows=windows, resumed=windows, resumed_rows=rows, already_complete=True)


def errors_rows(output: Path) -> int:
    """The rows in the errors file of a complete output of this job (--skip-invalid), which must be there."""
    if not errors_path(output).is_file():
        raise KevscoreError(f"{output}: complete (this job's output), but its errors file {errors_path(output)} (the rows "
                            "--skip-invalid set aside) was removed; pass --overwrite to score the job again and write both")
    return pq.read_metadata(errors_path(output)).num_rows


def shard_documents(scan: InputScan, rank: int, world: int) -> np.ndarray:
    """doc_of_row keeping only the rows of documents that kevscore.job.shard assigns to `rank` (others -1)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in 0..{world - 1}")
    assignment = assign_documents(dict(zip(scan.doc_keys, scan.doc_chars.tolist())), world)
    mine = np.asarray([assignment[k] == rank for k in scan.doc_keys] + [False], dtype=bool)
    return np.where(mine[scan.doc_of_row], scan.doc_of_row, -1).astype(np.int32)


def bank_documents(windows: Windows, doc_of_row: np.ndarray, doc_tokens: np.ndarray) -> list[int]:
    """Document lengths standing for the largest window (most tokens; as many entries as the window with
    the most documents; the longest document included), so the bank is sized for a window, not the input."""
    if not len(windows):
        return []
    docs = np.unique(doc_of_row[windows.of_row == int(np.argmax(windows.tokens))])  # the window of most tokens
    lengths = sorted(int(doc_tokens[d]) for d in docs)
    longest = int(doc_tokens[doc_of_row[windows.of_row >= 0]].max())
    if lengths[-1] < longest:
        lengths[0] = longest
    return lengths + [0] * max(0, int(windows.docs.max()) - len(lengths))


def set_aside_table(scan: InputScan) -> pa.Table:
    """The rows the scan set aside, with their ids and reasons."""
    rows = np.asarray(sorted(scan.invalid), dtype=np.int64)
    cols = [c for c in scan.columns if c != "labels"]
    ids = Cursor(scan.path, cols).take(rows) if cols and len(rows) else {}
    return errors_table(rows, [scan.invalid[int(r)] for r in rows], ids.get("doc_id"), ids.get("question_id"))

