"""The Python API: a `Scorer` keeps a model loaded and runs `kevscore run` jobs on tables and files.

It scores tables, data frames and files as `kevscore run` does; the command line runs its jobs through a
Scorer too.

    scorer = Scorer("demo", device="cpu", labels=["Yes", "No"])
    table = scorer.score(questions)                     # a pyarrow Table, a pandas DataFrame or a path
    result = scorer.score_file("q.parquet", "scores.parquet")   # resumable and windowed, as `kevscore run`

Every call is a `kevscore run` job (kevscore.job.run): the same checks, the same output columns and the same
probabilities, bit for bit. Bad input raises `KevscoreError` (a failure of the run: `KevscoreFailure`)
with the one line the command prints.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Union

import pyarrow as pa
import pyarrow.parquet as pq

from kevscore.engine.backend import resolve_device, resolve_dtype
from kevscore.engine.pipeline import Reporter
from kevscore.errors import KevscoreError, first_line, reported
from kevscore.faults import Interrupted
from kevscore.job.dryrun import Plan, dry_run
from kevscore.job.labels import parse_labels
from kevscore.job.options import BATCH_ROWS, WINDOW_DOCS, RunOptions, check_options
from kevscore.job.run import LoadedModel, RunResult, run_job
from kevscore.job.scan import renames

PathLike = Union[str, "os.PathLike[str]"]
Tabular = Any  # a pyarrow Table or RecordBatch, or a pandas DataFrame (pandas is not a dependency)

# RunOptions' fields a Scorer fixes: the model and how it scores; the others belong to each call
SCORER_OPTIONS = ("model", "device", "dtype", "labels", "template", "state_read", "batch_rows", "bank",
                  "bank_max_gb", "bank_capacity", "eager", "batch_invariant")
# a call's arguments that are RunOptions' fields of the same name (score, score_file, plan)
CALL_OPTIONS = ("carry", "limit", "window", "skip_invalid", "overwrite", "restart")


class Scorer(AbstractContextManager):
    """A model that stays loaded between calls, scoring as `kevscore run` does.

    The model loads on the first call, once that call's input is checked, and stays loaded; so does the
    runner and its bank while the bank can hold the next call's documents. With `bank=DIR` each
    document's state is kept on disk (kevscore.engine.bank_store): a later call, or run, over the same documents
    loads it instead of reading the document again.
    """

    def __init__(self, model: str = "demo", *, device: str = "auto", dtype: str = "auto",
                 labels: Sequence[str] | str = ("Yes", "No"), template: PathLike | None = None,
                 state_read: str = "indexed", batch_rows: int = BATCH_ROWS, bank: PathLike | None = None,
                 bank_max_gb: float | None = None, bank_capacity: int | None = None, eager: bool = False,
                 batch_invariant: bool = False) -> None:
        """`model`: a checkpoint directory, a hub id (ORG/NAME[@REV]), demo, kev-0.8b or kev-4b; `dtype`: auto
        (bf16 on a GPU, fp32 on the CPU), bf16 (GPU only) or fp32; `labels`: a list, or a string as `--labels`
        takes it; the others as `kevscore run`'s options of the same names."""
        with one_line():
            if isinstance(labels, AbstractSet):
                raise KevscoreError(f"labels {labels!r}: give an ordered sequence (a list or tuple), not a set")
            labels = parse_labels(labels) if isinstance(labels, str) else list(labels) if isinstance(
                labels, Iterable) else labels  # anything else: refused by check_options
            given = {**locals(), "model": os.fspath(model) if isinstance(model, os.PathLike) else model}
            self.options = RunOptions(input=Path(), **{name: given[name] for name in SCORER_OPTIONS})
            resolve_dtype(dtype, resolve_device(device))  # a device or dtype it lacks: refused before the bank is made
            check_options(self.options)
        self.loaded = LoadedModel()
        self.last_result: RunResult | None = None  # the last call's numbers: rows, prefills, times, bank use

    @classmethod
    def from_options(cls, opts: RunOptions) -> Scorer:
        """The scorer of a `kevscore run` command's options (the command line's way in)."""
        return cls(**{name: getattr(opts, name) for name in SCORER_OPTIONS})

    def score(self, questions: Tabular | PathLike, documents: Tabular | PathLike | None = None, *,
              columns: Mapping[str, str] | None = None, carry: bool = True, limit: int | None = None,
              window: int = WINDOW_DOCS, progress: Reporter | None = None) -> pa.Table:
        """Score `questions` (a table with `document` and `question` columns, or `question` and `doc_id` with
        `documents` holding `doc_id` and `document`) and return what `kevscore run` writes, as a table in
        memory: row, doc_id, question_id, labels, probs, prediction, label_mass, then (with `carry`) the
        input's other columns. Tables go through a temporary Parquet file; a path is read as the command
        reads it (Parquet, CSV, JSON Lines, a directory or glob of Parquet files)."""
        call = locals()
        with tempfile.TemporaryDirectory(prefix="kevscore-api-") as tmp:
            given = {role: _as_input(call[role], Path(tmp), role) for role in ("questions", "documents")}
            output = Path(tmp) / "scores.parquet"
            try:
                self.run(self._options({**call, "input": given["questions"], "output": output, **given}), progress)
            except KevscoreError as exc:  # a message about the tables' temporary files (`_as_input`): <questions>, ...
                message = str(exc)
                for role in ("questions", "documents"):
                    message = message.replace(str(Path(tmp) / f"{role}.parquet"), f"<{role}>")
                raise type(exc)(message) from None
            except Interrupted:  # its parts were in the temporary directory: nothing to resume from
                raise Interrupted("interrupted; nothing was kept (score_file's parts resume a stopped job)") from None
            return pq.read_table(output)

    def score_file(self, input: PathLike, output: PathLike | None = None, *, documents: PathLike | None = None,
                   columns: Mapping[str, str] | None = None, carry: bool = True, limit: int | None = None,
                   window: int = WINDOW_DOCS, skip_invalid: bool = False, overwrite: bool = False,
                   restart: bool = False, progress: Reporter | None = None) -> RunResult:
        """`kevscore run INPUT -o OUTPUT`: the output written window by window into resumable parts beside
        it, then merged (`output` None: `<input stem>.scores.parquet`; "-": JSON Lines on stdout). A call
        stopped part way resumes from its completed windows when made again; `restart` discards them,
        `overwrite` replaces an existing output. `columns`: kevscore's column name -> the input's
        (e.g. {"question": "text"}). Returns the run's numbers (rows, documents prefilled, times)."""
        return self.run(self._options(locals()), progress)

    def plan(self, input: PathLike, *, documents: PathLike | None = None, columns: Mapping[str, str] | None = None,
             limit: int | None = None, window: int = WINDOW_DOCS, skip_invalid: bool = False) -> Plan:
        """`kevscore run --dry-run`: the whole input checked and planned, and a time estimate from scoring a
        few of its documents; nothing is written."""
        return self.dry_run(self._options(locals()))

    def run(self, opts: RunOptions, progress: Reporter | None = None) -> RunResult:
        """The job `opts` describes, on this scorer's model (its model and scoring options replace those
        of `opts`)."""
        with one_line():
            self.last_result = run_job(self._own(opts), progress, self.loaded)
        return self.last_result

    def dry_run(self, opts: RunOptions) -> Plan:
        """The dry run of the job `opts` describes, on this scorer's model."""
        with one_line():
            return dry_run(self._own(opts), self.loaded)

    def _options(self, call: dict) -> RunOptions:
        """The `kevscore run` options of a call (`call`: its arguments, by name): this scorer's, with the call's
        input, output, documents, columns and CALL_OPTIONS."""
        for role in ("input", "documents"):
            if call.get(role) is not None and not isinstance(call[role], (str, os.PathLike)):
                raise KevscoreError(f"{role}: a {type(call[role]).__name__}, but score_file and plan take a path "
                                    "(str or os.PathLike); use Scorer.score for a table")
        return dataclasses.replace(self.options, input=str(call["input"]), output=call.get("output"),
                                   documents=None if call["documents"] is None else str(call["documents"]),
                                   rename=renames(call["columns"] or {}),
                                   **{name: call[name] for name in CALL_OPTIONS if name in call})

    def close(self) -> None:
        """Let the model and its bank go (a later call loads the model again)."""
        self.loaded = LoadedModel()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _own(self, opts: RunOptions) -> RunOptions:
        return dataclasses.replace(opts, **{name: getattr(self.options, name) for name in SCORER_OPTIONS})


@contextmanager
def one_line() -> Iterator[None]:
    """An OSError not caught where it happened (a disk full, a file removed) raised as the KevscoreFailure
    the command line reports for it."""
    try:
        yield
    except OSError as exc:
        raise reported(exc) from exc


def _as_input(data: Tabular | PathLike | None, tmp: Path, role: str) -> str | None:
    """A path as it is; a table (pyarrow, or pandas when installed) written into `tmp` as `role`.parquet, which
    messages call <role>."""
    if data is None or isinstance(data, (str, os.PathLike)):
        return None if data is None else str(data)
    pandas = sys.modules.get("pandas")  # a DataFrame means pandas is imported already
    try:
        if pandas is not None and isinstance(data, pandas.DataFrame):
            data = pa.Table.from_pandas(data, preserve_index=False)
        elif isinstance(data, pa.RecordBatch):
            data = pa.Table.from_batches([data])
    except (pa.ArrowException, ValueError, TypeError) as exc:
        raise KevscoreError(f"<{role}>: cannot be converted to an Arrow table ({first_line(exc)})") from exc
    if not isinstance(data, pa.Table):
        raise KevscoreError(f"<{role}>: a pyarrow Table, a pandas DataFrame or a path, not {type(data).__name__}")
    path = tmp / f"{role}.parquet"
    try:
        pq.write_table(data, path)
    except pa.ArrowException as exc:  # a column of a type Parquet has none for (an interval)
        raise KevscoreError(f"<{role}>: cannot be written as Parquet, which kevscore reads ({first_line(exc)})") from exc
    return str(path)
