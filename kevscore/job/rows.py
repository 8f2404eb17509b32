"""Reading rows of a scanned input back by row number: a window's questions and documents, or columns.

Row groups without a wanted row are skipped, not decoded: `RowReader` reads a window's questions with their
documents, `Cursor` chosen columns."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from kevscore.durable import stamp
from kevscore.errors import KevscoreError, KevscoreFailure
from kevscore.job.scan import InputScan, InputTable, decoded, open_parquet, record_batches


class Cursor:
    """Reads chosen rows of one Parquet file in ascending order, a record batch at a time, continuing
    from the batch it stopped in when the next rows lie ahead. Given `stamps` (files' `stamp`s, kevscore.durable,
    as the scan began), every batch read of a file among them is checked to come from that version of it: rows
    read before and after a change never meet in one output (the run stops; its parts are kept)."""

    def __init__(self, path: Path, columns: Sequence[str], stamps: dict[Path, tuple] | None = None):
        self.path, self.columns, self.since = path, list(columns), (stamps or {}).get(path)
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
                if self.since is not None and stamp(self.path) != self.since:
                    raise KevscoreFailure(f"{self.path}: changed while this run read it (its size, time or inode "
                                          "differ from the scan's); the output is not written: rerun once the file is final")
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
        self.docs = Cursor(scan.documents_path or scan.path, ["document"], scan.stamps)
        self.rows = Cursor(scan.path, ["question", *scan.columns], scan.stamps)

    def read(self, rows: np.ndarray):
        """An InputTable of `rows` (ascending input row numbers), keeping their row numbers."""
        scan = self.scan
        cols = self.rows.take(rows)
        doc_rows, of_row = np.unique(scan.doc_row[scan.doc_of_row[rows]], return_inverse=True)
        texts = self.docs.take(doc_rows)["document"]
        return InputTable([texts[i] for i in of_row], cols["question"], cols.get("doc_id"), cols.get("question_id"),
                          cols.get("labels"), [f for f in (scan.path, scan.documents_path) if f], rows.tolist())
