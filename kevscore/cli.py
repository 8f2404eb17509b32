"""Command line: argument parsing and rich output only; the work happens in kevscore.job."""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape as markup_escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Column, Table
from rich.text import Text

from kevscore.engine import Progress as ProgressCallbacks
from kevscore.errors import KevscoreError, reported

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Score many questions against many documents with Kev (Qwen3.5-architecture) models.")
console = Console(stderr=True)
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # never sent raw to a terminal (escape codes in doc ids, names)


def escape(text: str) -> str:
    """Text for rich: markup escaped, control characters shown as \\xNN (one line, no terminal codes)."""
    return markup_escape(CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text))


class RateColumn(ProgressColumn):
    """Rows (or documents) per second of the phase; nothing for the bank line."""

    def render(self, task) -> Text:
        unit = task.fields.get("unit")
        if not unit or task.speed is None:
            return Text("")
        return Text(f"{task.speed:,.1f} {unit}/s", style="progress.data.speed")


class EtaColumn(TimeRemainingColumn):
    def render(self, task) -> Text:
        return super().render(task) if task.fields.get("unit") else Text("")


class RichProgress(ProgressCallbacks):
    """Prefill (documents) and score (rows) bars with rates and ETAs, and the bank's use in the current wave."""

    def __init__(self, bar: Progress):
        self.bar, self.tasks, self.windows = bar, {}, 0

    def start(self, phase: str, total: int, done: int = 0) -> None:
        unit = "rows" if phase == "score" else "docs"
        self.tasks[phase] = self.bar.add_task(phase, total=total, completed=done, unit=unit, info="")

    def advance(self, phase: str, n: int) -> None:
        self.bar.advance(self.tasks[phase], n)

    def event(self, name: str, **f) -> None:
        if name == "start":
            self.windows = f["windows"]
        elif name == "window" and "score" in self.tasks:
            self.bar.update(self.tasks["score"], info=f"window {f['window'] + 1}/{self.windows}")
        elif name == "wave":
            if "bank" not in self.tasks:
                self.tasks["bank"] = self.bar.add_task("bank", total=f["entry_capacity"], unit="", info="")
            self.bar.update(self.tasks["bank"], completed=f["entries"], total=f["entry_capacity"],
                            info=f"entries; K/V {f['tokens']:,}/{f['token_capacity']:,} tokens")

    def warn(self, message: str) -> None:
        self.bar.console.print(f"[yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


class JsonProgress(ProgressCallbacks):
    """--log-json: one JSON object per line on stdout per event, and a `progress` line at most every
    `every` seconds, for batch schedulers. Warnings also go to stderr."""

    def __init__(self, every: float = 10.0, stream=None):
        self.every, self.stream = every, stream or sys.stdout
        self.total: dict[str, int] = {}
        self.done: dict[str, int] = {}
        self.began = self.last = time.monotonic()
        self.resumed = 0

    def emit(self, event: str, **fields) -> None:
        self.stream.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")
        self.stream.flush()

    def rates(self) -> dict:
        rows, total = self.done.get("score", 0), self.total.get("score", 0)
        elapsed = time.monotonic() - self.began
        rate = (rows - self.resumed) / elapsed if elapsed > 0 else 0.0
        eta = (total - rows) / rate if rate > 0 else None
        return {"rows_done": rows, "rows_total": total, "rows_per_s": round(rate, 2),
                "eta_s": None if eta is None else round(eta, 1), "elapsed_s": round(elapsed, 2)}

    def start(self, phase: str, total: int, done: int = 0) -> None:
        self.total[phase], self.done[phase] = total, done
        if phase == "score":
            self.began, self.resumed = time.monotonic(), done

    def advance(self, phase: str, n: int) -> None:
        self.done[phase] = self.done.get(phase, 0) + n
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self.emit("progress", phase=phase, docs_prefilled=self.done.get("prefill", 0),
                      docs_total=self.total.get("prefill", 0), **self.rates())

    def event(self, name: str, **fields) -> None:
        self.emit(name, **fields, **(self.rates() if name in ("part", "merged") else {}))

    def warn(self, message: str) -> None:
        self.emit("warning", message=message)
        console.print(f"[yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


@app.callback()
def _group() -> None:
    """Score many questions against many documents with Kev (Qwen3.5-architecture) models."""


def _fail(message: str, code: int = 1) -> None:
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def summary_fields(result) -> dict:
    """The run's numbers (the summary table and --log-json's `done` line)."""
    s = result.stats
    scored = s.rows - result.resumed_rows
    out = {"output": str(result.output), "model": result.model, "device": result.device, "rows": s.rows,
           "rows_scored": scored, "rows_resumed": result.resumed_rows, "documents": result.documents,
           "windows": result.windows, "windows_resumed": result.resumed, "prefixes": s.prefixes,
           "prefilled": s.prefilled, "waves": s.waves, "batches": s.batches, "prefix_tokens": s.prefix_tokens,
           "branch_tokens": s.branch_tokens, "load_s": round(result.load_s, 3), "read_s": round(s.read_s, 3),
           "prefill_s": round(s.prefill_s, 3), "score_s": round(s.score_s, 3), "write_s": round(s.write_s, 3),
           "wall_s": round(result.wall_s, 3), "oom_retries": s.oom_retries,
           "rows_per_s": round(scored / s.score_s, 2) if s.score_s > 0 else None,
           "rows_per_s_wall": round(scored / result.wall_s, 2) if result.wall_s > 0 else None,
           "peak_rss_bytes": result.peak_rss, "peak_gpu_bytes": result.peak_gpu,
           "already_complete": result.already_complete}
    if result.errors is not None:
        out.update(errors=str(result.errors), set_aside=result.set_aside)
    return out


def _summary(result) -> Table:
    s, f = result.stats, summary_fields(result)
    table = Table(title=escape(f"kevscore run · {result.model} on {result.device}"), show_header=False)
    rate = lambda v: "-" if v is None else f"{v:,.1f}"  # noqa: E731
    resumed = f" ({result.resumed_rows:,} from parts of an earlier run)" if result.resumed_rows else ""
    for key, value in [
        ("documents", f"{result.documents:,}"), ("distinct prefixes", f"{s.prefixes:,}"),
        ("prefilled", f"{s.prefilled:,} in {s.waves} wave(s)"), ("rows", f"{s.rows:,} in {s.batches} batches" + resumed),
        ("windows", f"{result.windows:,}" + (f", {result.resumed:,} resumed" if result.resumed else "")),
        ("prefix tokens", f"{s.prefix_tokens:,}"), ("branch tokens", f"{s.branch_tokens:,}"),
        ("load + encode", f"{result.load_s:.2f} s"), ("prefill time", f"{s.prefill_s:.3f} s"),
        ("scoring time", f"{s.score_s:.3f} s"), ("read + write", f"{s.read_s:.2f} s + {s.write_s:.2f} s"),
        ("wall time", f"{result.wall_s:.2f} s"), ("rows/s", f"{rate(f['rows_per_s'])} scoring, "
                                                           f"{rate(f['rows_per_s_wall'])} wall"),
        ("peak host memory", _size(result.peak_rss)),
    ]:
        table.add_row(key, value)
    if result.peak_gpu is not None:
        table.add_row("peak GPU memory", _size(result.peak_gpu))
    if s.oom_retries:
        table.add_row("out of memory", f"{s.oom_retries:,} batch(es) split and retried")
    if result.errors is not None:
        table.add_row("set aside", f"{result.set_aside:,} rows -> {escape(str(result.errors))}")
    table.add_row("output", escape(str(result.output)))
    if result.bank is not None:
        b = result.bank
        table.add_row("bank entries", f"{b.loaded:,} loaded, {s.prefilled:,} prefilled, {b.saved:,} saved, "
                                      f"{b.evicted:,} evicted" + (f", {b.rejected:,} rejected" if b.rejected else ""))
        table.add_row("bank bytes", f"{_size(b.read_bytes)} read in {b.load_s:.3f} s, "
                                    f"{_size(b.written_bytes)} written in {b.save_s:.3f} s")
    return table


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n:,.1f} TB"


@app.command()
def run(
    input: Path = typer.Argument(..., help="Questions Parquet (document, question[, doc_id, question_id, labels])."),
    documents: Optional[Path] = typer.Option(None, "--documents", help="Documents Parquet (doc_id, document)."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Default: <input>.scores.parquet."),
    model: str = typer.Option("demo", "--model", help="Checkpoint directory, demo, kev-0.8b or kev-4b."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    path: str = typer.Option("indexed", "--path", help="indexed or gathered initial-state reads."),
    labels: str = typer.Option("Yes,No", "--labels", help="Comma-separated single-token labels."),
    template: Optional[Path] = typer.Option(None, "--template", help="Text file with {document} and {question}."),
    batch_rows: int = typer.Option(64, "--batch-rows", help="Most question rows per batch."),
    bank_capacity: Optional[int] = typer.Option(None, "--bank-capacity", help="Bank entries (default: from memory)."),
    eager: bool = typer.Option(False, "--eager", help="GPU: run without CUDA graphs."),
    batch_invariant: bool = typer.Option(False, "--batch-invariant", help="One row per batch and one document per "
                                         "prefill: each row's probabilities do not depend on which rows share the job "
                                         "(bit-identical across shard counts); slower."),
    bank: Optional[Path] = typer.Option(None, "--bank", help="Keep bank entries on disk in DIR between runs."),
    bank_max_gb: Optional[float] = typer.Option(None, "--bank-max-gb",
                                                help="Evict least-recently-used entries to stay under N GB."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output file."),
    window: int = typer.Option(1024, "--window", help="Documents per window: all their rows are read, scored "
                               "and written as one part before the next window (bounds host memory)."),
    restart: bool = typer.Option(False, "--restart", help="Discard the completed parts of an interrupted run of "
                                 "this output instead of resuming it."),
    skip_invalid: bool = typer.Option(False, "--skip-invalid", help="Set aside rows that cannot be scored on their "
                                      "own (e.g. a prompt over the model's limit) into <output stem>.errors.parquet "
                                      "instead of stopping."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bars or summary."),
    log_json: bool = typer.Option(False, "--log-json", help="No progress bars: one JSON object per line on stdout "
                                  "per event (start, window, wave, part, progress, warning, merged, done, error)."),
    gpus: int = typer.Option(1, "--gpus", help="Run N processes on this machine, one per GPU, under torch's "
                             "launcher (the same as torchrun --nproc-per-node N -m kevscore run ...)."),
) -> None:
    """Score every question row against its document; write probabilities over the labels."""
    from kevscore.distributed import world_from_env
    from kevscore.job import RunOptions, run_job

    opts = RunOptions(input=input, documents=documents, output=output, model=model, device=device, path=path,
                      labels=labels.split(","), template=template, batch_rows=batch_rows, overwrite=overwrite,
                      bank_capacity=bank_capacity, eager=eager, batch_invariant=batch_invariant, bank=bank,
                      bank_max_gb=bank_max_gb, window=window, restart=restart, skip_invalid=skip_invalid)
    if gpus > 1 and world_from_env() is None:
        return _launch(gpus)
    if world_from_env() is not None:
        return _run_rank(opts, quiet)
    log = JsonProgress() if log_json else None
    columns = [TextColumn("{task.description:>7}"), BarColumn(bar_width=20), MofNCompleteColumn(),
               RateColumn(table_column=Column(no_wrap=True)),
               TimeElapsedColumn(), EtaColumn(), TextColumn("{task.fields[info]}")]
    try:
        with Progress(*columns, console=console, disable=quiet or log_json, transient=False) as bar:
            result = run_job(opts, log or RichProgress(bar))
    except (KevscoreError, OSError) as exc:
        error = reported(exc)
        if log:
            log.emit("error", message=str(error), exit_code=error.exit_code)
        _fail(str(error), error.exit_code)
    except KeyboardInterrupt as exc:
        message = str(exc) or ("interrupted; no output was written (completed windows are kept beside the output; "
                               "rerun the same command to resume)")
        if log:
            log.emit("interrupted", message=message)
        _fail(message, 130)
    if log:
        log.emit("done", **summary_fields(result))
    elif quiet:
        return
    elif result.already_complete:
        console.print(f"{escape(str(result.output))}: already complete (this job's output, {result.stats.rows:,} rows); "
                      "nothing to do", highlight=False, soft_wrap=True)
    else:
        console.print(_summary(result))


def _launch(gpus: int) -> None:
    """Re-run this command under torch's launcher with `gpus` processes (without --gpus)."""
    import sys

    from kevscore.distributed import launch

    argv, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
        elif arg == "--gpus":
            skip = True
        elif not arg.startswith("--gpus="):
            argv.append(arg)
    try:
        launch(argv, gpus)
    except Exception as exc:  # torch's ChildFailedError: the ranks printed their errors above
        _fail(f"{gpus} processes launched, at least one failed ({type(exc).__name__}); see the rank errors above")


def _run_rank(opts, quiet: bool) -> None:
    """This process is one rank of a torchrun job: score its share; rank 0 merges and reports.

    The process then leaves through `os._exit`, its streams flushed and its files already closed and
    renamed: at interpreter teardown a rank occasionally aborted after a complete, correct job
    ("terminate called without an active exception", SIGABRT; ~1 run in 75 with three jobs on two CPU
    cores), a C++ thread still joinable while static objects were destroyed, and the launcher then
    failed the job. Nothing is left for teardown to do."""
    import os
    import traceback

    code = 0
    try:
        _rank_work(opts, quiet)
    except typer.Exit as exc:
        code = exc.exit_code
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - a bug: report it as the interpreter would, then leave
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rank_work(opts, quiet: bool) -> None:
    from kevscore.distributed import run_distributed, world_from_env

    rank = world_from_env()[0]
    try:
        result = run_distributed(opts)
    except (KevscoreError, OSError) as exc:
        error = reported(exc)
        _fail(f"rank {rank}: {error}" if rank else str(error), error.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted; no output was written", 130)
    if rank == 0 and not quiet:
        table = Table(title=escape(f"kevscore run · {len(result.ranks)} ranks"))
        for name in ("rank", "GPU", "rows", "time s", "load s", "prefill + score s", "rows/s", "part"):
            table.add_column(name, justify="right")
        for s in result.ranks:
            table.add_row(str(s.rank), escape(s.host_rank), f"{s.rows:,}", f"{s.seconds:.2f}", f"{s.load_s:.2f}",
                          f"{s.work_s:.2f}", f"{s.rows_per_s:,.1f}", "reused" if s.reused else "scored")
        table.add_row("job", "", f"{result.rows:,}", f"{result.seconds:.2f}", "", "", f"{result.rows_per_s:,.1f}",
                      escape(str(result.output)), style="bold")
        console.print(table)


@app.command("bank-inspect")
def bank_inspect(
    directory: Path = typer.Argument(..., help="A bank directory (kevscore run --bank DIR)."),
    entry: Optional[str] = typer.Option(None, "--entry", help="Show one entry (a key or a unique key prefix)."),
    verify: bool = typer.Option(False, "--verify", help="Read every entry and check its checksums."),
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON to stdout."),
) -> None:
    """List a bank's entries: models, sizes per component, last use; with --verify, checksum status.
    Exits 1 when --verify finds a bad entry."""
    import json

    from kevscore.bank_store import inspect_bank

    try:
        report = inspect_bank(directory, entry, verify)
    except (KevscoreError, OSError) as exc:
        error = reported(exc)
        _fail(str(error), error.exit_code)
    if as_json:
        typer.echo(json.dumps(report, indent=1))
    else:
        out = Console(width=None if Console().is_terminal else 200)
        _print_inspect(out, report, detail=entry is not None)
    if verify and report["bad_entries"]:
        raise typer.Exit(1)


def _when(t: float | None) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def _print_inspect(out: Console, r: dict, detail: bool) -> None:
    tot = r["totals"]
    out.print(f"bank {escape(r['bank'])} · format {r['format']} v{r['version']} · {tot['entries']:,} entries, "
              f"{_size(tot['file_bytes'])} · {_size(r['disk']['free_bytes'])} free on disk", highlight=False)
    for fp, m in r["models"].items():
        about = m["about"]
        name, dtype, backend = (escape(str(about.get(k, "?"))) for k in ("name", "dtype", "backend"))
        out.print(f"model {escape(fp[:12])} · {name} · {dtype} {backend} · {m['entries']:,} entries, "
                  f"{_size(m['file_bytes'])}", highlight=False)
    for note in r["notes"]:
        out.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    if r["temporary"]:
        out.print(f"[yellow]note:[/] {len(r['temporary'])} temporary file(s) of an interrupted or running write "
                  "in tmp/ (never used; the next run removes them if their process is gone)", highlight=False)
    if detail:
        row = r["entries"][0]
        table = Table(title=f"entry {escape(row['key'])}", show_header=False)
        for key in ("key", "file", "model", "status", "tokens", "doc_ids", "bytes", "file_bytes", "indexed",
                    "tensors", "crc32", "ids_head"):
            if key in row:
                table.add_row(key, escape(str(row[key])))
        table.add_row("created", _when(row.get("created")))
        table.add_row("last used", _when(row.get("last_used")))
        out.print(table)
        return
    table = Table(title="entries (least recently used first)")
    for name, justify in [("key", "left"), ("model", "left"), ("doc ids", "left"), ("tokens", "right"),
                          ("recurrent", "right"), ("conv", "right"), ("K/V", "right"), ("file", "right"),
                          ("last used", "left"), ("status", "left")]:
        table.add_column(name, justify=justify, no_wrap=name not in ("doc ids", "status"))
    for row in sorted(r["entries"], key=lambda e: (e.get("last_used") or 0, e["key"])):
        b = row.get("bytes") or {}
        ids = ", ".join(row.get("doc_ids") or []) or "-"
        status = row["status"] + ("" if row["indexed"] else " (not indexed)")
        style = "" if row["status"] in ("ok", "unchecked") else "red"
        table.add_row(escape(row["key"][:12]), escape((row.get("model") or "?")[:12]), escape(ids),
                      f"{row.get('tokens') or 0:,}",
                      _size(b.get("recurrent", 0)), _size(b.get("conv", 0)), _size(b.get("kv", 0)),
                      _size(row["file_bytes"]), _when(row.get("last_used")), escape(status), style=style)
    table.add_row("total", "", "", f"{tot['tokens']:,}", _size(tot.get("recurrent", 0)), _size(tot.get("conv", 0)),
                  _size(tot.get("kv", 0)), _size(tot["file_bytes"]), "", "", style="bold")
    out.print(table)
    if r["verified"]:
        bad = len(r["bad_entries"])
        out.print(f"verify: {tot['entries'] - bad:,} ok, {bad:,} bad", highlight=False,
                  style="red" if bad else "green")


@app.command()
def compare(
    model: str = typer.Option("demo", "--model", help="Checkpoint directory, demo, kev-0.8b or kev-4b."),
    data: Optional[Path] = typer.Option(None, "--data", help="Rows from this Parquet instead of synthetic cases."),
    documents: Optional[Path] = typer.Option(None, "--documents", help="With --data: its documents Parquet."),
    reps: int = typer.Option(15, "--reps", help="Measured calls per path and case."),
    warmup: int = typer.Option(3, "--warmup", help="Warm-up calls per path and case (graph capture included)."),
    cases: Optional[str] = typer.Option(None, "--cases", help="Comma-separated: shared, distinct, padded, "
                                        "long-branch, cold, mixed, warm (default all; with --data the last three)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the full report (every sample) here."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of the latency distributions here."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    batch_rows: int = typer.Option(64, "--batch-rows", help="Most question rows per batch."),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="hf: also time transformers on document + question."),
    fault: Optional[str] = typer.Option(None, "--inject-fault", hidden=True, help="Test only."),
) -> None:
    """Run the gathered and indexed paths on the same weights and inputs; time them and check parity.
    Exits 1 when any case shows a probability difference, a decision flip or a changed bank."""
    from kevscore.compare import CompareOptions, compare as run_compare

    opts = CompareOptions(model=model, data=data, documents=documents,
                          cases=cases.split(",") if cases else None, reps=reps, warmup=warmup, device=device,
                          batch_rows=batch_rows, baseline=baseline, json_path=json_path, plot=plot, fault=fault)
    try:
        report = run_compare(opts, log=lambda s: console.print(f"[dim]{escape(s)}[/]", highlight=False))
    except (KevscoreError, OSError) as exc:
        error = reported(exc)
        _fail(str(error), error.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    (console if console.is_terminal else Console(stderr=True, width=170)).print(_compare_table(report))
    if not report["parity"]:
        bad = [c["name"] for c in report["cases"] if not c["summary"]["parity"]]
        _fail(f"parity failed in {', '.join(bad)}: the indexed path does not reproduce the gathered path")


def _compare_table(r: dict) -> Table:
    env = r["environment"]
    where = env.get("gpu") or f"CPU ({env.get('cpu')}, {env.get('threads')} threads)"
    unit = "GPU-event ms" if r["timer"] == "cuda-events" else "CPU wall-clock ms"
    table = Table(title=escape(f"kevscore compare · {r['model']} on {where} · {unit}, median [p10-p90]"))
    for name in ("case", "rows", "gathered", "indexed", "indexed/gathered", "rows/s g | i", "max |dp|", "flips",
                 "bank"):
        table.add_column(name, justify="left" if name == "case" else "right")
    for c in r["cases"]:
        s = c["summary"]
        lat = {p: f"{s[p]['median_ms']:.2f} [{s[p]['p10_ms']:.2f}-{s[p]['p90_ms']:.2f}]" for p in ("gathered", "indexed")}
        ok = "unchanged" if c["bank_unchanged"] else "[red]CHANGED[/]"
        diff = f"{c['max_abs_diff']:.3g}" if c["max_abs_diff"] == 0 else f"[red]{c['max_abs_diff']:.3g}[/]"
        flips = str(c["flips"]) if c["flips"] == 0 else f"[red]{c['flips']}[/]"
        name = c["name"] + (f" (+{c['prefilled_in_call']} prefilled)" if c["prefilled_in_call"] else "")
        table.add_row(name, str(c["rows"]), lat["gathered"], lat["indexed"], f"{s['indexed_over_gathered']:.3f}",
                      f"{s['gathered']['rows_per_s']:,.0f} | {s['indexed']['rows_per_s']:,.0f}", diff, flips, ok)
    warm = ", ".join(f"{c['name']} {sum(c['warmup_s'].values()):.1f} s" for c in r["cases"])
    table.caption = f"warm-up incl. graph capture, both paths (not in the latencies): {warm}"
    if any(c.get("hf_ms") for c in r["cases"]):
        table.caption += "\ntransformers naive: " + ", ".join(
            f"{c['name']} {c['summary']['hf_median_ms']:.1f} ms ({c['summary']['hf_over_indexed']:.1f}x indexed)"
            for c in r["cases"] if c.get("hf_ms"))
    return table


def main() -> None:
    app()
