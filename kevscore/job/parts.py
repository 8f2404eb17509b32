"""Resumable output: one part file per window beside the output, a manifest, and the final merge.

    OUT.parts/manifest.json          format, version, the job's identity (input and template SHA-256s, model
                                     fingerprint, options that change results, the window plan's digest),
                                     windows done; when merging, the SHA-256s of the files it is renaming
    OUT.parts/lock                   flock held by the running job (a second run on OUT is refused)
    OUT.parts/part-NNNNNN.parquet    window N's scores (output schema, rows ascending), written atomically
    OUT.parts/errors-NNNNNN.parquet  window N's rows that failed on their own (--skip-invalid), written first
    OUT.parts/.*.tmp                 a write in progress (removed by the next run)

A window's part is complete once renamed into place; its metadata names the job, so a part of another job is
never used. The final output is merged from the parts in input order (a k-way merge by row, a bounded chunk
of input rows at a time), written to a temporary file in OUT.parts, recorded in the manifest and renamed
over OUT; only then are the parts removed. A run killed anywhere leaves either complete parts (resumed),
a temporary file (removed), or a renamed output the manifest vouches for (the rerun just cleans up).
"""
from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kevscore import durable, faults
from kevscore.errors import KevscoreError, KevscoreFailure, os_failure
from kevscore.job.data import OUTPUT_SCHEMA
from kevscore.job.files import check_name, check_output_path, file_format, table_filler
from kevscore.job.provenance import JOB_KEY, PROVENANCE_KEY, differences, job_digest, provenance
from kevscore.job.rows import Cursor

FORMAT, VERSION = "kevscore-parts", 1
MANIFEST, LOCK = "manifest.json", "lock"
PART_ROW_GROUP = 1024   # rows per row group in part files: a merge keeps about one per open part
MERGE_ROWS = 16384      # input rows per merge chunk
ERRORS_SCHEMA = pa.schema([("row", pa.int64()), ("doc_id", pa.string()), ("question_id", pa.string()),
                           ("reason", pa.string())])


def errors_table(rows, reasons: list[str], doc_ids: list | None = None, question_ids: list | None = None) -> pa.Table:
    """Rows that are not scored, with their ids (None: the input has no such column) and why (ERRORS_SCHEMA)."""
    nulls = [None] * len(rows)
    return pa.table({"row": rows, "doc_id": doc_ids or nulls, "question_id": question_ids or nulls,
                     "reason": reasons}, schema=ERRORS_SCHEMA)


def parts_dir(output: Path) -> Path:
    return output.with_name(output.name + ".parts")


def check_parts_dir(output: Path, inputs: Iterable[Path]) -> None:
    """OUT.parts must be a directory or absent, have a name that fits, and hold none of the run's inputs (its
    leftovers are removed)."""
    where = parts_dir(output)
    check_name(output, where.name, "the name of its parts directory")
    if where.is_symlink() or (where.exists() and not where.is_dir()):
        raise KevscoreError(f"{output}: {where} (where its parts go) exists and is not a directory; "
                            "move it or choose another --output")
    for source in inputs:
        if where.is_dir() and Path(source).resolve().is_relative_to(where.resolve()):
            raise KevscoreError(f"{output}: the input {source} is inside {where}, where this run keeps its parts; "
                                "choose another --output")


def errors_path(output: Path) -> Path:
    """Where --skip-invalid reports the rows set aside: OUT's stem + .errors.parquet."""
    return output.with_name(f"{output.stem}.errors.parquet")


IDENTITY_PARTS = ("input", "documents", "template", "model", "options", "plan")  # each a dict (or none)


def read_manifest(directory: Path) -> dict | None:
    """A parts directory's manifest: None when there is none, {} when it is damaged (unreadable, or not of the
    shape this version writes: its format, version, identity and a merge's record of names and digests)."""
    manifest = durable.read_json_object(directory / MANIFEST)
    merged = (manifest or {}).get("merged") or {"tmp": {}, "sha256": {}, "rows": 0}
    try:  # each field the code reads there, of its type (a merge's temporary names each with its digest)
        sound = ((manifest["format"], manifest["version"]) == (FORMAT, VERSION) and isinstance(manifest["identity"], dict)
                 and all(isinstance(manifest["identity"].get(k) or {}, dict) for k in IDENTITY_PARTS)
                 and type(merged["rows"]) is int and all(type(merged["sha256"][n]) is str for n in merged["tmp"].values()))
    except (KeyError, TypeError, AttributeError):
        sound = False
    return manifest if sound or not manifest else {}


def merged_output(output: Path, merged: dict | None = None) -> bool:
    """True when the file at OUT is the merge that OUT.parts's manifest records (`merged`: its record, when
    read already), renamed into place: a run killed after renaming its output and before removing its parts
    (the rerun only cleans up)."""
    merged = merged or (read_manifest(parts_dir(output)) or {}).get("merged") or {"tmp": {}}  # of `read_manifest`'s shape
    name = merged["tmp"].get("output")
    return bool(name) and output.is_file() and durable.file_sha256(output) == merged["sha256"][name]


class PartStore:
    """The parts of one job's output: open (lock, check or start the manifest), write, merge, remove.

    The ranks of a distributed job share one store: rank 0 opens it (and holds its lock), the others then
    join it as members, each writing the parts of its own windows; rank 0 merges them all."""

    def __init__(self, output: Path, identity: dict, windows: np.ndarray, restart: bool, warn: Callable[[str], None],
                 member: bool, refuse: Sequence[Path] | None):
        """`windows`: each window's planned row count. Raises KevscoreError when OUT.parts holds completed
        parts of another job (unless restart: they are discarded), and, given `refuse` (the run's inputs),
        when a file at OUT is not this job's merge (--restart of another job over an existing output).
        `member`: join the store another rank of this job has opened (no lock, no clean-up, no manifest
        writes)."""
        self.output, self.dir = output, parts_dir(output)
        self.identity, self.job, self.planned = identity, job_digest(identity), windows
        self.member, self._lock, self.warn = member, None, warn
        self.created = not member and not self.dir.exists()
        if member:
            self.manifest = read_manifest(self.dir) or {}
            if self.manifest.get("identity") != identity:
                raise KevscoreFailure(f"{self.dir}: rank 0 did not open it for this job")
            self.done = self._completed(remove_others=False)
            return
        try:
            self.dir.mkdir(exist_ok=True)
        except OSError as e:
            raise os_failure(f"{self.dir}: cannot create the parts directory", e) from e
        self._lock = durable.lock_file(self.dir / LOCK, wait=False)
        if self._lock is None:
            raise KevscoreFailure(f"{self.output}: another kevscore run is writing this output now "
                                  f"(its parts are in {self.dir})")
        try:
            self._open(restart)
            if refuse is not None and self.output.exists() and not self.finished():
                check_output_path(self.output, refuse, False)
        except BaseException:
            self.abandon()  # a directory it created holds no part yet: it is removed, leaving no trace
            raise

    # ------------------------------------------------------------ opening

    def _open(self, restart: bool) -> None:
        """Remove a killed run's temporary files, then resume this job's manifest or start a new one: parts of
        another job stop the run (unless restart discards them). A damaged manifest is replaced when every part
        beside it is a complete part of this job (each part names its job); else whose they are cannot be told."""
        for p in self.dir.glob(".*.tmp"):
            p.unlink(missing_ok=True)  # writes of a run that was killed
        manifest = read_manifest(self.dir)
        if manifest == {} and (parts := self._parts()) and not restart:  # damaged: each part names its job
            if others := [p for w, p in parts.items() if self._check_part(w, p) is None]:
                raise KevscoreError(f"{self.dir / MANIFEST}: damaged (not a manifest kevscore writes), and {len(others)} "
                                    f"of the {len(parts)} part(s) beside it are not this job's; rerun with --restart to "
                                    "discard them, or choose another --output")
            self.warn(f"{self.dir / MANIFEST}: damaged; resuming the {len(parts)} part(s) that name this job")
            manifest = None  # its parts are resumed as if it had none
        resume = manifest is not None and not restart and manifest.get("identity") == self.identity
        if manifest is not None and not resume:
            if (done := self._parts()) and not restart:
                what = "; ".join(differences(manifest.get("identity") or {}, self.identity))
                raise KevscoreError(f"{self.output}: {len(done)} completed part(s) in {self.dir} belong to another "
                                    f"job ({what}); rerun with --restart to discard them, or choose another --output")
            if done:
                self.warn(f"{self.dir}: --restart: discarding {len(done)} completed part(s)")
            self._clear()  # --restart, or another job's leftovers with nothing completed: nothing to lose
        if resume:
            self.manifest = manifest
        else:
            self.manifest = {"format": FORMAT, "version": VERSION, "identity": self.identity, "job": self.job,
                             "created": time.time(), "done": []}
            self._write_manifest()
        self.done = self._completed(remove_others=True)

    def _write_manifest(self) -> None:
        durable.write_json(self.dir / MANIFEST, self.manifest, "manifest-write", indent=1)

    def _completed(self, remove_others: bool) -> dict[int, int]:
        """Window -> rows of each complete part of this job; other part files are removed (or ignored)."""
        done = {}
        for w, path in self._parts().items():
            if (rows := self._check_part(w, path)) is not None:
                done[w] = rows
            elif remove_others:
                self.warn(f"{path}: not a complete part of this job; recomputing window {w}")
                path.unlink(missing_ok=True)
                self._file("errors", w).unlink(missing_ok=True)
        return done

    def _parts(self) -> dict[int, Path]:
        """Window -> its part file, for every file named like a part."""
        return {int(p.name[5:-8]): p for p in self.dir.glob("part-*.parquet") if p.name[5:-8].isdigit() and p.is_file()}

    def _clear(self) -> None:
        for p in self.dir.iterdir():
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            elif p.name != LOCK:
                p.unlink(missing_ok=True)

    def _check_part(self, w: int, path: Path) -> int | None:
        """The part's row count when it is window w's complete part of this job, else None."""
        if not 0 <= w < len(self.planned):
            return None
        try:
            schema = (meta := pq.read_metadata(path)).schema.to_arrow_schema()
            failed = pq.read_metadata(self._file("errors", w)).num_rows if self._file("errors", w).exists() else 0
        except (OSError, pa.ArrowException):
            return None
        ours = (schema.metadata or {}).get(JOB_KEY) == self.job.encode() and schema.equals(OUTPUT_SCHEMA)
        return meta.num_rows if ours and meta.num_rows + failed == int(self.planned[w]) else None

    def _file(self, kind: str, w: int) -> Path:
        """Window w's `part` (its scores) or `errors` (its rows that failed on their own) file."""
        return self.dir / f"{kind}-{w:06d}.parquet"

    # ------------------------------------------------------------ writing

    def write(self, w: int, table: pa.Table, errors: pa.Table | None = None) -> None:
        """Window w's scores (rows ascending) and the rows that failed on their own, atomically."""
        if errors is not None and errors.num_rows:
            durable.write_atomic(self._file("errors", w), table_filler([errors]), self.dir)
        table = table.replace_schema_metadata({JOB_KEY: self.job.encode()})
        groups = [pa.Table.from_batches([b], table.schema) for b in table.to_batches(max_chunksize=PART_ROW_GROUP)]
        durable.write_atomic(self._file("part", w), table_filler(groups or [table], hook="part-write"), self.dir)
        faults.point("part-done")
        self.done[w] = table.num_rows
        if not self.member:  # rank 0's manifest; the parts on disk are what counts
            self.manifest["done"] = sorted(self.done)
            self._write_manifest()

    # ------------------------------------------------------------ finishing

    def finished(self) -> bool:
        """True when a merge of this job was renamed into place and only the clean-up was left."""
        if not (merged := self.manifest.get("merged")):
            return False
        self._put_in_place(merged["tmp"], merged["sha256"])  # killed between recording the merge and renaming it
        return merged_output(self.output, merged)

    def _put_in_place(self, names: dict[str, str], sha256: dict[str, str] | None = None) -> None:
        """Rename a merge's temporary files (`names`: its errors file, its output) over their targets; with the
        merge's recorded `sha256`, only those still there with those contents."""
        for name, target in (("errors", errors_path(self.output)), ("output", self.output)):
            tmp = self.dir / names.get(name, "")
            if name in names and (sha256 is None or tmp.exists() and durable.file_sha256(tmp) == sha256[tmp.name]):
                durable.replace_into(tmp, target)

    def merge(self, of_row: np.ndarray, set_aside: pa.Table | None,
              finish: Callable[[Iterator[pa.Table]], Iterator[pa.Table]]) -> int:
        """Merge the parts into the output in input order (and the errors file when `set_aside` is given:
        the rows the scan set aside); then remove the parts. Returns the output's row count. `finish`
        turns the merged chunks into the output's (columns added, rows observed); the output's format
        follows its extension (kevscore.job.files)."""
        self.done = self._completed(remove_others=False)  # the other ranks' parts too
        # every window's rows that failed on their own, by row
        failed = pa.concat_tables([ERRORS_SCHEMA.empty_table(), *(pq.read_table(self._file("errors", w))
                                   for w in sorted(self.done) if self._file("errors", w).exists())]).sort_by("row")
        of_row = of_row.copy()
        of_row[np.asarray(failed.column("row").to_pylist(), dtype=np.int64)] = -1
        expected = int((of_row >= 0).sum())
        if sum(self.done.values()) != expected:
            raise KevscoreFailure(f"{self.dir}: the parts hold {sum(self.done.values())} rows, the plan {expected}")
        names = {"output": durable.temp_path(self.output).name}
        if set_aside is not None:
            names["errors"] = durable.temp_path(errors_path(self.output)).name
            errors = pa.concat_tables([set_aside.cast(ERRORS_SCHEMA), failed]).sort_by("row")
            durable.write_new(self.dir / names["errors"], table_filler([errors]), errors_path(self.output))
        # in a Parquet output's metadata: the job, so a rerun finds it complete, and how it was made
        job = {JOB_KEY: self.job.encode(), PROVENANCE_KEY: json.dumps(provenance(self.identity)).encode()}
        fill = table_filler(finish(self._merged(of_row)), file_format(self.output), job, "merge")
        durable.write_new(self.dir / names["output"], fill, self.output)
        self.manifest["merged"] = {"tmp": names, "rows": expected,
                                   "sha256": {n: durable.file_sha256(self.dir / n) for n in names.values()}}
        self._write_manifest()
        self._put_in_place(names)
        faults.point("merged")
        return expected

    def _merged(self, of_row: np.ndarray) -> Iterator[pa.Table]:
        """The output in input order, MERGE_ROWS input rows at a time: each chunk takes the next rows of
        every part with rows in it (a part's rows ascend) and orders them by row."""
        readers: dict[int, Cursor] = {}
        taken = np.zeros(len(self.planned), np.int64)  # rows of each part merged so far
        for a in range(0, len(of_row), MERGE_ROWS):
            wins = of_row[a:a + MERGE_ROWS]
            live = wins >= 0
            if not live.any():
                continue
            counts = np.bincount(wins[live], minlength=len(self.planned))
            pieces = []
            for w in np.flatnonzero(counts).tolist():
                if w not in readers:
                    readers[w] = Cursor(self._file("part", w), OUTPUT_SCHEMA.names)
                pieces.append(readers[w].table(np.arange(taken[w], taken[w] + counts[w])))
                taken[w] += counts[w]
                if taken[w] >= self.done[w]:
                    del readers[w]
            chunk = pa.concat_tables(pieces).replace_schema_metadata(None).sort_by("row")
            if not np.array_equal(chunk.column("row").to_numpy(), np.flatnonzero(live) + a):
                raise KevscoreFailure(f"{self.dir}: the parts do not hold the rows the plan expects; rerun with --restart")
            yield chunk
        if not (of_row >= 0).any():
            yield OUTPUT_SCHEMA.empty_table()

    def abandon(self) -> None:
        """After a failure: remove the directory when this run created it and no part was completed (leave
        no trace), else keep it for a rerun to resume."""
        if self.created and not self._parts():
            self.remove()
        else:
            self.close()

    def remove(self) -> None:
        """Remove the parts directory (after a merge, or a failure that left no completed part)."""
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()
