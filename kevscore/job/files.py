"""A job's files: its input and documents opened as Parquet files to stream, its output's path and format.

Parquet, CSV and JSON Lines by extension: an input that is not one Parquet file (another format, several files, a
URI, renamed columns, --limit) is staged into one in a temporary directory; the output is written in its file's
format (`-o -`: JSON Lines on stdout), with the input's other columns carried into it."""
from __future__ import annotations

import base64
import glob
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.json as pajson
import pyarrow.parquet as pq

from kevscore import faults
from kevscore.durable import Filler
from kevscore.errors import KevscoreError, first_line
from kevscore.job.data import OUTPUT_SCHEMA
from kevscore.job.options import RunOptions
from kevscore.job.rows import Cursor

NAME_MAX = 255  # bytes of a file name, the most that common filesystems take
IDS = ("doc_id", "question_id")  # columns whose integers are read as their text
FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}
STDOUT = "-"  # `-o -`: JSON Lines on stdout


def file_format(path: Path | str, written: bool = False) -> str:
    """parquet, csv or jsonl from the file's extension (parquet for another one read, or none written)."""
    suffix = Path(str(path)).suffix.lower()
    if suffix == ".json":
        raise KevscoreError(f"{path}: .json is not a format kevscore reads or writes; use .jsonl (JSON Lines)")
    if written and suffix and suffix not in FORMATS:
        raise KevscoreError(f"{path}: kevscore writes .parquet, .csv or .jsonl (JSON Lines), not {suffix}")
    return FORMATS.get(suffix, "parquet")


# ---------------------------------------------------------------- reading

@dataclass(slots=True)
class Source:
    """An input as the user named it (a file, a directory or a glob of Parquet files) and the one Parquet
    file a job streams: the file itself, or a staged copy (another format, renamed columns, --limit)."""
    given: str          # what the user passed, for messages
    files: list[Path]   # the files it names, sorted
    path: Path          # the Parquet file to stream: one of `files`, or a copy staged from them
    columns: list[str]  # the column names as given
    rename: dict[str, str] = field(default_factory=dict)  # the user's column name -> kevscore's


def is_glob(given: str) -> bool:
    """Whether an input names files by a pattern: glob characters, and no file of that very name."""
    return not Path(given).exists() and any(ch in given for ch in "*?[")


def input_files(given: str) -> list[Path]:
    """The files an input names: a file, every *.parquet file under a directory, or a glob's matches."""
    path = Path(given)
    if not given:
        raise KevscoreError("the input's path is empty")
    if is_glob(given):
        found, none = [Path(p) for p in glob.glob(given, recursive=True)], "no file matches"
    elif path.is_dir():
        found = [f for f in path.rglob("*.parquet") if not hidden(f.relative_to(path).as_posix())]
        none = "a directory with no .parquet file (names beginning with . or _ are skipped)"
    else:
        found, none = [path], "not a regular file" if path.exists() else "no such file"
    if not (files := sorted(f for f in found if f.is_file())):
        raise KevscoreError(f"{given}: {none}")
    return files


def hidden(relative: str) -> bool:
    """Whether a file's path inside an input directory has a name beginning with . or _ (a hidden file, a writer's
    temporary or marker: Spark's _temporary/): skipped, as pyarrow's and Spark's readers do."""
    return any(name.startswith((".", "_")) for name in relative.split("/"))


def remote_files(uri: str) -> tuple[pafs.FileSystem, list[str]]:
    """A URI's filesystem (any pyarrow supports: s3://, gs://, hdfs://, file://) and its files: the file,
    or every *.parquet file under it."""
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
        if fs.get_file_info(path).type != pafs.FileType.Directory:
            return fs, [path]
        found = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    except (pa.ArrowException, OSError, ValueError) as e:
        raise KevscoreError(f"{uri}: cannot open ({first_line(e)})") from e
    found = [f.path for f in found if f.is_file and f.path.endswith(".parquet") and not hidden(f.path[len(path):])]
    if not (paths := sorted(found)):
        raise KevscoreError(f"{uri}: a directory with no .parquet file (names beginning with . or _ are skipped)")
    return fs, paths


def open_source(given: str | Path, stage_dir: Path, rename: dict[str, str] | None = None,
                limit: int | None = None) -> Source:
    """The input `given` as one Parquet file: a local Parquet file as it is; anything else (CSV, JSON Lines,
    several Parquet files, a URI, columns to rename, only the first `limit` rows) staged into `stage_dir`.
    `rename`: the user's column name -> kevscore's (e.g. {'text': 'question'})."""
    given = str(given)
    rename = {k: v for k, v in (rename or {}).items() if k != v}
    if "://" in given:
        fs, paths = remote_files(given)
        return Source(given, [], *_stage(given, paths, fs, rename, limit, stage_dir), rename)
    files = input_files(given)
    if len(files) == 1 and file_format(files[0]) == "parquet" and not rename and limit is None:
        if (columns := _kevscore_typed(files[0])) is not None:
            return Source(given, files, files[0], columns, rename)
    return Source(given, files, *_stage(given, [str(f) for f in files], None, rename, limit, stage_dir), rename)


def _kevscore_typed(path: Path) -> list[str] | None:
    """A Parquet file's column names when a job can stream it as it is (none when it cannot be read: the scan says
    why); None when its ids are integers, which a staged copy turns into their text."""
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError):
        return []
    staged = any(f.name in IDS and pa.types.is_integer(f.type) or unviewed(f.type) != f.type for f in schema)
    return None if staged else schema.names


def unviewed(t: pa.DataType) -> pa.DataType:
    """`t` with its string and binary views as plain strings and binaries: pyarrow cannot take rows of a view
    column, which a job does to read a window's rows."""
    return retyped(t, lambda leaf: {"string_view": pa.string(), "binary_view": pa.binary()}.get(str(leaf), leaf))


def retyped(t: pa.DataType, leaf: Callable[[pa.DataType], pa.DataType]) -> pa.DataType:
    """`t` with `leaf` applied to the types in it: itself, or its lists' and structs' (at any depth)."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return (pa.list_ if pa.types.is_list(t) else pa.large_list)(t.value_field.with_type(retyped(t.value_type, leaf)))
    if pa.types.is_struct(t):
        return pa.struct([t.field(i).with_type(retyped(t.field(i).type, leaf)) for i in range(t.num_fields)])
    return leaf(t)


def _stage(given: str, paths: list[str], fs: pafs.FileSystem | None, rename: dict[str, str], limit: int | None,
           stage_dir: Path) -> tuple[Path, list[str]]:
    """The files (one CSV or JSON Lines file, or Parquet files) as one Parquet file in stage_dir, and their column
    names as given."""
    fmt = file_format(paths[0]) if len(paths) == 1 else "parquet"
    stage_dir.mkdir(exist_ok=True)
    name = Path(paths[0]).name if len(paths) == 1 else "input"
    staged = stage_dir / f"{name if len(name.encode()) <= NAME_MAX - 15 else 'input'}.staged.parquet"
    try:
        reader = _reader(paths, fmt, fs, rename)
        with open(staged, "xb") as f:
            table_filler(_as_kevscore(_tables(reader, limit), rename), "parquet", {})(f)
    except (pa.ArrowException, OSError, ValueError) as e:
        what = {"parquet": "Parquet", "csv": "CSV", "jsonl": "JSON Lines"}[fmt]
        raise KevscoreError(f"{given}: not readable as {what} ({first_line(e)})") from e
    return staged, reader.schema.names


def _reader(paths: list[str], fmt: str, fs: pafs.FileSystem | None, rename: dict[str, str]):
    """A record-batch reader (with .schema) over the files; a CSV file's every column as text, as written (text
    that is not UTF-8 too: the scan names its column and row), and the Parquet files' id columns (`rename`d or not)
    as text where one file's are integers (another's may be text)."""
    if fmt == "parquet":  # the files' columns together: a column a file lacks is null there
        schemas = [pq.read_schema(p, filesystem=fs) for p in paths]
        text = {f.name for s in schemas for f in s if rename.get(f.name, f.name) in IDS and pa.types.is_integer(f.type)}
        schemas = [pa.schema([f.with_type(pa.string()) if f.name in text else f for f in s]) for s in schemas]
        schema = pa.unify_schemas(schemas, promote_options="permissive")
        return ds.dataset(paths, schema=schema, format="parquet", filesystem=fs).scanner(use_threads=False).to_reader()
    stream = (lambda: fs.open_input_stream(paths[0])) if fs is not None else (lambda: paths[0])
    if fmt == "jsonl":  # its keys and types found in blocks of up to 1 GiB, not 1 MiB: a key may first appear late
        size = fs.get_file_info(paths[0]).size if fs is not None else os.path.getsize(paths[0])
        return pajson.open_json(stream(), read_options=pajson.ReadOptions(block_size=min(max(size, 1 << 20), 1 << 30)))
    types = {name: pa.string() for name in pacsv.open_csv(stream()).schema.names}  # its header, read first
    return pacsv.open_csv(stream(), convert_options=pacsv.ConvertOptions(column_types=types, check_utf8=False))


def _tables(reader, limit: int | None) -> Iterator[pa.Table]:
    """The reader's rows as tables, only the first `limit` of them; its schema's empty table first (an input
    of no rows still has its columns)."""
    yield reader.schema.empty_table()
    left = sys.maxsize if limit is None else limit
    for batch in reader:
        yield pa.Table.from_batches([batch.slice(0, left)])
        if (left := left - batch.num_rows) <= 0:
            return


def _as_kevscore(tables: Iterable[pa.Table], rename: dict[str, str]) -> Iterator[pa.Table]:
    """Columns renamed to kevscore's names, integer ids as strings, views as plain types (`unviewed`; a labels
    column of JSON text is read as lists by the scan: kevscore.job.scan.json_labels)."""
    for table in tables:
        table = table.rename_columns([rename.get(n, n) for n in table.column_names])
        for i, f in enumerate(table.schema):
            plain = pa.string() if f.name in IDS and pa.types.is_integer(f.type) else unviewed(f.type)
            if plain != f.type:
                table = table.set_column(i, f.name, table.column(i).cast(plain))
        yield table


@dataclass(slots=True)
class Inputs:
    """The input and documents as given, and the Parquet files a job streams (`open_source`)."""
    questions: Source
    documents: Source | None
    stage: Path                   # a temporary directory for staged copies (and `-o -`'s output)

    def sources(self) -> list[Source]:
        return [s for s in (self.questions, self.documents) if s is not None]

    @property
    def files(self) -> list[Path]:
        return [f for s in self.sources() for f in s.files]

    def case_warnings(self) -> Iterator[str]:
        """Warnings for the input's columns named like an optional one kevscore reads but in another case ('Labels'):
        carried as any other column, not read (--labels would then score every row)."""
        source = self.questions
        named = {*source.columns, *source.rename, *source.rename.values()}  # columns read, or renamed to be
        for name in source.columns:
            ours = name.lower()
            if ours in (*IDS, "labels") and ours not in named and name not in source.rename:
                yield (f"{source.given}: column {name!r} is not read as {ours!r} (column names are case-sensitive); "
                       f"--{ours.replace('_', '-')}-column {name} reads it")

    def message(self, text: str) -> str:
        """An error message about staged copies and renamed columns, told about the input as given."""
        for source in self.sources():
            if source.path not in source.files:  # a staged copy, by its path or its name
                text = text.replace(str(source.path), source.given).replace(source.path.name, source.given)
        for theirs, ours in self.questions.rename.items():
            text = text.replace(f"column {ours!r}", f"column {theirs!r}")
        return text


@contextmanager
def opened_inputs(opts: RunOptions) -> Iterator[Inputs]:
    """The input and documents as Parquet files to stream, staged in a temporary directory when they are
    not (`open_source`); errors about them name the input as given."""
    with tempfile.TemporaryDirectory(prefix="kevscore-") as tmp:
        stage = Path(tmp)
        questions = open_source(opts.input, stage / "input", opts.rename, opts.limit)
        documents = open_source(opts.documents, stage / "documents", opts.rename) if opts.documents else None
        inputs = Inputs(questions, documents, stage)
        given = [c for source in inputs.sources() for c in source.columns]
        for theirs, ours in questions.rename.items():
            if theirs not in given:
                present = ", ".join(repr(c) for c in dict.fromkeys(given)) or "none"
                raise KevscoreError(f"{opts.input}: no column {theirs!r} to read as {ours!r}; columns present: {present}")
            for source in inputs.sources():  # a file with both names, unless its `ours` is renamed away too
                if {theirs, ours} <= set(source.columns) and ours not in questions.rename:
                    raise KevscoreError(f"{source.given}: column {theirs!r} is to be read as {ours!r}, but there is a "
                                        f"column {ours!r} too; rename or drop one of them")
        try:
            yield inputs
        except KevscoreError as exc:
            raise type(exc)(inputs.message(str(exc))) from exc


# ---------------------------------------------------------------- writing

def check_name(output: Path, name: str, what: str) -> None:
    """Refuse an output whose own name, or the name of a file or directory made beside it (`what`), is too long
    for a file name: before any work, not at the merge."""
    if (size := len(name.encode())) > NAME_MAX:
        raise KevscoreError(f"{output}: {what} would be {size} bytes long, and a file name takes at most {NAME_MAX}; "
                            "choose a shorter --output")


def output_path(opts: RunOptions) -> Path:
    """The output file: -o, else <input stem>.scores.parquet beside the input."""
    if opts.output is not None:
        if Path(opts.output).name in ("", ".."):  # '', '.', '..', '/'
            raise KevscoreError(f"-o {str(opts.output)!r}: give the output a file name")
        check_name(Path(opts.output), Path(opts.output).name, "its name")
        return Path(opts.output)
    source = Path(opts.input)
    if is_glob(str(opts.input)) or "://" in str(opts.input):
        raise KevscoreError(f"{opts.input}: a glob or URI input needs -o/--output")
    source = Path(os.path.abspath(source)) if source.name in ("", "..") else source  # '.', '..': by its name
    if not source.name:  # '/'
        raise KevscoreError(f"{opts.input}: give -o/--output")
    return source.with_name(f"{source.stem}.scores.parquet")


def check_output_path(output: Path, inputs: Sequence[Path], overwrite: bool, within: Sequence[Path | str] = ()) -> None:
    """Refuse an output that is an input (a file of `inputs`, anything inside a directory of `within`: the
    model's, the bank's, the input's, or a file a glob of `within` matches), that is not a regular file, that
    exists (unless overwrite), has no directory, or a name too long for a file."""
    check_name(output, output.name, "its name")
    for source in inputs:
        if output.exists() and source.exists() and os.path.samefile(output, source):
            raise KevscoreError(f"{output}: the output is the input file {source}; choose another --output")
    for directory in map(Path, within):
        if is_glob(str(directory)) and fnmatch(os.path.abspath(output), os.path.abspath(directory)):
            raise KevscoreError(f"{output}: the input {directory} would read it; choose another --output")
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


def table_filler(tables: Iterable[pa.Table], fmt: str = "parquet", metadata: dict[bytes, bytes] | None = None,
                 hook: str | None = None) -> Filler:
    """A filler (kevscore.durable) writing a stream of tables of one schema into an open binary file: Parquet
    (with `metadata` when given), CSV (list columns as JSON arrays) or JSON Lines (one object per row); `hook`
    is a fault point after each table."""
    def fill(file: BinaryIO) -> None:
        writer = None
        with ExitStack() as stack:  # the writer, once made, is closed however the write ends
            for table in tables:
                if fmt == "jsonl":
                    file.write("".join(json_text(row) + "\n" for row in json_ready(table).to_pylist()).encode("utf-8"))
                else:
                    table = lists_as_json(table) if fmt == "csv" else table
                    if writer is None:
                        schema = table.schema if metadata is None else table.schema.with_metadata(metadata)
                        writer = stack.enter_context(pq.ParquetWriter(file, schema) if fmt == "parquet"
                                                     else pacsv.CSVWriter(file, table.schema))
                    writer.write_table(table)
                if hook:
                    faults.point(hook)
    return fill


def json_ready(table: pa.Table) -> pa.Table:
    """The table with its nanosecond times (in lists and structs too) as their text: a Python time holds only
    microseconds, and pyarrow will not round one."""
    for i, f in enumerate(table.schema):
        if (text := retyped(f.type, lambda t: pa.string() if getattr(t, "unit", None) == "ns" else t)) != f.type:
            table = table.set_column(i, f.name, table.column(i).cast(text))
    return table


def json_text(value) -> str:
    """A value as strict JSON: NaNs and infinities, at any depth, as null (JSON has no words for them); a value
    JSON has no type for (a date) as its text."""
    try:
        return json.dumps(value, ensure_ascii=False, default=as_text, allow_nan=False)
    except ValueError:  # a float that is not finite, somewhere inside
        return json.dumps(finite(value), ensure_ascii=False, default=as_text)


def as_text(value) -> str:
    """A value JSON and CSV have no type for: bytes as base64, another (a date) as its text."""
    return base64.b64encode(value).decode("ascii") if isinstance(value, bytes) else str(value)


def finite(value):
    """`value` with its floats that are not finite, in lists, tuples and dicts too, as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    return [finite(v) for v in value] if isinstance(value, (list, tuple)) else value


def lists_as_json(table: pa.Table) -> pa.Table:
    """List, struct and map columns turned into JSON strings, binary ones into base64, those the CSV writer has no
    text for (a uuid, an interval) into their Python value's (what CSV can hold)."""
    table = json_ready(table)
    for i, f in enumerate(table.schema):
        binary = pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type) or pa.types.is_fixed_size_binary(f.type)
        other = isinstance(f.type, pa.BaseExtensionType) or pa.types.is_interval(f.type)
        if binary or other or pa.types.is_nested(f.type):
            text = [None if v is None else json_text(v) if pa.types.is_nested(f.type) else as_text(v)
                    for v in table.column(i).to_pylist()]
            table = table.set_column(i, pa.field(f.name, pa.string()), pa.array(text, pa.string()))
    return table


def to_stdout(path: Path) -> None:
    """Copy a file to stdout; a reader that stops early (`| head`) has all it wanted."""
    try:
        with open(path, "rb") as f:
            shutil.copyfileobj(f, sys.stdout.buffer)
        sys.stdout.flush()
    except BrokenPipeError:
        stdout_closed()


def stdout_closed() -> None:
    """The reader of stdout stopped early (`| head`): what is still written there goes nowhere, without a
    second error (at exit, or in the error line's event)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


class Carry:
    """Adds the input's other columns to the output's chunks (rows ascending), read alongside them: every
    input column but the document text and those the output has, under the user's names; read from the version
    of the file the scan read (`stamps`: the scan's, kevscore.durable.stamp)."""

    def __init__(self, source: Source, warn: Callable[[str], None], stamps: dict[Path, tuple]):
        theirs = {v: k for k, v in source.rename.items()}
        self.columns: list[tuple[str, pa.Field]] = []
        for f in pq.read_schema(source.path):
            name = theirs.get(f.name, f.name)
            if f.name in ("document", "doc_id", "question_id", "labels"):
                continue  # the text is not repeated; the output has the others already
            if name in OUTPUT_SCHEMA.names:
                warn(f"{source.given}: column {name!r} is not copied into the output, which has its own")
                continue
            self.columns.append((f.name, f.with_name(name)))
        self.cursor = Cursor(source.path, [c for c, _ in self.columns], stamps) if self.columns else None

    def add(self, chunk: pa.Table) -> pa.Table:
        """The chunk with the columns carried, as Arrow values: exactly as read (a nanosecond time has no Python value)."""
        rows = chunk.column("row").to_numpy()
        values = self.cursor.table(rows) if self.cursor is not None and len(rows) else None
        for column, f in self.columns:
            chunk = chunk.append_column(f, values.column(column) if values is not None else pa.array([], f.type))
        return chunk
