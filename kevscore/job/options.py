"""A job's options (`kevscore run`'s flags, `Scorer`'s arguments) and their checks."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from kevscore.engine.bank_dir import check_bank_dir
from kevscore.errors import KevscoreError

STATE_READS = ("indexed", "gathered")  # --state-read: a row's document state read in place, or copied out
WINDOW_DOCS = 1024          # documents per window (--window)
WINDOW_ROWS = 65536         # rows per window; a document with more rows is split over windows of its own
WINDOW_TOKENS = 1 << 20     # document tokens per window
BATCH_ROWS = 128            # question rows per scoring batch, at most (--batch-rows; benchmarks/NOTES.md 117-118)


@dataclass(slots=True)
class RunOptions:
    input: Path
    documents: Path | None = None
    output: Path | None = None
    model: str = "demo"
    device: str = "auto"
    dtype: str = "auto"           # the model's dtype: auto (bf16 on a GPU, fp32 on the CPU), bf16 (GPU) or fp32
    state_read: str = "indexed"   # how a row's document state is read from the bank (STATE_READS)
    labels: list[str] = field(default_factory=lambda: ["Yes", "No"])
    template: Path | None = None
    batch_rows: int = BATCH_ROWS
    overwrite: bool = False
    bank_capacity: int | None = None
    eager: bool = False
    bank: Path | None = None          # on-disk bank directory (kevscore.engine.bank_store)
    bank_max_gb: float | None = None  # LRU-evict the on-disk bank down to this size
    shard: tuple[int, int] | None = None  # (rank, world): score only this rank's documents (kevscore.job.shard)
    batch_invariant: bool = False  # one row per batch, one document per prefill: results independent of batch-mates
    window: int = WINDOW_DOCS     # documents per window: host memory is bounded by a window, not the input
    restart: bool = False         # discard the completed parts of an interrupted run instead of resuming it
    skip_invalid: bool = False    # rows that cannot be scored on their own go to an errors Parquet
    limit: int | None = None      # score only the input's first rows
    carry: bool = False           # copy the input's other columns into the output
    rename: dict[str, str] = field(default_factory=dict)  # the user's column name -> kevscore's


def check_options(opts: RunOptions) -> None:
    if not isinstance(opts.model, str) or not opts.model:  # the API's callers give any type
        raise KevscoreError(f"model {opts.model!r}: give a checkpoint directory, a hub id, demo, kev-0.8b or kev-4b")
    for name in ("eager", "batch_invariant", "carry", "overwrite", "restart", "skip_invalid"):
        if type(value := getattr(opts, name)) is not bool:
            raise KevscoreError(f"{name} {value!r}: give True or False")
    for name in ("bank", "template"):
        if (value := getattr(opts, name)) is not None and not isinstance(value, (str, os.PathLike)):
            raise KevscoreError(f"{name} {value!r}: give a path (str or os.PathLike)")
    if opts.state_read not in STATE_READS:
        raise KevscoreError(f"--state-read {opts.state_read}: choose indexed or gathered")
    if opts.dtype not in ("auto", "bf16", "fp32"):
        raise KevscoreError(f"--dtype {opts.dtype}: choose auto, bf16 or fp32")
    for flag, value in (("--batch-rows", opts.batch_rows), ("--bank-capacity", opts.bank_capacity),
                        ("--limit", opts.limit), ("--window", opts.window)):
        if value is not None and (type(value) is not int or value < 1):  # the API's callers give any type
            raise KevscoreError(f"{flag} {value!r}: must be at least 1 (a whole number)")
    if not isinstance(opts.labels, list) or not all(isinstance(label, str) for label in opts.labels):
        raise KevscoreError(f"labels {opts.labels!r}: give a list of strings")
    labels = ",".join(opts.labels)  # at least two, distinct and non-empty
    if len(opts.labels) < 2:
        raise KevscoreError(f"--labels {labels}: give at least two labels (one label always gets probability 1)")
    if not all(opts.labels) or len(set(opts.labels)) != len(opts.labels):
        raise KevscoreError(f"--labels {labels}: give distinct, non-empty labels")
    if opts.skip_invalid and str(opts.output) == "-":
        raise KevscoreError("--skip-invalid keeps the rows it sets aside in a file beside the output: give -o a file")
    if opts.bank_max_gb is not None and opts.bank is None:
        raise KevscoreError("--bank-max-gb needs --bank DIR")
    if opts.bank_max_gb is not None and not 0 < opts.bank_max_gb < float("inf"):
        raise KevscoreError(f"--bank-max-gb {opts.bank_max_gb}: must be a number of GB more than 0")
    if opts.bank is not None:
        check_bank_dir(Path(opts.bank), create=True)


def carries(opts: RunOptions, ranks: int) -> bool:
    """Whether the output gets the input's other columns (a one-process job's output, not a shard's or the ranks')."""
    return opts.carry and opts.shard is None and ranks == 1
