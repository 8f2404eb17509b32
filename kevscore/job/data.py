"""Parquet in and out: the whole input in memory (`read_input`), the output's schema, path checks and rows."""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from kevscore.errors import KevscoreError
from kevscore.job.rows import RowReader
from kevscore.job.scan import InputTable, scan_input

OUTPUT_SCHEMA = pa.schema([("row", pa.int64()), ("doc_id", pa.string()), ("question_id", pa.string()),
                           ("labels", pa.list_(pa.string())), ("probs", pa.list_(pa.float64())),
                           ("prediction", pa.string()), ("label_mass", pa.float64())])


# ---------------------------------------------------------------- reading

def read_input(path: Path, documents: Path | None = None) -> InputTable:
    """Read the one-file form, or the questions file plus a documents file joined on doc_id: the whole
    input in memory (`kevscore.job.scan` validates it; a job reads it a window at a time instead)."""
    scan = scan_input(path, documents)
    return RowReader(scan).read(np.arange(scan.rows, dtype=np.int64))


# ---------------------------------------------------------------- writing

def check_output_path(output: Path, inputs: Sequence[Path], overwrite: bool, within: Sequence[Path] = ()) -> None:
    """Refuse an output that is an input (a file of `inputs`, or anything inside a directory of `within`:
    the model's, the bank's), that is not a regular file, that exists (unless overwrite) or has no directory."""
    for source in inputs:
        if _same_file(output, source):
            raise KevscoreError(f"{output}: the output is the input file {source}; choose another --output")
    for directory in map(Path, within):
        if directory.is_dir() and output.resolve().is_relative_to(directory.resolve()):
            raise KevscoreError(f"{output}: the output is inside {directory}, which this run reads; "
                                "choose another --output")
    if not output.parent.is_dir():
        raise KevscoreError(f"{output}: directory {output.parent} does not exist")
    if output.is_dir():
        raise KevscoreError(f"{output}: is a directory; choose a file name for --output")
    if output.exists() and not output.is_file():
        raise KevscoreError(f"{output}: exists and is not a regular file (a device, pipe or socket); "
                            "choose another --output")
    if output.exists() and not overwrite:
        raise KevscoreError(f"{output}: already exists; pass --overwrite to replace it")


def _same_file(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))


def output_table(rows: InputTable, labels: list[list[str]], probs: list[list[float]],
                 label_mass: list[float]) -> pa.Table:
    """The output's table of `rows` and their scores (`pa.table` refuses columns of unequal lengths)."""
    for i, (ls, ps) in enumerate(zip(labels, probs)):
        if len(ls) != len(ps):
            raise ValueError(f"row {i}: {len(ls)} labels but {len(ps)} probs")
    nulls = [None] * len(rows)
    return pa.table({"row": range(len(rows)) if rows.rows is None else rows.rows, "doc_id": rows.doc_ids or nulls,
                     "question_id": rows.question_ids or nulls, "labels": labels,
                     "probs": [[float(p) for p in ps] for ps in probs],
                     "prediction": [ls[argmax(ps)] if ls else None for ls, ps in zip(labels, probs)],
                     "label_mass": [float(m) for m in label_mass]}, schema=OUTPUT_SCHEMA)


def argmax(values: Sequence[float]) -> int:
    """The index of the largest value, the first one on ties (a row's prediction)."""
    return max(range(len(values)), key=values.__getitem__)
