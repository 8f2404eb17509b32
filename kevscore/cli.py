"""The command line: each command's arguments, and what it prints (drawn by kevscore.display).

`run` scores through a kevscore.api.Scorer (under torchrun, through kevscore.job.distributed)."""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import typer
from rich.console import Console
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from kevscore import __version__, display
from kevscore import compare as comparing
from kevscore.api import Scorer
from kevscore.display import console, escape
from kevscore.engine.backend import resolve_device
from kevscore.engine.bank_inspect import inspect_bank
from kevscore.errors import KevscoreError, reported, traced
from kevscore.job import scan
from kevscore.job.distributed import run_distributed, world_from_env
from kevscore.job.files import file_format, input_files, stdout_closed
from kevscore.job.labels import parse_labels
from kevscore.job.options import BATCH_ROWS, RunOptions
from kevscore.job.provenance import output_provenance
from kevscore.job.run import completed


class ValueHelp:
    """Help that names values, not types: no `<bool>` after a flag, `INPUT` not `{input} <path>`."""

    def get_params(self, ctx) -> list:
        params = super().get_params(ctx)
        for p in params:
            if isinstance(p, TyperOption) and p.is_flag and p.metavar is None:
                p.metavar = ""
            elif isinstance(p, TyperArgument):
                p.display_type_rich = lambda ctx: None
        return params


class Command(ValueHelp, TyperCommand):
    def collect_usage_pieces(self, ctx) -> list[str]:
        return [self.options_metavar or "[OPTIONS]"] + [
            p.metavar or p.name.upper() for p in self.get_params(ctx) if isinstance(p, TyperArgument)]


class Group(ValueHelp, TyperGroup):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # outside a command's own handling (`_failing`), where typer would exit silently
            _fail("interrupted", 130)


app = typer.Typer(cls=Group, no_args_is_help=True)  # its help: _group's docstring
# the base of typer's usage errors: its own from typer 0.27.2, click's before (typer then ran on click)
USAGE_ERRORS = getattr(typer, "TyperException", None) or importlib.import_module("click").ClickException


def main(args: list[str] | None = None) -> int:
    """Run a command (`args`, else the process's); returns its exit status. A usage error (an unknown option, a
    missing argument, a bad value) is one `error:` line naming the command's --help, not typer's boxed panel."""
    try:
        code = app(args, standalone_mode=False)
    except USAGE_ERRORS as e:
        hint = f" (see '{e.ctx.command_path} --help')" if getattr(e, "ctx", None) else ""
        if type(e).__name__ != "NoArgsIsHelpError":  # `kevscore` alone: typer has shown the help (it tells it by name)
            _error_line(e.format_message() + hint)
        return e.exit_code
    return code if isinstance(code, int) else 0


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kevscore {__version__}")
        raise typer.Exit()


@app.callback(epilog="Exit status: 0 done; 2 usage or input error (nothing scored); 1 the run failed; "
                     "130 interrupted (rerun the same command to resume).")
def _group(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                        help="Print kevscore's version and exit.")) -> None:
    """Score many questions against many documents with Kev (Qwen3.5-architecture) models."""


def _error_line(message: str) -> None:
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def _fail(message: str, code: int = 1) -> None:
    """One `error:` line on stderr, then exit: 2 for usage and input errors, 1 for runtime failures, 130
    for an interrupt."""
    _error_line(message)
    raise typer.Exit(code)


@contextmanager
def _failing(interrupted: str | None = "interrupted", prefix: str = "",
             log: display.JsonProgress | None = None) -> Iterator[dict]:
    """A command's errors as its one `error:` line (`prefix` first) and exit status, and as an event in `log`.
    Ctrl-C: `interrupted`, or (None) what the run says was kept; the block may change it as it goes
    (`["interrupted"]` of what it yields)."""
    said = {"interrupted": interrupted}
    try:
        yield said
    except (typer.Exit, typer.Abort):  # already said
        raise
    except Exception as exc:  # noqa: BLE001 - ours, the OS's and a bug's: each one line (errors.reported)
        if traced(exc):
            raise
        error = reported(exc)
        if log:
            log.emit("error", message=str(error), exit_code=error.exit_code)
        _fail(prefix + str(error), error.exit_code)
    except KeyboardInterrupt as exc:
        message = said["interrupted"] or str(exc) or INTERRUPTED_RUN
        if log:
            log.emit("interrupted", message=message)
        _fail(prefix + message, 130)


INTERRUPTED_RUN = ("interrupted; no output was written (completed windows are kept beside the output; rerun the "
                   "same command to resume)")
IO, COLUMNS, MODEL, LONG, SPEED, SHOW = ("Input and output", "Column names", "Model and labels", "Long jobs",
                                        "Speed", "Display")
MODEL_HELP = "A checkpoint directory, a hub id (ORG/NAME, ORG/NAME@REV), demo, kev-0.8b or kev-4b."  # run's, compare's


def option(default, *flags: str, panel: str | None = None, metavar: str | None = None, help: str = ""):
    """A typer option, shown in a help panel."""
    return typer.Option(default, *flags, rich_help_panel=panel, metavar=metavar, help=help)


def column_option(name: str, help: str):
    """The option naming the input's column for kevscore's column `name`: --NAME-column, default NAME."""
    return option(name, f"--{name.replace('_', '-')}-column", panel=COLUMNS, metavar="NAME", help=help)


def options_of(cls: type, params: dict, **values):
    """A command's options object (a dataclass): each field from the command's parameter of the same name,
    or from `values` (fields whose value the command works out)."""
    return cls(**{f.name: params[f.name] for f in dataclasses.fields(cls) if f.name in params} | values)


@app.command(cls=Command)
def run(
    input: str = typer.Argument(..., metavar="INPUT", help="Questions (document, question[, doc_id, question_id, "
                                "labels]): Parquet, CSV or JSON Lines (by extension), a directory or glob of "
                                "Parquet files, or a URI pyarrow reads (s3://...)."),
    documents: str | None = option(None, "--documents", panel=IO, metavar="FILE",
                                      help="Documents (doc_id, document); questions then carry doc_id."),
    output: Path | None = option(None, "-o", "--output", panel=IO, metavar="FILE",
                                    help="Default: <input stem>.scores.parquet beside the input. The extension "
                                    "picks the format: .parquet, .csv, .jsonl; - for JSON Lines on stdout."),
    overwrite: bool = option(False, "--overwrite", panel=IO, help="Replace an existing output file."),
    limit: int | None = option(None, "--limit", panel=IO, metavar="N",
                                  help="Score only the input's first N rows (a quick look; only they are checked)."),
    dry_run: bool = option(False, "--dry-run", panel=IO, help="Check the whole input and print the plan (documents, "
                           "rows, windows, waves, tokens) with a time estimate from a short calibration run; write "
                           "nothing."),
    carry: bool = option(True, "--carry/--no-carry", panel=IO,
                         help="Copy the input's other columns (all but the document text) into the output."),
    question_column: str = column_option("question", "The input's column holding the questions."),
    document_column: str = column_option("document", "The column holding the documents (either file)."),
    doc_id_column: str = column_option("doc_id", "The column holding document ids (either file)."),
    question_id_column: str = column_option("question_id", "The column holding question ids."),
    labels_column: str = column_option("labels", "The column holding each row's labels (a list)."),
    model: str = option("demo", "--model", panel=MODEL, metavar="MODEL", help=MODEL_HELP),
    device: str = option("auto", "--device", panel=MODEL, metavar="[cpu|cuda|auto]",
                         help="auto: the GPU if there is one."),
    dtype: str = option("auto", "--dtype", panel=MODEL, metavar="[auto|bf16|fp32]", help="The model's dtype: auto "
                        "is bf16 on a GPU, fp32 on the CPU (fp32 only); fp32 on a GPU: reference precision, slower."),
    state_read: str = option("indexed", "--state-read", panel=MODEL, metavar="[indexed|gathered]",
                             help="How each row's document state is read from the bank: in place (indexed) or "
                             "copied out first (gathered); the same probabilities."),
    path: str | None = typer.Option(None, "--path", hidden=True, help="The old spelling of --state-read."),
    labels: str = option("Yes,No", "--labels", panel=MODEL, metavar="LABELS",
                         help="Comma-separated labels, at least two; spaces around them are dropped (quote a label "
                         "to keep them: '\" Yes\",\" No\"'), or a JSON array of strings. A label of several "
                         "tokens scores the sum of its tokens' log-probabilities."),
    template: Path | None = option(None, "--template", panel=MODEL, metavar="FILE",
                                      help="Text file with {document} and {question}."),
    window: int = option(1024, "--window", panel=LONG, metavar="N", help="Documents per window: all their rows "
                         "are read, scored and written as one part before the next window (bounds host memory)."),
    restart: bool = option(False, "--restart", panel=LONG, help="Discard the completed parts of an interrupted run "
                           "of this output instead of resuming it."),
    skip_invalid: bool = option(False, "--skip-invalid", panel=LONG, help="Set aside rows that cannot be scored on "
                                "their own (e.g. a prompt over the model's limit) into <output stem>.errors.parquet "
                                "instead of stopping."),
    bank: Path | None = option(None, "--bank", panel=LONG, metavar="DIR",
                                  help="Keep bank entries on disk in DIR between runs."),
    bank_max_gb: float | None = option(None, "--bank-max-gb", panel=LONG, metavar="N",
                                          help="Evict least-recently-used entries to stay under N GB."),
    gpus: int = option(1, "--gpus", panel=LONG, metavar="N", help="Run N processes on this machine, one per GPU, "
                       "under torch's launcher (the same as torchrun --nproc-per-node N -m kevscore run ...)."),
    batch_rows: int = option(BATCH_ROWS, "--batch-rows", panel=SPEED, metavar="N", help="Most question rows per batch."),
    bank_capacity: int | None = option(None, "--bank-capacity", panel=SPEED, metavar="N",
                                          help="Bank entries (default: from memory)."),
    eager: bool = option(False, "--eager", panel=SPEED, help="GPU: run without CUDA graphs."),
    batch_invariant: bool = option(False, "--batch-invariant", panel=SPEED, help="One row per batch and one document "
                                   "per prefill: each row's probabilities do not depend on which rows share the job "
                                   "(bit-identical across shard counts); slower."),
    quiet: bool = option(False, "--quiet", panel=SHOW, help="No progress bars or summary."),
    log_json: bool = option(False, "--log-json", panel=SHOW, help="No progress bars: one JSON object per line on "
                            "stdout per event (start, window, wave, part, progress, warning, merged, done, error)."),
) -> None:
    """Score every question row against its document; write probabilities over the labels."""
    if path is not None:
        console.print("[yellow]warning:[/] --path is deprecated; use --state-read", highlight=False)
        state_read = path
    if gpus < 1:
        _fail(f"--gpus {gpus}: must be at least 1", 2)
    given = locals()
    with _failing():
        world = world_from_env()  # this process is a rank of a torchrun job (None: it is not)
        # rename: the input's column name -> kevscore's
        opts = options_of(RunOptions, given, labels=parse_labels(labels),
                          rename=scan.renames({name: given[f"{name}_column"] for name in scan.COLUMNS}))
        if str(output) == "-" and log_json:
            _fail("-o - writes the scores to stdout, where --log-json writes its events; choose one", 2)
        if dry_run:  # the plan on stdout: a table, or one JSON line with --log-json
            plan = Scorer.from_options(opts).dry_run(opts)
            try:
                if log_json:
                    return typer.echo(json.dumps({"event": "plan", **display.rounded(plan)}))
                return display.table_console().print(display.plan_table(plan))
            except BrokenPipeError:  # the reader stopped early (`| true`), as with -o - (files.to_stdout)
                return stdout_closed()
    if gpus > 1 or world is not None:  # several processes: this one launches them, or is one
        if str(output) == "-" or file_format(output or "") != "parquet":
            _fail("--gpus and torchrun write Parquet: give -o a .parquet name", 2)
        if world is not None:
            return _run_rank(opts, quiet, log_json)
        with _failing():  # a one-process run's checks, before any rank starts
            _launchable(opts, gpus)
        return _launch(gpus)
    log = display.JsonProgress() if log_json else None
    with _failing(None, log=log) as said:
        with display.progress_bars(console, disable=quiet or log_json) as live:
            bars = display.RichProgress(live)  # drawn unless --quiet or --log-json
            try:
                result = Scorer.from_options(opts).run(opts, log or bars)
            finally:
                bars.loaded()
            said["interrupted"] = completed(result.output)  # from here on (the bars' last draw, the summary)
        # the run's last words: the `done` event, the summary table, or a line when nothing was to do
        if log:
            log.emit("done", **display.summary_fields(result))
        elif result.already_complete and not quiet:
            console.print(f"{escape(str(result.output))}: already complete (this job's output, "
                          f"{result.stats.rows:,} rows); nothing to do", highlight=False, soft_wrap=True)
        elif not quiet:
            console.print(display.summary_table(result))


def _launchable(opts: RunOptions, gpus: int) -> None:
    """Refuse, before launching, what every rank would refuse: bad options, a missing input, too few GPUs
    (`--device cpu --gpus N`: N CPU processes, a test of the distributed job; --device auto wants GPUs)."""
    resolve_device(Scorer.from_options(opts).options.device)  # check_options, the device and dtype
    for given in (opts.input, opts.documents):
        if given is not None and "://" not in str(given):
            input_files(str(given))
    if opts.device != "cpu" and gpus > torch.cuda.device_count():
        raise KevscoreError(f"--gpus {gpus}: this machine has {torch.cuda.device_count()} CUDA GPU(s)"
                            + ("" if torch.cuda.device_count() else " (--device cpu runs the ranks on the CPU)"))


def _launch(gpus: int) -> None:
    """Re-run this command under torch's launcher with `gpus` processes; each one, a rank (`world_from_env`),
    scores its share whatever its --gpus says."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(["--standalone", "--nproc-per-node", str(gpus), "-m", "kevscore", *sys.argv[1:]])
    except SignalException as exc:  # Ctrl-C or SIGTERM, passed on to the ranks
        _fail(f"interrupted ({signal.Signals(exc.sigval).name}); the ranks' lines above say what was kept", 130)
    except Exception as exc:  # torch's ChildFailedError: the ranks printed their errors above
        code = exc.get_first_failure()[1].exitcode if hasattr(exc, "get_first_failure") else 1  # the first to end
        _fail(f"{gpus} processes launched, at least one failed ({type(exc).__name__}); see the rank errors above",
              code if code in (2, 130) else 1)


def _run_rank(opts, quiet: bool, log_json: bool) -> None:
    """This process is one rank of a torchrun job: score its share; rank 0 merges and reports.

    The process then leaves through `os._exit`, its streams flushed and its files already closed and
    renamed: interpreter teardown can abort a rank after a complete, correct job (SIGABRT, "terminate
    called without an active exception": a C++ thread still joinable while static objects are destroyed),
    and the launcher would then fail the job. Nothing is left for teardown to do."""
    rank, code = world_from_env()[0], 0
    try:
        log = display.JsonProgress() if log_json and rank == 0 else None  # rank 0's error or interrupt, as an event
        with _failing(None, f"rank {rank}: " if rank else "", log) as said:  # Ctrl-C: what run_distributed says was kept
            result = run_distributed(opts)
            said["interrupted"] = completed(result.output)  # every rank returns once the job's output is whole
            if rank == 0 and log_json:  # the job's figures and each rank's, as one `done` line
                typer.echo(json.dumps({"event": "done", **display.rounded(result)}, default=str))
            elif rank == 0 and not quiet:
                console.print(display.ranks_table(result))
    except typer.Exit as exc:
        code = exc.exit_code
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except KeyboardInterrupt:
        code = 130
    except BaseException as exc:  # noqa: BLE001 - a bug outside the rank's work (`_failing`): its line, then leave
        _error_line(str(reported(exc)))
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _show(record: dict, as_json: bool, draw: Callable[[Console], None]) -> None:
    """--json: `record` as JSON on stdout; else `draw` it there, at a terminal's width or in 80 columns."""
    if as_json:
        typer.echo(json.dumps(record, indent=1))
    else:
        draw(display.table_console())


@app.command("bank-inspect", cls=Command)
def bank_inspect(
    directory: Path = typer.Argument(..., metavar="DIR", help="A bank directory (kevscore run --bank DIR)."),
    entry: str | None = option(None, "--entry", metavar="KEY", help="Show one entry (a key or a unique key prefix)."),
    verify: bool = typer.Option(False, "--verify", help="Read every entry and check its checksums."),
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON to stdout."),
) -> None:
    """List a bank's entries: models, sizes per component, last use; with --verify, checksum status.

    Exits 1 when --verify finds a bad entry."""
    with _failing():
        report = inspect_bank(directory, entry, verify)
    _show(report, as_json, lambda out: display.print_inspect(out, report, detail=entry is not None))
    if verify and report["bad_entries"]:
        raise typer.Exit(1)


@app.command(cls=Command)
def info(
    output: Path = typer.Argument(..., metavar="FILE", help="A Parquet output of kevscore run."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole record as JSON to stdout."),
) -> None:
    """How a Parquet output was made: kevscore's version, inputs, template, model, device and options.

    The inputs with their SHA-256s, the model with its fingerprint, the dtype, state-read mode and labels."""
    with _failing():
        record = output_provenance(output)
        _show(record, as_json, lambda out: out.print(display.provenance_table(record)))


@app.command(cls=Command)
def compare(
    model: str = option("demo", "--model", metavar="MODEL", help=MODEL_HELP),
    data: Path | None = option(None, "--data", metavar="FILE", help="Rows from this Parquet instead of synthetic "
                                  "cases."),
    documents: Path | None = option(None, "--documents", metavar="FILE", help="With --data: its documents Parquet."),
    reps: int = option(15, "--reps", metavar="N", help="Measured calls per path and case."),
    warmup: int = option(3, "--warmup", metavar="N", help="Warm-up calls per path and case (on a GPU, graph capture "
                         "included)."),
    cases: str | None = option(None, "--cases", metavar="CASES", help="Comma-separated: shared, distinct, padded, "
                                  "long-branch, long-document, cold, mixed, warm (default all; with --data the last "
                                  "three)."),
    json_path: Path | None = option(None, "--json", metavar="FILE",
                                       help="Write the full report (every sample) here."),
    plot: Path | None = option(None, "--plot", metavar="FILE",
                                  help="Write a PNG of the latency distributions here."),
    device: str = option("auto", "--device", metavar="[cpu|cuda|auto]", help="auto: the GPU if there is one."),
    batch_rows: int = option(64, "--batch-rows", metavar="N", help="Most question rows per batch."),
    baseline: str | None = option(None, "--baseline", metavar="[hf|fp32]", help="hf: also time transformers on "
                                     "document + question; fp32 (GPU): also time the model in fp32 and count the "
                                     "rows whose prediction differs from bf16's."),
) -> None:
    """Run the gathered and indexed paths on the same weights and inputs; time them and check parity.

    Exits 1 when a case shows a probability difference, a decision flip or a changed bank.
    The fp32 baseline's flips are reported (their rows in --json), not failures."""
    opts = options_of(comparing.CompareOptions, locals(), cases=cases.split(",") if cases else None)
    with _failing():
        report = comparing.compare(opts, log=lambda s: console.print(f"[dim]{escape(s)}[/]", highlight=False))
    display.table_console(stderr=True).print(display.compare_table(report))
    for warning in report["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)
    if not report["parity"]:
        bad = [c for c in report["cases"] if not c["summary"]["parity"]]
        nan = "; ".join(f"{c['name']}: the {' and '.join(c['non_finite'])} path's probabilities are not finite"
                        for c in bad if c["non_finite"])
        _fail(f"parity failed: {nan}" if nan else f"parity failed in {', '.join(c['name'] for c in bad)}: the indexed "
              "path does not reproduce the gathered path")

