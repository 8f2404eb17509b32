"""CLI conventions: --version, help that names choices and values, one exit-status convention."""
from __future__ import annotations

import fcntl
import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import typer
from typer.testing import CliRunner

from kevscore import __version__
from kevscore.cli import app
from kevscore.job.parts import LOCK, parts_dir

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def kevscore(*args, width: int = 80):
    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=width, env={"COLUMNS": str(width)})


def test_version() -> None:
    result = kevscore("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"kevscore {__version__}"


def test_help_names_choices_and_values_not_types() -> None:
    top = kevscore("--help")
    assert top.exit_code == 0 and "--install-completion" in top.stdout and "--version" in top.stdout
    assert "Exit status: 0" in top.stdout and "130 interrupted" in top.stdout
    for command in ("run", "bank-inspect", "compare"):
        text = kevscore(command, "--help").stdout
        for bad in ("<str>", "<bool>", "<int>", "<path>", "<float>", "{input}", "{directory}", "…"):
            assert bad not in text, (command, bad)
    run = kevscore("run", "--help").stdout
    assert "run [OPTIONS] INPUT" in run
    for choice in ("[cpu|cuda|auto]", "[indexed|gathered]"):
        assert choice in run
    assert "<input stem>.scores.parquet" in " ".join(run.replace("│", " ").split())


def test_help_texts_flow_without_breaks_inside_a_sentence() -> None:
    """typer's rich help keeps a docstring's line breaks: a command's first paragraph (its line in the commands
    list) is one line, and each later line ends a sentence, so no help breaks mid-sentence at any width."""
    for name, command in typer.main.get_command(app).commands.items():
        first, *rest = inspect.cleandoc(command.help).split("\n\n")
        assert "\n" not in first, name
        assert all(line.endswith(".") for paragraph in rest for line in paragraph.splitlines()), name


def test_exit_status_2_for_usage_and_input_errors(tmp_path: Path) -> None:
    assert kevscore("run", "--no-such-option").exit_code == 2
    assert kevscore("run", tmp_path / "missing.parquet", "--device", "cpu").exit_code == 2
    assert kevscore("run", EXAMPLES / "questions.parquet", "--device", "gpu").exit_code == 2


def test_exit_status_1_for_a_run_that_fails(tmp_path: Path) -> None:
    """Another process holds the output's parts lock: the run cannot go on (a runtime failure)."""
    src = Path(shutil.copy(EXAMPLES / "questions.parquet", tmp_path / "q.parquet"))
    out = tmp_path / "out.parquet"
    parts_dir(out).mkdir()
    fd = os.open(parts_dir(out) / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        result = kevscore("run", src, "--device", "cpu", "-o", out)
    finally:
        os.close(fd)
    assert result.exit_code == 1 and "another kevscore run is writing" in result.stderr, result.stderr


def test_run_shows_a_line_at_once_on_a_terminal():
    """Before its imports (a second or more), `kevscore run` writes a line the progress display writes over;
    nothing when it shows nothing else, or when stderr is not a terminal."""
    from kevscore.__main__ import starting_line

    assert starting_line(["run", "q.parquet"], True) == "kevscore: starting\r"
    for args in (["run", "q.parquet", "--quiet"], ["run", "q.parquet", "--log-json"], ["run", "--help"],
                 ["bank-inspect", "DIR"], []):
        assert starting_line(args, True) is None, args
    assert starting_line(["run", "q.parquet"], False) is None


def test_usage_errors_are_one_line(capsys) -> None:
    """A mistyped option, a missing argument, a bad value, an unknown command: one `error:` line on stderr naming
    the command's --help (not typer's boxed panel), exit status 2; `kevscore` alone still shows its help."""
    from kevscore.cli import main

    for args, message in ((["run", "--foo"], "No such option: --foo"), (["run"], "Missing argument 'INPUT'."),
                          (["run", "q.parquet", "--limit", "many"], "Invalid value for '--limit'"),
                          (["nocmd"], "No such command 'nocmd'.")):
        assert main(args) == 2, args
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"error: {message}") and err.count("\n") == 1, (args, err)
        assert err.endswith(f"{' run' if args[0] == 'run' else ''} --help')\n"), err
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert "Usage:" in out and "run" in out and err == ""
    assert main(["run", "--help"]) == 0 and "run [OPTIONS] INPUT" in capsys.readouterr().out
    # the command itself, and typer's installed version
    done = subprocess.run([sys.executable, "-m", "kevscore", "run", "--foo"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "error: No such option: --foo (see 'python -m kevscore run --help')\n", done.stderr


def test_a_run_failing_before_its_phases_starts_its_stderr_with_the_error(tmp_path: Path) -> None:
    """stderr a pipe: the progress display, stopped with no bar shown, leaves no blank line before `error:`."""
    done = subprocess.run([sys.executable, "-m", "kevscore", "run", str(tmp_path / "missing.parquet"), "--device", "cpu"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith(f"error: {tmp_path / 'missing.parquet'}"), repr(done.stderr)
    assert done.stderr.count("\n") == 1


def test_stdout_closed_early_is_not_a_failure(tmp_path: Path) -> None:
    """`--log-json | head -1`: the run goes on (one warning on stderr); `--dry-run | true`: exit 0, as -o - | head."""
    def run(*args, lines: int):
        p = subprocess.Popen([sys.executable, "-m", "kevscore", "run", str(EXAMPLES / "demo-task.parquet"), "--device",
                              "cpu", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
        for _ in range(lines):
            p.stdout.readline()
        p.stdout.close()
        return p.wait(timeout=600), p.stderr.read()
    code, err = run("--window", "2", "-o", "p.parquet", "--log-json", lines=1)
    assert code == 0 and (tmp_path / "p.parquet").is_file(), err
    assert err == "warning: stdout was closed; the run goes on without its --log-json events\n", err
    for flags in ((), ("--log-json",)):
        code, err = run("-o", "q.parquet", "--dry-run", *flags, lines=0)
        assert code == 0 and "error" not in err, (flags, err)
