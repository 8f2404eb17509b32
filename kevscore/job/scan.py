"""Streaming input validation: a Parquet input checked in record batches and indexed by document, not loaded.

`scan_input` reads the input in record batches, a few columns at a time, and keeps only compact arrays:
each row's document (an int32 index), and per document its key, its text length and its questions'
summed length. Every check of the input is made here, each with a one-line message (file, column, input row
numbers), so `read_input` is this scan plus reading every row.
A `labels` column holds lists of strings, or JSON arrays of them as text (a CSV's, or a Parquet file's).
With `skip_invalid`, rows that cannot be scored on their own (a null question or document, a `labels`
value that is null, empty, repeats a label or is no JSON array, a `doc_id` with no document) are set aside with
a reason instead of stopping the run; problems of identity or structure (missing columns, wrong types, null or
duplicate ids, one `doc_id` with two texts) always stop it.

`kevscore.job.rows` then reads chosen rows (one window's) back as an `InputTable`.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kevscore.durable import stamp
from kevscore.errors import KevscoreError, first_line, listed, rows_phrase

BATCH_ROWS = 1024        # rows per record batch read
READ_BUFFER = 1 << 20    # bytes: stream column chunks instead of loading a whole row group
COLUMNS = ("document", "question", "doc_id", "question_id", "labels")  # the input columns kevscore reads


@dataclass(slots=True)
class InputTable:
    """Validated input rows, in input order."""
    documents: list[str]
    questions: list[str]
    doc_ids: list[str] | None
    question_ids: list[str] | None
    labels: list[list[str]] | None
    sources: list[Path]
    rows: list[int] | None = None  # each row's index in the input (None: 0..n-1); a shard keeps a subset

    def __len__(self) -> int:
        return len(self.questions)


# ---------------------------------------------------------------- small helpers (messages)

def few(values: Iterable[str], limit: int = 5) -> str:
    """'a', 'b', … (12 values): distinct values in first-seen order."""
    return listed([repr(v) for v in dict.fromkeys(values)], limit, "values")


def is_string(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        return is_string(t.value_type)
    view = getattr(pa.types, "is_string_view", lambda _: False)
    return pa.types.is_string(t) or pa.types.is_large_string(t) or view(t)


# ---------------------------------------------------------------- files

def open_parquet(path: Path) -> pq.ParquetFile:
    if not path.is_file():
        raise KevscoreError(f"{path}: {'not a file' if path.exists() else 'no such file'}")
    try:
        return pq.ParquetFile(path, pre_buffer=False, buffer_size=READ_BUFFER)
    except (pa.ArrowException, OSError) as e:
        raise KevscoreError(f"{path}: not a readable Parquet file ({first_line(e)})") from e


def renames(columns: Mapping[str, str]) -> dict[str, str]:
    """kevscore's column name -> the input's (the --*-column options, the API's `columns`) as RunOptions.rename
    holds it: the input's -> kevscore's. One input column cannot be two of kevscore's."""
    if not isinstance(columns, Mapping):
        raise KevscoreError(f"columns {columns!r}: give a mapping of kevscore's column names to the input's")
    if unknown := [name for name in columns if name not in COLUMNS]:
        raise KevscoreError(f"columns: {unknown[0]!r} is not a column kevscore reads ({', '.join(COLUMNS)})")
    rename: dict[str, str] = {}
    for ours, theirs in columns.items():
        if (other := rename.setdefault(theirs, ours)) != ours:
            raise KevscoreError(f"column {theirs!r} cannot be read as both {other!r} and {ours!r}: name another "
                                "column for one of them")
    return rename


def check_names(path: Path, names: list[str], required: Sequence[str], reject: str | None) -> None:
    if twice := [c for c in dict.fromkeys(names) if names.count(c) > 1]:
        raise KevscoreError(f"{path}: column name(s) {', '.join(repr(c) for c in twice)} appear more than once; "
                            "rename or drop the duplicates")
    if missing := [c for c in required if c not in names]:
        need, present = ", ".join(repr(c) for c in missing), ", ".join(repr(c) for c in names) or "none"
        hint = ("; its questions carry 'doc_id': give their documents with --documents FILE"
                if missing == ["document"] and {"doc_id", "question"} <= set(names) else "")
        raise KevscoreError(f"{path}: missing required column(s) {need}; columns present: {present}{hint}")
    if reject is not None and reject in names:
        raise KevscoreError(f"{path}: has a {reject!r} column although a documents file was given; "
                            f"use one form or the other")


def _check_types(path: Path, file: pq.ParquetFile, names: Sequence[str]) -> None:
    """Each of the columns `names` that the file has must be of its expected type: labels a list of strings (or
    their JSON text), any other column a string."""
    schema = file.schema_arrow
    for name in [n for n in names if n in schema.names]:
        found, labels = schema.field(name).type, name == "labels"
        listed = pa.types.is_list(found) or pa.types.is_large_list(found)
        if listed and not labels or not is_string(found.value_type if listed else found):  # labels: JSON text too
            raise KevscoreError(f"{path}: column {name!r} has type {found}, expected "
                                f"{'list<string> or JSON text' if labels else 'string'}")


def _nulls(path: Path, column: str, nulls: dict[str, list[int]], scan: InputScan | None = None) -> None:
    """Rows whose `column` is null (`nulls`: the null rows of each column read, `batches`) stop the run, unless
    `scan` is given (--skip-invalid): it sets them aside."""
    if scan is not None:
        scan.set_aside(nulls.get(column, []), f"column {column!r} is null")
    elif rows := nulls.get(column):
        raise KevscoreError(f"{path}: column {column!r} has nulls at {rows_phrase(rows)}")


def record_batches(path: Path, file: pq.ParquetFile, **chosen) -> Iterator[pa.RecordBatch]:
    """The file's record batches of BATCH_ROWS rows (`chosen`: columns, row groups); a read that fails stops
    the run naming the file."""
    try:
        yield from file.iter_batches(batch_size=BATCH_ROWS, use_threads=False, **chosen)
    except (pa.ArrowException, OSError) as e:
        raise KevscoreError(f"{path}: cannot read the Parquet data ({first_line(e)})") from e


def batches(path: Path, file: pq.ParquetFile, columns: Sequence[str], nulls: dict[str, list[int]] | None = None,
            checked: Sequence[str] = ()) -> Iterator[tuple[int, dict[str, list]]]:
    """(first input row, {column: values}) per record batch of `columns`, dictionaries decoded; `nulls`, when
    given, gets each column's null rows (input rows, ascending). The columns `checked` (those a run carries into
    its output, read nowhere else before the merge) are read alongside, not decoded: only checked."""
    start = 0
    for batch in record_batches(path, file, columns=[*columns, *checked]):
        for c in columns if nulls is not None else ():
            nulls.setdefault(c, []).extend((np.flatnonzero(batch.column(c).is_null()) + start).tolist())
        for c in checked:
            check_valid(path, c, batch.column(c), lambda j, start=start: start + j)
        yield start, decoded(path, batch, columns, lambda j, start=start: start + j)
        start += batch.num_rows


def decoded(path: Path, data: pa.RecordBatch | pa.Table, columns: Sequence[str], row_of) -> dict[str, list]:
    """{column: Python values}, labels written as JSON text as lists (`json_labels`); a string that is not valid
    UTF-8 stops the run naming its column and input row (`row_of(j)`: the input row of the j-th row of `data`)."""
    out = {}
    for c in columns:
        column = data.column(c)
        try:
            out[c] = column.to_pylist()
        except UnicodeDecodeError:
            check_valid(path, c, column, row_of)
        if c == "labels" and is_string(column.type):
            out[c] = [json_labels(v) for v in out[c]]
    return out


def check_valid(path: Path, name: str, column: pa.Array | pa.ChunkedArray, row_of) -> None:
    """A column must be valid, its text (nested in lists and structs too) UTF-8, else the one-line error names the
    first value that is not and its input row (`row_of(j)`: the input row of the column's j-th value)."""
    try:
        column.validate(full=True)
    except pa.ArrowInvalid as e:
        for j in range(len(column)):
            try:
                column[j].as_py()
            except UnicodeDecodeError:
                raise KevscoreError(f"{path}: column {name!r} holds text that is not valid UTF-8 at row "
                                    f"{row_of(j)}") from None
        raise KevscoreError(f"{path}: column {name!r} is not valid ({first_line(e)})") from e


def json_labels(text: str | None) -> list[str] | str | None:
    """A labels value written as JSON text: its list of strings (an empty text: None, no labels); text that is no
    JSON array of strings is returned as it is, for the scan to name its row."""
    try:
        labels = json.loads(text) if text else None
    except ValueError:
        return text
    return labels if labels is None or isinstance(labels, list) and all(isinstance(x, str) for x in labels) else text


# ---------------------------------------------------------------- the scan

@dataclass(slots=True)
class InputScan:
    """What a job needs to know about its input, in memory proportional to its documents plus 4 bytes
    per row: each row's document, each document's key, source row and lengths, and the rows set aside."""
    path: Path
    documents_path: Path | None
    doc_of_row: np.ndarray                 # int32 [input rows]: index into doc_keys; -1 for a row set aside
    doc_keys: list[str]                    # doc_id, else the text (keep_texts) or its digest (hex)
    doc_chars: np.ndarray                  # int64 per document: its text's characters and its questions' (shard cost)
    doc_row: np.ndarray                    # int64 per document: a row holding its text (input, or documents file)
    columns: list[str] = field(default_factory=list)  # the optional columns it has: doc_id, question_id, labels
    invalid: dict[int, str] = field(default_factory=dict)  # row -> why it is set aside (skip_invalid)
    stamps: dict[Path, tuple] = field(default_factory=dict)  # its files' `stamp`s (kevscore.durable) as the scan began

    def set_aside(self, rows: Iterable[int], reason: str) -> None:
        for r in rows:
            self.invalid.setdefault(r, reason)  # a row keeps the first reason found
            self.doc_of_row[r] = -1


def scan_input(path: Path, documents: Path | None = None, skip_invalid: bool = False, keep_texts: bool = False,
               carried: bool = False) -> InputScan:
    """Validate the input (one file, or questions plus a documents file) and index its rows by document.
    `keep_texts`: without doc_id, key documents by their text (as kevscore.job.shard does), not a digest.
    `carried`: the questions file's other columns go into the output (kevscore.job.files.Carry): checked too."""
    path = Path(path)
    stamps = {p: stamp(p) for p in (path, documents and Path(documents)) if p is not None and p.is_file()}
    if documents is None:
        file, scan = _indexed(path, ("document", "question"), None, keep_texts, skip_invalid)
    else:
        file, scan = _indexed(path, ("question", "doc_id"), "document")  # the texts are in the documents file
        _join_documents(scan, Path(documents), skip_invalid)
    _scan_questions(scan, file, skip_invalid, carried)
    scan.stamps = stamps
    return scan


def _join_documents(scan: InputScan, documents: Path, skip_invalid: bool) -> None:
    """The questions file's documents (keyed by doc_id) found in the documents file: each one's row there and
    its text's length; a doc_id with no document stops the run (or its rows are set aside)."""
    _, texts = _indexed(documents, ("doc_id", "document"), None)
    found = dict(zip(texts.doc_keys, zip(texts.doc_row.tolist(), texts.doc_chars.tolist())))
    doc_of_row, keys = scan.doc_of_row, scan.doc_keys
    unknown = [d for d, k in enumerate(keys) if k not in found]
    scan.documents_path = documents
    scan.doc_row, scan.doc_chars = np.array([found.get(k, (-1, 0)) for k in keys], np.int64).reshape(-1, 2).T
    if unknown:
        rows = np.flatnonzero(np.isin(doc_of_row, np.asarray(unknown, np.int32))).tolist()
        if not skip_invalid:
            raise KevscoreError(f"{scan.path}: column 'doc_id' has values with no document in {documents}: "
                                f"{few(keys[d] for d in unknown)} at {rows_phrase(rows)}")
        for r in rows:
            scan.set_aside([r], f"doc_id {keys[doc_of_row[r]]!r} has no document in {documents.name}")


def _indexed(path: Path, required: tuple[str, str], reject: str | None, keep_texts: bool = False,
             skip_invalid: bool = False) -> tuple[pq.ParquetFile, InputScan]:
    """A file (the one-file input, or either file of the two-file form) opened and checked, its rows indexed by
    document: its `required` columns present, `reject` absent, its document and doc_id columns strings, doc_id
    never null nor given two different texts, a null text an error (or, with skip_invalid, its row set aside).
    Documents are keyed by doc_id, else by the text (`keep_texts`) or its digest; without a `document` column
    every text is empty."""
    file = open_parquet(path)
    names = file.schema_arrow.names
    check_names(path, names, required, reject)
    _check_types(path, file, ("document", "doc_id"))
    columns = [c for c in ("document", "doc_id") if c in names]
    doc_of_row = np.full(file.metadata.num_rows, -1, dtype=np.int32)  # -1: a row whose doc_id or text is null
    documents: dict = {}  # document key -> (its index, its text's digest and length, its first row)
    nulls: dict[str, list[int]] = {}
    clashes: dict[int, None] = {}  # documents given two different texts, in first-seen order
    for start, cols in batches(path, file, columns, nulls):
        ids, texts = cols.get("doc_id"), cols.get("document")
        for j in range(len(cols[columns[0]])):
            i, text = start + j, texts[j] if texts is not None else ""
            if text is None or (ids is not None and ids[j] is None):
                continue
            digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
            key = ids[j] if ids is not None else text if keep_texts else digest
            d, first_digest, _, _ = documents.setdefault(key, (len(documents), digest, len(text), i))
            if first_digest != digest:
                clashes[d] = None
            doc_of_row[i] = d
    keys = [k if isinstance(k, str) else k.hex() for k in documents]
    _nulls(path, "doc_id", nulls)
    if clashes:
        rows = np.flatnonzero(np.isin(doc_of_row, np.asarray(list(clashes), np.int32))).tolist()
        raise KevscoreError(f"{path}: column 'doc_id' maps {few(keys[d] for d in clashes)} to "
                            f"different 'document' texts at {rows_phrase(rows)}")
    chars, first_rows = np.array([doc[2:] for doc in documents.values()], np.int64).reshape(-1, 2).T
    scan = InputScan(path, None, doc_of_row, keys, chars, first_rows)
    _nulls(path, "document", nulls, scan if skip_invalid else None)
    return file, scan


LABEL_PROBLEMS = (("text that is no JSON array of strings", "text that is no JSON array of strings",
                   lambda v: isinstance(v, str)),
                  ("null or empty lists", "a null or empty list", lambda v: not v),
                  ("null labels", "a null label", lambda v: None in v),
                  ("repeated labels", "a repeated label", lambda v: len(set(v)) < len(v)),
                  ("single-label lists", "a single label (one label always gets probability 1)", lambda v: len(v) < 2))


def _scan_questions(scan: InputScan, file: pq.ParquetFile, skip_invalid: bool, carried: bool) -> None:
    """Questions, question ids and labels: nulls, duplicate ids, bad label lists; question lengths added to doc_chars.
    `carried`: the other columns, carried into the output, checked in the same read."""
    path, names = scan.path, file.schema_arrow.names
    _check_types(path, file, ("question", "question_id", "labels"))
    scan.columns = [c for c in ("doc_id", "question_id", "labels") if c in names]
    columns = ["question"] + [c for c in ("question_id", "labels") if c in names]
    nulls: dict[str, list[int]] = {}
    bad_labels: list[list[int]] = [[] for _ in LABEL_PROBLEMS]
    qhash = np.zeros(len(scan.doc_of_row) if "question_id" in columns else 0, dtype=np.int64)
    others = [c for c in names if c not in COLUMNS] if carried else []
    for start, cols in batches(path, file, columns, nulls, others):
        qids, labels = cols.get("question_id"), cols.get("labels")
        docs = scan.doc_of_row[start:start + len(cols["question"])]
        for j, q in enumerate(cols["question"]):
            i = start + j
            if q is not None and docs[j] >= 0:
                scan.doc_chars[docs[j]] += len(q)
            if qids is not None and qids[j] is not None:
                qhash[i] = hash(qids[j])
            if labels is not None:
                for rows, (_, _, bad) in zip(bad_labels, LABEL_PROBLEMS):
                    if bad(labels[j]):
                        rows.append(i)
                        break
    _nulls(path, "question", nulls, scan if skip_invalid else None)
    _nulls(path, "question_id", nulls)
    _check_duplicates(path, file, qhash)
    for rows, (what, one, _) in zip(bad_labels, LABEL_PROBLEMS):  # rows only where there is a labels column
        if rows and not skip_invalid:
            raise KevscoreError(f"{path}: column 'labels' ({file.schema_arrow.field('labels').type}) has {what} at "
                                f"{rows_phrase(rows)}")
        scan.set_aside(rows, f"column 'labels' has {one}")


def _check_duplicates(path: Path, file: pq.ParquetFile, qhash: np.ndarray) -> None:
    """Duplicate question ids: equal hashes first (8 bytes a row; none without a question_id column), then the
    values of those rows only."""
    values, counts = np.unique(qhash, return_counts=True)
    if not (suspects := set(values[counts > 1].tolist())):
        return
    seen: dict[str, list[int]] = {}
    for start, cols in batches(path, file, ["question_id"]):
        for j, v in enumerate(cols["question_id"]):
            if int(qhash[start + j]) in suspects:
                seen.setdefault(v, []).append(start + j)
    if dups := {v: rows for v, rows in seen.items() if len(rows) > 1}:
        rows = sorted(r for rs in dups.values() for r in rs)
        raise KevscoreError(f"{path}: column 'question_id' has duplicate values {few(dups)} at {rows_phrase(rows)}")
