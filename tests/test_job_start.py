"""A job's start: its input is tokenized on a thread of its own while the model's weights load."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
from typer.testing import CliRunner

from kevscore.cli import app
from kevscore.errors import KevscoreError
from kevscore.job import run as job
from kevscore.model import checkpoint

QUESTIONS = Path(__file__).resolve().parent.parent / "examples" / "questions.parquet"


def kevscore_run(*args):
    return CliRunner().invoke(app, ["run", str(QUESTIONS), "--model", "demo", "--device", "cpu", "--quiet",
                                    *map(str, args)])


def test_the_token_pass_runs_while_the_weights_load(tmp_path, monkeypatch):
    """The weights' read begins only once the token pass has begun (a pass that waited for the weights would
    leave it waiting 30 s and fail), and the output is the same as without the wait."""
    started, seen = threading.Event(), []
    measure, read = job.measure_tokens, checkpoint.read_safetensors

    def measuring(*args):
        started.set()
        return measure(*args)

    def reading(*args, **kwargs):
        seen.append((started.wait(30), threading.current_thread() is threading.main_thread()))
        return read(*args, **kwargs)

    monkeypatch.setattr(job, "measure_tokens", measuring)
    monkeypatch.setattr(checkpoint, "read_safetensors", reading)
    result = kevscore_run("-o", tmp_path / "overlapped.parquet")
    assert result.exit_code == 0, result.stderr
    assert seen == [(True, True)]
    monkeypatch.undo()
    assert kevscore_run("-o", tmp_path / "plain.parquet").exit_code == 0
    assert pq.read_table(tmp_path / "overlapped.parquet").equals(pq.read_table(tmp_path / "plain.parquet"))


def test_a_failed_weight_load_does_not_wait_for_the_token_pass(tmp_path, monkeypatch):
    """The weights' error is the job's one line at once, though the token pass is still running."""
    release = threading.Event()

    def stuck(*args):
        release.wait(60)
        raise AssertionError("the job waited for the token pass")

    def broken(path, *args, **kwargs):
        raise KevscoreError(f"{path}: broken weights")

    monkeypatch.setattr(job, "measure_tokens", stuck)
    monkeypatch.setattr(checkpoint, "read_safetensors", broken)
    t0 = time.perf_counter()
    result = kevscore_run("-o", tmp_path / "out.parquet")
    release.set()
    assert time.perf_counter() - t0 < 30 and result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1].endswith(": broken weights"), result.stderr
    assert not (tmp_path / "out.parquet").exists()


def test_a_token_pass_error_is_the_jobs_error(tmp_path, monkeypatch):
    """An error of the pass (here: a label that tokenizes to nothing) reaches the user as before, one line."""
    result = kevscore_run("-o", tmp_path / "out.parquet", "--labels", "Yes, ")
    assert result.exit_code == 2
    line, = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "label" in line, line


def test_the_first_window_is_read_while_the_runner_is_built(tmp_path, monkeypatch):
    """A new job's first window is read and tokenized on a thread of its own before the runner is built (a read
    that waited for the runner would leave it waiting 30 s and fail), the window is read once, and the output
    is the same as without the wait."""
    started, seen, reads = threading.Event(), [], []
    read_window, job_runner = job.read_window, job.job_runner

    def reading(*args, **kwargs):
        started.set()
        return read_window(*args, **kwargs)

    def building(*args, **kwargs):
        seen.append(started.wait(30))
        return job_runner(*args, **kwargs)

    monkeypatch.setattr(job, "read_window", reading)
    monkeypatch.setattr(job, "job_runner", building)
    read = job.RowReader.read
    monkeypatch.setattr(job.RowReader, "read", lambda self, rows: reads.append(rows) or read(self, rows))
    result = kevscore_run("-o", tmp_path / "overlapped.parquet")
    assert result.exit_code == 0, result.stderr
    assert seen == [True] and len(reads) == 1
    monkeypatch.undo()
    assert kevscore_run("-o", tmp_path / "plain.parquet").exit_code == 0
    assert pq.read_table(tmp_path / "overlapped.parquet").equals(pq.read_table(tmp_path / "plain.parquet"))


def test_a_failed_first_window_read_is_the_jobs_one_line(tmp_path, monkeypatch):
    """The first window's read fails on its thread (a file changed or lost since the scan): the job ends with
    that error's one line, writes no output and leaves no parts directory; the next run scores as usual."""
    def lost(*args, **kwargs):
        raise OSError(5, "Input/output error", str(QUESTIONS))

    monkeypatch.setattr(job, "read_window", lost)
    out = tmp_path / "out.parquet"
    result = kevscore_run("-o", out)
    assert result.exit_code == 1, result.stderr
    line, = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "Input/output error" in line and "Traceback" not in result.stderr, line
    assert not out.exists() and not (tmp_path / "out.parquet.parts").exists()
    monkeypatch.undo()
    assert kevscore_run("-o", out).exit_code == 0 and out.is_file()
