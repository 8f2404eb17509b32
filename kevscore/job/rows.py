"""Reading rows of a scanned input back by row number: a window's questions and documents, or columns.

Row groups without a wanted row are skipped, not decoded: `RowReader` reads a window's questions with their
documents, `Cursor` chosen columns."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from kevscore.errors import KevscoreError
from kevscore.job.scan import InputScan, InputTable, check_unchanged, decoded, open_parquet, record_batches


class Cursor:
    """Reads chosen rows of one Parquet file in ascending order, a record batch at a time, continuing
    from the batch it stopped in when the next rows lie ahead. Given `since` (the file's `stamp` when it was
    scanned), every batch read is checked to come from that version of the file (`check_unchanged`)."""

    def __init__(self, path: Path, columns: Sequence[str], since: tuple | None = None):
        self.path, self.columns, self.since = path, list(columns), since
        self.file = open_parquet(path)
        meta = self.file.metadata
        self.starts = np.cumsum([0] + [meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
        self.it: Iterator[pa.RecordBatch] | None = None
        self.batch: pa.RecordBatch | None = None
        self.end = 0  # the input row after self.batch's last one

    def _group(self, row: int) -> int:
        return int(np.searchsorted(self.starts, row, side="right")) - 1

    def _reach(self, row: int) -> None:
        """Make self.batch the record batch holding `row`, reading on; when `row` lies behind, or whole row groups
        ahead, reading starts again at its row group (the groups skipped are not decoded)."""
        if self.batch is None or row < self.end - self.batch.num_rows or self._group(row) > self._group(self.end):
            group = self._group(row)
            self.it = record_batches(self.path, self.file, columns=self.columns,
                                     row_groups=list(range(group, len(self.starts) - 1)))
            self.end = int(self.starts[group])
        while row >= self.end:
            try:
                self.batch = next(self.it, None)
            finally:  # a changed file is what to report, whatever its read made of it
                check_unchanged(self.path, self.since)
            if self.batch is None:
                raise KevscoreError(f"{self.path}: fewer rows than when it was scanned; was it changed?")
            self.end += self.batch.num_rows

    def take(self, rows: np.ndarray) -> dict[str, list]:
        """The values of `rows` (ascending input rows) per column, in that order."""
        if not len(rows):
            return {c: [] for c in self.columns}
        return decoded(self.path, self.table(rows), self.columns, lambda j: int(rows[j]))

    def table(self, rows: np.ndarray) -> pa.Table:
        """`rows` (ascending input rows, at least one) as a table of the columns, in that order."""
        pieces, i = [], 0
        while i < len(rows):
            self._reach(int(rows[i]))
            j = int(np.searchsorted(rows, self.end, side="left"))  # the rows in this batch: rows[i:j]
            pieces.append(self.batch.take(pa.array(rows[i:j] - (self.end - self.batch.num_rows), pa.int64())))
            i = j
        return pa.Table.from_batches(pieces)


class RowReader:
    """Reads the rows of a scanned input (one window at a time) as InputTables, each document's text read
    once, at its row (`InputScan.doc_row`) in the input or the documents file."""

    def __init__(self, scan: InputScan):
        self.scan = scan
        texts = scan.documents_path or scan.path
        self.docs = Cursor(texts, ["document"], scan.stamps.get(texts))
        self.rows = Cursor(scan.path, ["question", *scan.columns], scan.stamps.get(scan.path))

    def read(self, rows: np.ndarray):
        """An InputTable of `rows` (ascending input row numbers), keeping their row numbers."""
        scan = self.scan
        cols = self.rows.take(rows)
        doc_rows, of_row = np.unique(scan.doc_row[scan.doc_of_row[rows]], return_inverse=True)
        texts = self.docs.take(doc_rows)["document"]
        return InputTable([texts[i] for i in of_row], cols["question"], cols.get("doc_id"), cols.get("question_id"),
                          cols.get("labels"), [f for f in (scan.path, scan.documents_path) if f], rows.tolist())
