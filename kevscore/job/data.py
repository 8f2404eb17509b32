"""The input read whole (`read_input`, for `compare` and tests) and the output's rows: their schema and table."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from kevscore.job.rows import RowReader
from kevscore.job.scan import InputTable, scan_input

OUTPUT_SCHEMA = pa.schema([("row", pa.int64()), ("doc_id", pa.string()), ("question_id", pa.string()),
                           ("labels", pa.list_(pa.string())), ("probs", pa.list_(pa.float64())),
                           ("prediction", pa.string()), ("label_mass", pa.float64())])


def read_input(path: Path, documents: Path | None = None) -> InputTable:
    """Read the one-file form, or the questions file plus a documents file joined on doc_id: the whole
    input in memory (`kevscore.job.scan` validates it; a job reads it a window at a time instead)."""
    scan = scan_input(path, documents)
    return RowReader(scan).read(np.arange(len(scan.doc_of_row), dtype=np.int64))


def output_table(rows: InputTable, labels: list[list[str]], probs: list[list[float]], label_mass: list[float]) -> pa.Table:
    """The output's table of `rows` and their scores (`pa.table` refuses columns of unequal lengths)."""
    for i, (ls, ps) in enumerate(zip(labels, probs)):
        if len(ls) != len(ps):
            raise ValueError(f"row {i}: {len(ls)} labels but {len(ps)} probs")
    nulls = [None] * len(rows)
    return pa.table({"row": range(len(rows)) if rows.rows is None else rows.rows, "doc_id": rows.doc_ids or nulls,
                     "question_id": rows.question_ids or nulls, "labels": labels,
                     "probs": [[float(p) for p in ps] for ps in probs],
                     "prediction": [ls[argmax(ps)] if ls and np.isfinite(ps).all() else None  # NaN/inf: no prediction
                                    for ls, ps in zip(labels, probs)],
                     "label_mass": [float(m) for m in label_mass]}, schema=OUTPUT_SCHEMA)


def argmax(values: Sequence[float]) -> int:
    """The index of the largest value, the first one on ties (a row's prediction)."""
    return max(range(len(values)), key=values.__getitem__)
