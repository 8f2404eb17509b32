"""One job over several processes (one per GPU) and machines, under torch's launcher (torchrun).

Every rank reads the input, computes the same document assignment (`kevscore.shard`), scores its
documents' rows with the ordinary job and writes them, atomically, to its own part file beside the
output, with a manifest naming the job it belongs to. The ranks then exchange their status (gloo, CPU
objects only); if any rank failed, every rank fails with that rank's error and no final output is
written. Otherwise rank 0 merges the parts in input order into the output (atomically) and removes them.
A rerun of the same job reuses every part whose manifest matches instead of recomputing it.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kevscore.data import OUTPUT_SCHEMA, check_output_path, default_output_path
from kevscore.durable import bytes_filler, write_atomic
from kevscore.engine import Progress
from kevscore.errors import KevscoreError
from kevscore.job import RunOptions, check_options, run_job
from kevscore.parts import ERRORS_SCHEMA, errors_path, merge_sorted, write_parquet

TIMEOUT = datetime.timedelta(hours=24)  # ranks wait this long for each other at the status exchange


@dataclass(slots=True)
class RankStatus:
    rank: int
    rows: int = 0
    seconds: float = 0.0
    reused: bool = False
    load_s: float = 0.0   # model load, encode and bank set-up
    work_s: float = 0.0   # prefill and scoring
    error: str | None = None
    host_rank: str = ""  # "local rank of node": which GPU of which machine, without host names

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else float("nan")


@dataclass(slots=True)
class DistributedResult:
    output: Path
    ranks: list[RankStatus]
    seconds: float
    rows: int

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else float("nan")


def world_from_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when launched by torch's launcher (any number of processes) or
    with a world of more than one process; None for a plain process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    return int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0"))


def part_path(output: Path, rank: int, world: int) -> Path:
    return output.with_name(f"{output.name}.part-{rank:05d}-of-{world:05d}.parquet")


def manifest_path(part: Path) -> Path:
    return part.with_name(part.name + ".json")


def job_fingerprint(opts: RunOptions, world: int) -> str:
    """What a part depends on: the input files (name, size, modification time), the options that change
    results, and the world size (which decides the assignment)."""
    files = [Path(p) for p in (opts.input, opts.documents, opts.template) if p is not None]
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    keep = {k: str(v) for k, v in dataclasses.asdict(opts).items()
            if k in ("model", "path", "labels", "batch_rows", "batch_invariant", "bank_capacity", "window",
                     "skip_invalid")}
    blob = json.dumps({"files": stats, "options": keep, "world": world}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _reusable(part: Path, fingerprint: str) -> dict | None:
    man = manifest_path(part)
    if not (part.is_file() and man.is_file()):
        return None
    try:
        meta = json.loads(man.read_text())
        rows = pq.read_metadata(part).num_rows
    except (OSError, ValueError, pa.ArrowException):
        return None
    return meta if meta.get("fingerprint") == fingerprint and meta.get("rows") == rows else None


def _write_manifest(part: Path, meta: dict) -> None:
    write_atomic(manifest_path(part), bytes_filler(json.dumps(meta).encode()))


def _score_part(opts: RunOptions, output: Path, rank: int, world: int, progress: Progress | None) -> RankStatus:
    status = RankStatus(rank)
    t0 = time.perf_counter()
    part = part_path(output, rank, world)
    fingerprint = job_fingerprint(opts, world)
    meta = _reusable(part, fingerprint)
    if meta is not None:
        status.rows, status.seconds, status.reused = meta["rows"], meta["seconds"], True
        status.load_s, status.work_s = meta.get("load_s", 0.0), meta.get("work_s", 0.0)
        return status
    result = run_job(dataclasses.replace(opts, output=part, overwrite=True, shard=(rank, world)), progress)
    status.rows, status.seconds = result.stats.rows, time.perf_counter() - t0
    status.load_s, status.work_s = result.load_s, result.stats.prefill_s + result.stats.score_s
    _write_manifest(part, {"fingerprint": fingerprint, "rows": status.rows, "seconds": status.seconds,
                           "load_s": status.load_s, "work_s": status.work_s})
    return status


def merge_parts(output: Path, world: int, expected_rows: int | None = None) -> int:
    """Merge the rank parts into `output` in input row order, streamed (host memory stays bounded), and
    their errors files (--skip-invalid) into `output`'s; each written atomically, then the parts removed."""
    parts = [part_path(output, r, world) for r in range(world)]
    rows = 0

    def chunks():
        nonlocal rows
        for chunk in merge_sorted(parts):
            rows += chunk.num_rows
            yield chunk
        if expected_rows is not None and rows != expected_rows:
            raise KevscoreError(f"{output}: the parts hold {rows} rows, the input {expected_rows}")

    write_parquet(output, OUTPUT_SCHEMA, chunks(), output.parent)
    errors = [errors_path(p) for p in parts if errors_path(p).exists()]
    if errors:
        table = pa.concat_tables([ERRORS_SCHEMA.empty_table(), *(pq.read_table(e) for e in errors)]).sort_by("row")
        write_parquet(errors_path(output), ERRORS_SCHEMA, [table.cast(ERRORS_SCHEMA)], output.parent)
    for p in parts:
        p.unlink()
        manifest_path(p).unlink(missing_ok=True)
        errors_path(p).unlink(missing_ok=True)
    return rows


def run_distributed(opts: RunOptions, progress: Progress | None = None) -> DistributedResult:
    """This process's share of a torchrun job; returns the whole job's result on every rank."""
    import torch
    import torch.distributed as dist

    rank, world, local = world_from_env() or (0, 1, 0)
    t0 = time.perf_counter()
    dist.init_process_group("gloo", timeout=TIMEOUT)
    try:
        output = Path(opts.output) if opts.output else default_output_path(opts.input)
        status = RankStatus(rank, host_rank=f"{local} of node {os.environ.get('GROUP_RANK', '0')}")
        try:
            check_options(opts)
            sources = [Path(p) for p in (opts.input, opts.documents) if p is not None]
            check_output_path(output, sources, opts.overwrite)
            if opts.skip_invalid:
                check_output_path(errors_path(output), sources, opts.overwrite)
            if opts.device != "cpu" and torch.cuda.is_available():
                torch.cuda.set_device(local % torch.cuda.device_count())
            status = _score_part(opts, output, rank, world, progress)
            status.host_rank = f"{local} of node {os.environ.get('GROUP_RANK', '0')}"
        except KevscoreError as exc:
            status.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks
            status.error = f"{type(exc).__name__}: {exc}"
        statuses: list[RankStatus | None] = [None] * world
        dist.all_gather_object(statuses, status)
        failed = [s for s in statuses if s.error]
        if failed:
            raise KevscoreError("; ".join(f"rank {s.rank} failed: {s.error}" for s in failed)
                                + "; no output was written (completed parts are kept and reused by a rerun)")
        rows = sum(s.rows for s in statuses)
        if rank == 0:
            merge_parts(output, world, expected_rows=rows)
        dist.barrier()
        result = DistributedResult(output, statuses, time.perf_counter() - t0, rows)
        summary = os.environ.get("KEVSCORE_SUMMARY_JSON")  # for benchmarks: the job's figures as JSON
        if summary and rank == 0:
            Path(summary).write_text(json.dumps({"output": str(output), "seconds": result.seconds, "rows": rows,
                                                 "ranks": [dataclasses.asdict(s) for s in statuses]}))
        return result
    finally:
        dist.destroy_process_group()


def launch(argv: list[str], nproc: int) -> None:
    """`kevscore run --gpus N …`: the same command under torch's launcher, one process per GPU."""
    from torch.distributed.run import main as torchrun

    torchrun(["--standalone", "--nproc-per-node", str(nproc), "-m", "kevscore", *argv])
