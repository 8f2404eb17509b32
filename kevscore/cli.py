"""Command line: argument parsing and rich output only; the work happens in kevscore.job."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kevscore.engine import Progress as ProgressCallbacks
from kevscore.errors import KevscoreError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Score many questions against many documents with Kev (Qwen3.5-architecture) models.")
console = Console(stderr=True)


class RichProgress(ProgressCallbacks):
    def __init__(self, bar: Progress):
        self.bar, self.tasks = bar, {}

    def start(self, phase: str, total: int) -> None:
        self.tasks[phase] = self.bar.add_task(phase, total=total)

    def advance(self, phase: str, n: int) -> None:
        self.bar.advance(self.tasks[phase], n)


@app.callback()
def _group() -> None:
    """Score many questions against many documents with Kev (Qwen3.5-architecture) models."""


def _fail(message: str, code: int = 1) -> None:
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _summary(result) -> Table:
    s = result.stats
    table = Table(title=escape(f"kevscore run · {result.model} on {result.device}"), show_header=False)
    rows_per_s = s.rows / s.score_s if s.score_s > 0 else float("nan")
    for key, value in [
        ("documents", f"{result.documents:,}"), ("distinct prefixes", f"{s.prefixes:,}"),
        ("prefilled", f"{s.prefilled:,} in {s.waves} wave(s)"), ("rows", f"{s.rows:,} in {s.batches} batches"),
        ("prefix tokens", f"{s.prefix_tokens:,}"), ("branch tokens", f"{s.branch_tokens:,}"),
        ("load + encode", f"{result.load_s:.2f} s"), ("prefill time", f"{s.prefill_s:.3f} s"),
        ("scoring time", f"{s.score_s:.3f} s"), ("rows/s", f"{rows_per_s:,.1f}"),
        ("output", escape(str(result.output))),
    ]:
        table.add_row(key, value)
    return table


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
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output file."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bars or summary."),
) -> None:
    """Score every question row against its document; write probabilities over the labels."""
    from kevscore.job import RunOptions, run_job

    opts = RunOptions(input=input, documents=documents, output=output, model=model, device=device, path=path,
                      labels=labels.split(","), template=template, batch_rows=batch_rows, overwrite=overwrite,
                      bank_capacity=bank_capacity, eager=eager)
    columns = [TextColumn("{task.description:>8}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    try:
        with Progress(*columns, console=console, disable=quiet, transient=False) as bar:
            result = run_job(opts, RichProgress(bar))
    except KevscoreError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        _fail("interrupted; no output was written", 130)
    if not quiet:
        console.print(_summary(result))


def main() -> None:
    app()
