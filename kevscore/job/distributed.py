"""One job over several processes (one per GPU) and machines, under torch's launcher (torchrun).

Every rank reads the input and plans the same windows: each rank's documents (`kevscore.job.shard`) cut into
windows, rank 0's first. Rank 0 opens the output's parts directory (`kevscore.job.parts`, under the one job
identity); every rank then scores its own windows into it as a one-process job does, and rank 0 merges
them all with the same bounded merge. Each step ends with the ranks exchanging their status (gloo, CPU
objects only): if any rank failed, every rank fails with that rank's error and no output is written; a rank
gone from an exchange (killed, interrupted) fails the ranks waiting for it, each saying so and what was kept.
A rerun of the same job resumes every completed window, whichever rank wrote it.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from kevscore.engine.backend import job_threads, resolve_device
from kevscore.engine.pipeline import Reporter
from kevscore.errors import KevscoreError, KevscoreFailure, first_line, reported, traced
from kevscore.faults import Interrupted
from kevscore.job.files import opened_inputs, output_path
from kevscore.job.options import RunOptions, check_options
from kevscore.job.parts import PartStore, merged_output, parts_dir
from kevscore.job.provenance import job_digest
from kevscore.job.run import Job, LoadedModel, completed, finished_job, merge_job, open_parts, score_job, start_job

TIMEOUT = datetime.timedelta(hours=24)  # ranks wait this long for each other at a status exchange
# gloo's errors when the other end of a wait is gone: its process ended (killed, interrupted, failed) or
# never answered (its machine lost)
LOST_PEER = re.compile(r"closed by peer|reset by peer|broken pipe|timed out|timeout|read error|write error", re.I)
KEPT = "no output was written (completed parts are kept and reused by a rerun)"
T = TypeVar("T")


class RankLost(KevscoreFailure):
    """Another rank stopped while this one waited for it at a status exchange."""


@dataclass(slots=True)
class RankStatus:
    rank: int
    rows: int = 0         # rows of this rank's windows
    seconds: float = 0.0
    reused: bool = False  # every window of this rank was complete before this run
    load_s: float = 0.0   # model load, encode and bank set-up
    work_s: float = 0.0   # prefill and scoring
    host_rank: str = ""   # "local rank of node": which GPU of which machine, without host names


@dataclass(slots=True)
class DistributedResult:
    output: Path
    ranks: list[RankStatus]
    seconds: float
    rows: int


@dataclass(slots=True)
class Ranks:
    """This process's place in a torchrun job, and the status exchange that ends each step of the job."""
    rank: int
    world: int
    local: int = 0  # the rank among this machine's processes: which of its GPUs

    def step(self, work: Callable[[], T], message: Callable[[str], str] = str) -> T:
        """Run `work` on this rank, then learn every rank's outcome: when any failed, raise on every rank one
        error naming the failed ranks and their errors (`message` rewords this rank's), a KevscoreFailure
        unless every one is an input error."""
        value, error = None, None
        try:
            value = work()
        except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks
            if traced(exc):  # where a bug happened, as a one-process run shows it
                traceback.print_exc()
            failed = reported(exc)
            error = (message(str(failed)), failed.exit_code)
        if any(errors := self.gather(error)):
            said: dict[str, list[str]] = {}  # each error, the ranks that failed with it
            for rank, (text, _) in ((r, e) for r, e in enumerate(errors) if e):
                said.setdefault(text, []).append(str(rank))
            failure = KevscoreError if all(e[1] == KevscoreError.exit_code for e in errors if e) else KevscoreFailure
            raise failure("; ".join(f"rank{'s' * (len(r) > 1)} {', '.join(r)} failed: {text}"
                                    for text, r in said.items()) + f"; {KEPT}")
        return value

    def gather(self, value: T) -> list[T]:
        """Every rank's `value`, by rank; RankLost when another rank is gone."""
        values: list = [None] * self.world
        try:
            dist.all_gather_object(values, value)
        except RuntimeError as exc:  # gloo's DistBackendError: its message, after the source line, says why
            if not LOST_PEER.search(why := first_line(exc)):
                raise
            # "[.../pair.cc:553] Read error [127.0.0.1]:64663: Connection reset by peer. ...": without the places
            why = re.sub(r" *\[[^]]*\](:\d+)?", "", why).split(". ")[0].strip()
            raise RankLost(f"another rank stopped ({why})") from None
        return values


def world_from_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when launched by torch's launcher (any number of processes) or
    with a world of more than one process; None for a plain process."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
            return None
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    except (KeyError, ValueError):
        rank = world = -1
    if not 0 <= rank < world:  # set by hand, or by a launcher other than torch's
        given = ", ".join(f"{name}={os.environ.get(name, '(unset)')}" for name in ("WORLD_SIZE", "RANK"))
        raise KevscoreError(f"{given}: not the environment of a torchrun rank; launch with torchrun or --gpus N")
    return rank, world, local


def run_distributed(opts: RunOptions) -> DistributedResult:
    """This process's share of a torchrun job; returns the whole job's result on every rank."""
    ranks = Ranks(*(world_from_env() or (0, 1, 0)))
    t0 = time.perf_counter()
    try:
        dist.init_process_group("gloo", timeout=TIMEOUT)
    except (ValueError, RuntimeError) as exc:  # the launcher's address (MASTER_ADDR, MASTER_PORT) unset or unreachable
        raise KevscoreFailure(f"rank {ranks.rank} of {ranks.world} could not join the job: {first_line(exc)}") from None
    statuses = None
    try:
        with contextlib.ExitStack() as stack:
            stack.callback(dist.destroy_process_group)
            ranks.step(lambda: stack.enter_context(job_threads(resolve_device(opts.device), opts.batch_invariant)))
            statuses = _run(opts, Reporter(), ranks, stack)
    except KeyboardInterrupt:
        if statuses is None:
            raise
        raise Interrupted(completed(output_path(opts))) from None  # every rank's job ended with the output whole
    return DistributedResult(output_path(opts), statuses, time.perf_counter() - t0, sum(s.rows for s in statuses))


def _run(opts: RunOptions, progress: Reporter, ranks: Ranks, stack: contextlib.ExitStack) -> list[RankStatus]:
    """The job's steps, each ended by a status exchange: prepare (every rank), open the parts (rank 0),
    score (every rank, its own windows), merge (rank 0). Returns every rank's status."""
    t0 = time.perf_counter()
    status = RankStatus(ranks.rank, host_rank=f"{ranks.local} of node {os.environ.get('GROUP_RANK', '0')}")
    job, parts = None, None
    try:
        inputs = ranks.step(lambda: stack.enter_context(opened_inputs(opts)))
        job = ranks.step(lambda: _start(opts, inputs, ranks), inputs.message)
        status.rows = int(job.windows.rows[job.windows.of_rank(ranks.rank)].sum())
        if job.finished is not None:  # the output exists: this very job's (nothing to do), or refused
            ranks.step(lambda: finished_job(job), inputs.message)
            status.reused = True
            return ranks.gather(status)
        parts = ranks.step(lambda: open_parts(job, progress) if ranks.rank == 0 else None, inputs.message)
        parts = ranks.step(lambda: parts or open_parts(job, progress, member=True), inputs.message)  # the others join
        result = ranks.step(lambda: score_job(job, parts, progress, ranks.rank), inputs.message)
        status.reused = result.windows > 0 and result.resumed == result.windows
        status.seconds, status.load_s = time.perf_counter() - t0, result.load_s
        status.work_s = result.stats.prefill_s + result.stats.score_s
        statuses = ranks.gather(status)
        ranks.step(lambda: merge_job(job, parts, result, progress) if ranks.rank == 0 else None, inputs.message)
        if ranks.rank == 0:
            parts.remove()
    except BaseException as exc:
        if parts is not None:
            parts.abandon()
        if isinstance(exc, (KeyboardInterrupt, RankLost)):
            raise _stopped(exc, job, parts) from None
        raise
    return statuses


def _stopped(exc: BaseException, job: Job | None, parts: PartStore | None) -> BaseException:
    """What a rank stopped by `exc` (an interrupt, or another rank lost) says was kept: the output when it is
    whole (rank 0's merge renamed into place, or this job's output there before the run), else the parts."""
    lost = isinstance(exc, RankLost)
    merged = parts.manifest.get("merged") if parts else None  # rank 0's record; the others read it on disk
    whole = job is not None and (merged_output(job.output, merged) or job.finished == job_digest(job.identity))
    said = str(exc) if lost else "interrupted"
    said = completed(job.output, parts_dir(job.output), said) if whole else f"{said}; {KEPT}"
    return RankLost(said) if lost else Interrupted(said)


def _start(opts: RunOptions, inputs, ranks: Ranks) -> Job:
    check_options(opts)
    if opts.device != "cpu" and torch.cuda.is_available():
        if ranks.local >= (gpus := torch.cuda.device_count()):  # two ranks on one GPU would share its memory
            raise KevscoreError(f"local rank {ranks.local}: this machine has {gpus} CUDA GPU(s); launch at most "
                                f"{gpus} process(es) a machine (torchrun --nproc-per-node {gpus})")
        torch.cuda.set_device(ranks.local)
    return start_job(opts, inputs, output_path(opts), LoadedModel(), ranks.world)
