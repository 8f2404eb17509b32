"""A job's files: the input and documents opened as Parquet files to stream, the output's path (chosen, checked), stdout.

An input that is not one Parquet file is staged in a temporary directory (kevscore.job.formats)."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kevscore.errors import KevscoreError
from kevscore.job.formats import Source, open_source
from kevscore.job.options import RunOptions


@dataclass(slots=True)
class Inputs:
    """The input and documents as given, and the Parquet files a job streams (kevscore.job.formats)."""
    questions: Source
    documents: Source | None
    stage: Path                   # a temporary directory for staged copies (and `-o -`'s output)

    @property
    def files(self) -> list[Path]:
        return [f for s in (self.questions, self.documents) if s is not None for f in s.files]

    def message(self, text: str) -> str:
        """An error message about staged copies and renamed columns, told about the input as given."""
        for source in (self.questions, self.documents):
            if source is not None and source.path not in source.files:  # a staged copy
                text = text.replace(str(source.path), source.given)
        for theirs, ours in self.questions.rename.items():
            text = text.replace(f"column {ours!r}", f"column {theirs!r}")
        return text


@contextmanager
def opened_inputs(opts: RunOptions) -> Iterator[Inputs]:
    """The input and documents as Parquet files to stream, staged in a temporary directory when they are
    not (kevscore.job.formats); errors about them name the input as given."""
    with tempfile.TemporaryDirectory(prefix="kevscore-") as tmp:
        stage = Path(tmp)
        questions = open_source(opts.input, stage / "input", opts.rename, opts.limit)
        documents = open_source(opts.documents, stage / "documents", opts.rename) if opts.documents else None
        inputs = Inputs(questions, documents, stage)
        try:
            yield inputs
        except KevscoreError as exc:
            raise type(exc)(inputs.message(str(exc))) from exc


def output_path(opts: RunOptions) -> Path:
    """The output file: -o, else <input stem>.scores.parquet beside the input."""
    if opts.output is not None:
        return Path(opts.output)
    if any(ch in str(opts.input) for ch in "*?[") or "://" in str(opts.input):
        raise KevscoreError(f"{opts.input}: a glob or URI input needs -o/--output")
    return Path(opts.input).with_name(f"{Path(opts.input).stem}.scores.parquet")


def check_output_path(output: Path, inputs: Sequence[Path], overwrite: bool, within: Sequence[Path] = ()) -> None:
    """Refuse an output that is an input (a file of `inputs`, or anything inside a directory of `within`:
    the model's, the bank's), that is not a regular file, that exists (unless overwrite) or has no directory."""
    for source in inputs:
        if output.exists() and source.exists() and os.path.samefile(output, source):
            raise KevscoreError(f"{output}: the output is the input file {source}; choose another --output")
    for directory in map(Path, within):
        if directory.is_dir() and output.resolve().is_relative_to(directory.resolve()):
            raise KevscoreError(f"{output}: the output is inside {directory}, which this run reads; choose another --output")
    if not output.parent.is_dir():
        raise KevscoreError(f"{output}: directory {output.parent} does not exist")
    if output.is_dir():
        raise KevscoreError(f"{output}: is a directory; choose a file name for --output")
    if output.exists() and not output.is_file():
        raise KevscoreError(f"{output}: exists and is not a regular file (a device, pipe or socket); "
                            "choose another --output")
    if output.exists() and not overwrite:
        raise KevscoreError(f"{output}: already exists; pass --overwrite to replace it")


def to_stdout(path: Path) -> None:
    """Copy a file to stdout; a reader that stops early (`| head`) has all it wanted."""
    try:
        with open(path, "rb") as f:
            shutil.copyfileobj(f, sys.stdout.buffer)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
