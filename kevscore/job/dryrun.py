"""`run --dry-run`: what a job would do and how long it would take; nothing is written.

The plan counts documents, rows, windows, waves and tokens (with --bank, documents the bank holds are loaded,
not prefilled); the time is estimated from scoring a few of the job's own documents on this machine."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kevscore.engine.bank_entry import model_fingerprint
from kevscore.engine.bank_store import stored
from kevscore.engine.pipeline import Engine
from kevscore.engine.plan import plan_waves
from kevscore.job.files import STDOUT, file_format, opened_inputs, output_path
from kevscore.job.options import RunOptions, check_options
from kevscore.job.rows import RowReader
from kevscore.job.run import Job, LoadedModel, job_runner, prepare
from kevscore.job.windows import make_engine

CALIBRATION_DOCS = 4    # documents scored to measure the rates (after one warm-up document)
CALIBRATION_ROWS = 64   # at most this many of their rows


@dataclass(slots=True)
class Plan:
    model: str
    device: str
    rows: int                  # rows that would be scored
    set_aside: int             # rows --skip-invalid would set aside
    documents: int
    prefix_tokens: int         # document (prefix) tokens to prefill (not those of documents in the bank)
    windows: int
    waves: int                 # bank loads, summed over the windows
    bank_entries: int          # documents the bank holds at once
    load_s: float              # loading the model and measuring every prompt
    calibration_docs: int = 0
    calibration_rows: int = 0
    prefill_tokens_per_s: float | None = None
    score_rows_per_s: float | None = None
    estimate_s: float | None = None  # load + prefill + scoring at the measured rates
    bank_hits: int = 0         # documents the bank (--bank) holds: loaded, not prefilled


def dry_run(opts: RunOptions, loaded: LoadedModel | None = None) -> Plan:
    """Check the whole input as a run would, plan it, and time a few documents of its first window (on the
    model `loaded` holds, when given)."""
    check_options(opts)
    # a -o given is refused now as the run would refuse it
    output = output_path(opts) if opts.output is not None and str(opts.output) != STDOUT else None
    file_format(output or "", written=True)
    with opened_inputs(opts) as inputs:
        loaded = loaded or LoadedModel()
        job = prepare(opts, inputs, loaded, output)
        runner = job_runner(job, loaded)  # the GPU warm-up joined too
        docs = job.documents()
        held = in_bank(job, runner, docs) if opts.bank is not None else np.zeros(len(docs), dtype=bool)
        layout = runner.bank.layout
        plan = Plan(job.ckpt.name, str(job.device), int(job.windows.rows.sum()), len(job.scan.invalid), len(docs),
                    int(job.doc_tokens[docs[~held]].sum()), len(job.windows),
                    count_waves(job, layout.entries, layout.tokens), layout.entries, sum(job.laps.phases.values()),
                    bank_hits=int(held.sum()))
        if plan.rows:
            calibrate(plan, job, make_engine(opts, runner))
    return plan


def in_bank(job: Job, runner, docs: np.ndarray) -> np.ndarray:
    """Which of `docs` the bank (--bank) holds for this model, looked up as a run does (it loads them); nothing is
    written, nothing evicted."""
    model = model_fingerprint(job.ckpt, runner.bank.conv.dtype, runner.model.ops.NAME).digest
    return np.asarray([stored(Path(job.opts.bank), model, job.doc_keys[d]) is not None for d in docs], dtype=bool)


def count_waves(job: Job, entries: int, tokens: int) -> int:
    """Bank loads the job needs: per window, its documents in waves that fit the bank."""
    windows = (dict.fromkeys(job.scan.doc_of_row[job.windows.rows_of(w)].tolist()) for w in range(len(job.windows)))
    return sum(len(plan_waves(job.doc_tokens[list(docs)].tolist(), entries, tokens)) for docs in windows)


def calibrate(plan: Plan, job: Job, engine: Engine) -> None:
    """Score the first documents of the first window (after one warm-up document, not counted) and set
    the plan's rates and estimate from them."""
    rows = job.windows.rows_of(0)
    docs = list(dict.fromkeys(job.scan.doc_of_row[rows].tolist()))[:CALIBRATION_DOCS + 1]
    reader = RowReader(job.scan)
    for group in (docs[:1], docs[1:] or docs[:1]):  # the warm-up, then the measured documents
        picked = rows[np.isin(job.scan.doc_of_row[rows], group)][:CALIBRATION_ROWS]
        enc = job.encode(reader.read(picked))
        stats = engine.run(enc, job.opts.state_read).stats
    plan.calibration_docs, plan.calibration_rows = len(enc.prefixes), len(enc)
    plan.prefill_tokens_per_s = stats.prefix_tokens / stats.prefill_s if stats.prefill_s > 0 else None
    plan.score_rows_per_s = len(enc) / stats.score_s if stats.score_s > 0 else None
    if plan.prefill_tokens_per_s and plan.score_rows_per_s:
        plan.estimate_s = plan.load_s + plan.prefix_tokens / plan.prefill_tokens_per_s + plan.rows / plan.score_rows_per_s
