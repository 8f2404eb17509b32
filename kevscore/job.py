"""The `run` job: Parquet in -> validate -> encode -> bank and branches -> Parquet out."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from kevscore.backend import build_runner, resolve_device
from kevscore.bank_store import BankStats, BankStore, check_bank_dir, model_fingerprint
from kevscore.checkpoint import load_checkpoint
from kevscore.data import check_output_path, default_output_path, read_input, write_output
from kevscore.engine import Engine, Progress, RunStats
from kevscore.errors import KevscoreError
from kevscore.shard import shard_rows
from kevscore.prompt import encode, load_template

PATHS = ("indexed", "gathered")


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


@dataclass(slots=True)
class RunResult:
    output: Path
    stats: RunStats
    documents: int
    device: str
    model: str
    load_s: float
    bank: BankStats | None = None


def check_options(opts: RunOptions) -> None:
    if opts.path not in PATHS:
        raise KevscoreError(f"--path {opts.path}: choose indexed or gathered")
    if opts.batch_rows < 1:
        raise KevscoreError(f"--batch-rows {opts.batch_rows}: must be at least 1")
    if opts.bank_capacity is not None and opts.bank_capacity < 1:
        raise KevscoreError(f"--bank-capacity {opts.bank_capacity}: must be at least 1")
    if not opts.labels or any(not label for label in opts.labels) or len(set(opts.labels)) != len(opts.labels):
        raise KevscoreError(f"--labels {','.join(opts.labels)}: give distinct, non-empty labels")
    if opts.bank_max_gb is not None and opts.bank is None:
        raise KevscoreError("--bank-max-gb needs --bank DIR")
    if opts.bank_max_gb is not None and not opts.bank_max_gb > 0:
        raise KevscoreError(f"--bank-max-gb {opts.bank_max_gb}: must be more than 0")
    if opts.bank is not None:
        check_bank_dir(Path(opts.bank), create=True)


def run_job(opts: RunOptions, progress: Progress | None = None) -> RunResult:
    check_options(opts)
    output = Path(opts.output) if opts.output else default_output_path(opts.input)
    table = read_input(Path(opts.input), Path(opts.documents) if opts.documents else None)
    check_output_path(output, table.sources, opts.overwrite)
    if opts.shard is not None:  # one rank of a distributed job: the rows of its documents only
        table = table.take(shard_rows(table.doc_keys, table.documents, table.questions, *opts.shard))
    t0 = time.perf_counter()
    device = resolve_device(opts.device)
    ckpt = load_checkpoint(opts.model, device)
    template = load_template(opts.template, ckpt.tokenizer)
    enc = encode(table, ckpt.tokenizer, template, opts.labels, ckpt.config.max_position_embeddings)
    runner = build_runner(ckpt, device, [len(p) for p in enc.prefixes], opts.bank_capacity, opts.eager)
    store = open_store(opts, ckpt, runner, enc, table, progress) if opts.bank is not None else None
    load_s = time.perf_counter() - t0
    try:
        engine = Engine(runner, max_rows=1 if opts.batch_invariant else opts.batch_rows,
                        prefill_tokens=1 if opts.batch_invariant else 8192, store=store)
        scores = engine.run(enc, opts.path, progress)
    finally:
        if store is not None:
            store.close()
    write_output(output, table, enc.labels, scores.probs, scores.label_mass)
    documents = len(set(table.doc_ids or table.documents))
    return RunResult(output, scores.stats, documents, str(device), ckpt.name, load_s,
                     store.stats if store is not None else None)


def open_store(opts: RunOptions, ckpt, runner, enc, table, progress: Progress | None) -> BankStore:
    """The on-disk bank for this model (fingerprint: config, weights, bank dtype, ops backend)."""
    backend = runner.model.ops.__name__.rsplit(".", 1)[-1]
    fingerprint = model_fingerprint(ckpt, runner.bank.conv.dtype, backend)
    max_bytes = int(opts.bank_max_gb * 1e9) if opts.bank_max_gb is not None else None
    try:
        store = BankStore(Path(opts.bank), fingerprint, max_bytes, warn=(progress or Progress()).warn)
    except OSError as exc:
        raise KevscoreError(f"{opts.bank}: cannot open the bank ({exc.strerror or exc})") from exc
    doc_ids: list[list[str]] = [[] for _ in enc.prefixes]
    if table.doc_ids:
        for r, p in enumerate(enc.row_prefix):
            if table.doc_ids[r] not in doc_ids[p]:
                doc_ids[p].append(table.doc_ids[r])
    store.note_documents(enc.prefixes, doc_ids)
    return store
