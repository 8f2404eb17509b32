"""Parquet in and out: read and validate the input rows, write the scores atomically."""
from __future__ import annotations

import os
import secrets
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kevscore.errors import KevscoreError, rows_phrase

OUTPUT_SCHEMA = pa.schema([
    ("row", pa.int64()),
    ("doc_id", pa.string()),
    ("question_id", pa.string()),
    ("labels", pa.list_(pa.string())),
    ("probs", pa.list_(pa.float64())),
    ("prediction", pa.string()),
    ("label_mass", pa.float64()),
])


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

    @property
    def doc_keys(self) -> list[str]:
        """What identifies each row's document: its doc_id, else its text."""
        return self.doc_ids if self.doc_ids is not None else self.documents

    def take(self, indices: Sequence[int]) -> InputTable:
        """The rows at `indices` (positions in this table), keeping their input row numbers."""
        pick = lambda xs: None if xs is None else [xs[i] for i in indices]  # noqa: E731
        rows = list(indices) if self.rows is None else [self.rows[i] for i in indices]
        return InputTable(pick(self.documents), pick(self.questions), pick(self.doc_ids), pick(self.question_ids),
                          pick(self.labels), self.sources, rows)


# ---------------------------------------------------------------- reading

def read_input(path: Path, documents: Path | None = None) -> InputTable:
    """Read the one-file form, or the questions file plus a documents file joined on doc_id."""
    path = Path(path)
    if documents is None:
        return _read_one_file(path)
    return _read_two_files(path, Path(documents))


def _read_one_file(path: Path) -> InputTable:
    cols = _read_columns(path, ("document", "question"), ("doc_id", "question_id", "labels"))
    docs = _strings(path, cols, "document")
    doc_ids = _strings(path, cols, "doc_id")
    if doc_ids is not None:
        _document_map(path, doc_ids, docs)
    return InputTable(docs, _strings(path, cols, "question"), doc_ids,
                      _question_ids(path, cols), _labels(path, cols), [path])


def _read_two_files(path: Path, documents: Path) -> InputTable:
    cols = _read_columns(path, ("question", "doc_id"), ("question_id", "labels"), reject="document")
    doc_ids = _strings(path, cols, "doc_id")
    dcols = _read_columns(documents, ("doc_id", "document"), ())
    texts = _document_map(documents, _strings(documents, dcols, "doc_id"),
                          _strings(documents, dcols, "document"))
    unknown = [i for i, k in enumerate(doc_ids) if k not in texts]
    if unknown:
        ids = _few(doc_ids[i] for i in unknown)
        raise KevscoreError(f"{path}: column 'doc_id' has values with no document in {documents}: "
                            f"{ids} at {rows_phrase(unknown)}")
    return InputTable([texts[k] for k in doc_ids], _strings(path, cols, "question"), doc_ids,
                      _question_ids(path, cols), _labels(path, cols), [path, documents])


def _read_columns(path: Path, required: Sequence[str], optional: Sequence[str],
                  reject: str | None = None) -> dict[str, pa.ChunkedArray]:
    """The required columns and those optional ones present, as read from the Parquet file."""
    if not path.exists():
        raise KevscoreError(f"{path}: no such file")
    if not path.is_file():
        raise KevscoreError(f"{path}: not a file")
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise KevscoreError(f"{path}: not a readable Parquet file ({_first_line(e)})") from e
    try:
        names = file.schema_arrow.names
        _check_names(path, names, required, reject)
        wanted = [c for c in (*required, *optional) if c in names]
        table = file.read(columns=wanted)
    except (pa.ArrowException, OSError) as e:
        raise KevscoreError(f"{path}: cannot read the Parquet data ({_first_line(e)})") from e
    finally:
        file.close()
    return {c: table.column(c) for c in wanted}


def _check_names(path: Path, names: list[str], required: Sequence[str], reject: str | None) -> None:
    missing = [c for c in required if c not in names]
    present = ", ".join(repr(c) for c in names) or "none"
    if missing:
        need = ", ".join(repr(c) for c in missing)
        raise KevscoreError(f"{path}: missing required column(s) {need}; columns present: {present}")
    if reject is not None and reject in names:
        raise KevscoreError(f"{path}: has a {reject!r} column although a documents file was given; "
                            f"use one form or the other")


def _is_string(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        return _is_string(t.value_type)
    view = getattr(pa.types, "is_string_view", lambda _: False)
    return pa.types.is_string(t) or pa.types.is_large_string(t) or view(t)


def _strings(path: Path, cols: dict[str, pa.ChunkedArray], name: str) -> list[str] | None:
    """A string column as a list (dictionaries decoded), None when absent; nulls are errors."""
    if name not in cols:
        return None
    col = cols[name]
    if not _is_string(col.type):
        raise KevscoreError(f"{path}: column {name!r} has type {col.type}, expected string")
    values = col.to_pylist()
    nulls = [i for i, v in enumerate(values) if v is None]
    if nulls:
        raise KevscoreError(f"{path}: column {name!r} has nulls at {rows_phrase(nulls)}")
    return values


def _question_ids(path: Path, cols: dict[str, pa.ChunkedArray]) -> list[str] | None:
    ids = _strings(path, cols, "question_id")
    if ids is not None:
        counts = Counter(ids)
        rows = [i for i, v in enumerate(ids) if counts[v] > 1]
        if rows:
            dups = _few(v for v, n in counts.items() if n > 1)
            raise KevscoreError(f"{path}: column 'question_id' has duplicate values {dups} "
                                f"at {rows_phrase(rows)}")
    return ids


def _labels(path: Path, cols: dict[str, pa.ChunkedArray]) -> list[list[str]] | None:
    """The labels column: a non-empty list of non-null, distinct strings in every row."""
    if "labels" not in cols:
        return None
    col = cols["labels"]
    t = col.type
    if not ((pa.types.is_list(t) or pa.types.is_large_list(t)) and _is_string(t.value_type)):
        raise KevscoreError(f"{path}: column 'labels' has type {t}, expected list<string>")
    values = col.to_pylist()
    problems = (("null or empty lists", lambda v: not v),
                ("null labels", lambda v: None in v),
                ("repeated labels", lambda v: len(set(v)) < len(v)))
    for what, bad in problems:
        rows = [i for i, v in enumerate(values) if bad(v)]
        if rows:
            raise KevscoreError(f"{path}: column 'labels' ({t}) has {what} at {rows_phrase(rows)}")
    return values


def _document_map(path: Path, doc_ids: list[str], texts: list[str]) -> dict[str, str]:
    """doc_id → document text; one doc_id with two different texts is an error."""
    first: dict[str, str] = {}
    clashing: dict[str, None] = {}
    for k, text in zip(doc_ids, texts):
        if first.setdefault(k, text) != text:
            clashing[k] = None
    if clashing:
        rows = [i for i, k in enumerate(doc_ids) if k in clashing]
        raise KevscoreError(f"{path}: column 'doc_id' maps {_few(clashing)} to different 'document' "
                            f"texts at {rows_phrase(rows)}")
    return first


def _few(values: Iterable[str], limit: int = 5) -> str:
    """'a', 'b', … (12 values): distinct values in first-seen order."""
    distinct = list(dict.fromkeys(values))
    shown = ", ".join(repr(v) for v in distinct[:limit])
    return shown + (f", … ({len(distinct)} values)" if len(distinct) > limit else "")


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


# ---------------------------------------------------------------- writing

def default_output_path(input_path: Path) -> Path:
    """<dir>/<stem>.scores.parquet next to the input."""
    input_path = Path(input_path)
    return input_path.with_name(f"{input_path.stem}.scores.parquet")


def check_output_path(output: Path, inputs: Sequence[Path], overwrite: bool) -> None:
    """Refuse an output that is an input, that exists (unless overwrite) or has no directory."""
    output = Path(output)
    for source in inputs:
        if _same_file(output, Path(source)):
            raise KevscoreError(f"{output}: the output is the input file {source}; choose another --output")
    if not output.parent.is_dir():
        raise KevscoreError(f"{output}: directory {output.parent} does not exist")
    if output.is_dir():
        raise KevscoreError(f"{output}: is a directory; choose a file name for --output")
    if output.exists() and not overwrite:
        raise KevscoreError(f"{output}: already exists; pass --overwrite to replace it")


def _same_file(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    return a.exists() and b.exists() and os.path.samefile(a, b)


def write_output(path: Path, rows: InputTable, labels: list[list[str]], probs: list[list[float]],
                 label_mass: list[float], extra: dict[str, pa.Array] | None = None) -> None:
    """Write the scores with OUTPUT_SCHEMA (+ extra columns) atomically to path."""
    table = output_table(rows, labels, probs, label_mass, extra)
    _write_atomic(Path(path), table)


def output_table(rows: InputTable, labels: list[list[str]], probs: list[list[float]],
                 label_mass: list[float], extra: dict[str, pa.Array] | None = None) -> pa.Table:
    n = len(rows)
    extra = extra or {}
    _check_lengths(n, {"labels": labels, "probs": probs, "label_mass": label_mass, **extra})
    for i, (ls, ps) in enumerate(zip(labels, probs)):
        if len(ls) != len(ps):
            raise ValueError(f"row {i}: {len(ls)} labels but {len(ps)} probs")
    clash = [k for k in extra if k in OUTPUT_SCHEMA.names]
    if clash:
        raise ValueError(f"extra columns {clash} clash with the output schema")
    nulls = [None] * n
    arrays = [
        pa.array(rows.rows if rows.rows is not None else range(n), pa.int64()),
        pa.array(rows.doc_ids if rows.doc_ids is not None else nulls, pa.string()),
        pa.array(rows.question_ids if rows.question_ids is not None else nulls, pa.string()),
        pa.array(labels, pa.list_(pa.string())),
        pa.array([[float(p) for p in ps] for ps in probs], pa.list_(pa.float64())),
        pa.array([_argmax_label(ls, ps) for ls, ps in zip(labels, probs)], pa.string()),
        pa.array([float(m) for m in label_mass], pa.float64()),
    ]
    schema = OUTPUT_SCHEMA
    for name, column in extra.items():
        schema = schema.append(pa.field(name, column.type))
        arrays.append(column)
    return pa.Table.from_arrays(arrays, schema=schema)


def _check_lengths(n: int, columns: dict[str, Sequence | pa.Array]) -> None:
    wrong = {k: len(v) for k, v in columns.items() if len(v) != n}
    if wrong:
        raise ValueError(f"expected {n} rows in every output column, got {wrong}")


def _argmax_label(labels: Sequence[str], probs: Sequence[float]) -> str | None:
    """The label with the highest probability, the first one on ties."""
    if not labels:
        return None
    return labels[max(range(len(probs)), key=probs.__getitem__)]


def _write_atomic(path: Path, table: pa.Table) -> None:
    """Write to a hidden temp file beside path, fsync it, then rename it over path."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            pq.write_table(table, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise KevscoreError(f"{path}: cannot write the output ({_first_line(e)})") from e
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
