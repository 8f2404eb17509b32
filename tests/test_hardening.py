"""Hostile input and a faulty environment: every bad file, fault or interruption ends on one `error:` line
naming the file and the cause, exit status 2 (input, usage) or 1 (runtime fault), no traceback, no partial
or clobbered file, and an `error` event under --log-json. Runs are small (the example's 15 rows, the
shortest template) on the demo model."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kevscore import cli as cli_module
from kevscore import display, faults
from kevscore.cli import INTERRUPTED_RUN, app
from kevscore.engine.bank_dir import INDEX
from kevscore.engine.bank_entry import EntryError, read_header
from kevscore.job.options import RunOptions
from kevscore.job.parts import parts_dir
from kevscore.job.run import run_job

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ROOT = Path(__file__).resolve().parent.parent
cli = CliRunner()


# ---------------------------------------------------------------- helpers

def snapshot(directory: Path) -> dict[str, str]:
    """Every path under `directory`: a file's SHA-256, else its kind (a directory, a device, a pipe)."""
    out = {}
    for p in sorted(directory.rglob("*")):
        mode = p.lstat().st_mode
        out[str(p.relative_to(directory))] = (hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(mode)
                                              else stat.S_IFMT(mode))
    return out


def invoke(*args):
    return cli.invoke(app, [str(a) for a in args])


def one_error(result, code: int, parts: list[str]) -> str:
    """The run ended with `code`, one `error:` line on stderr holding every part, no traceback, and (under
    --log-json) the same message as the last event on stdout."""
    assert result.exit_code == code, (result.exit_code, result.stderr, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert all(line.startswith(("error: ", "warning: ")) for line in lines), result.stderr
    for part in parts:
        assert part in errors[0], (part, errors[0])
    events = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    if events:
        assert events[-1]["event"] == "error" and events[-1]["exit_code"] == code, events[-1]
        assert errors[0] == "error: " + events[-1]["message"], (errors[0], events[-1])
    return errors[0]


def refused(directory: Path, code: int, parts: list[str], *args) -> str:
    """`kevscore run ARGS --device cpu --log-json` fails on one line and leaves `directory` as it was."""
    before = snapshot(directory)
    line = one_error(invoke("run", *args, "--device", "cpu", "--log-json"), code, parts)
    assert snapshot(directory) == before
    return line


def put(path: Path, table: pa.Table) -> Path:
    pq.write_table(table, path)
    return path


def not_utf8(values: list, at: int, typ: pa.DataType = pa.string()) -> pa.Array:
    """`values` as a string (or list<string>) array whose value `at` holds bytes that are not UTF-8."""
    raw = [None if v is None else (v.encode() if isinstance(v, str) else [x.encode() for x in v]) for v in values]
    raw[at] = b"caf\xe9 \xff" if typ == pa.string() else [b"Y\xffs", b"No"]
    if typ == pa.string():
        return pa.array(raw, pa.binary()).view(pa.string())
    return pa.array(raw, pa.list_(pa.binary())).view(pa.list_(pa.string()))


@pytest.fixture
def src(tmp_path: Path) -> Path:
    shutil.copy(EXAMPLES / "questions.parquet", tmp_path / "q.parquet")
    return tmp_path / "q.parquet"


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "t.txt"
    path.write_text("{document}\n{question}")  # the shortest prompt: fast runs
    return path


@pytest.fixture(scope="module")
def scored(tmp_path_factory, template) -> Path:
    """The example scored with the short template in windows of two documents (three windows)."""
    d = tmp_path_factory.mktemp("scored")
    shutil.copy(EXAMPLES / "questions.parquet", d / "q.parquet")  # the input's name is part of the job
    run_job(RunOptions(input=d / "q.parquet", output=d / "out.parquet", device="cpu", template=template, window=2,
                       carry=True))  # as the CLI does
    return d / "out.parquet"


@pytest.fixture
def fault(monkeypatch: pytest.MonkeyPatch):
    """Arm a test hook of kevscore.faults (e.g. KEVSCORE_TEST_ENOSPC=manifest-write:2) for this test only."""
    def arm(name: str, spec: str) -> None:
        monkeypatch.setenv(name, spec)
        monkeypatch.setattr(faults, "_reached", Counter())
    return arm


# ---------------------------------------------------------------- 1: the output is never an input or a device

@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_output_that_is_not_a_regular_file_is_refused_even_with_overwrite(tmp_path, src, kind):
    target = tmp_path / "target"
    if kind == "fifo":
        os.mkfifo(target)
    else:
        try:
            os.mknod(target, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
        except PermissionError:
            pytest.skip("making a device needs root")
    refused(tmp_path, 2, [str(target), "not a regular file"], src, "-o", target, "--overwrite")


def test_output_that_is_the_template_is_refused(tmp_path, src, template):
    t = tmp_path / "template"  # no extension: an output's name kevscore would write (as Parquet)
    shutil.copy(template, t)
    refused(tmp_path, 2, [str(t), "is the input file"], src, "-o", t, "--overwrite", "--template", t)


def test_output_inside_the_model_or_bank_directory_is_refused(tmp_path, src):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    refused(tmp_path, 2, [str(model / "config.json"), "inside", str(model)], src, "-o", model / "config.json",
            "--overwrite", "--model", model)
    bank = tmp_path / "bank"
    bank.mkdir()
    refused(tmp_path, 2, [str(bank / INDEX), "inside", str(bank)], src, "-o", bank / INDEX, "--overwrite",
            "--bank", bank)


def test_errors_and_parts_siblings_obey_the_same_rules(tmp_path, src):
    os.mkfifo(tmp_path / "a.errors.parquet")
    refused(tmp_path, 2, [str(tmp_path / "a.errors.parquet"), "not a regular file"], src, "-o", tmp_path / "a.parquet",
            "--skip-invalid", "--overwrite")
    named = tmp_path / "b.errors.parquet"
    shutil.copy(src, named)
    refused(tmp_path, 2, [str(named), "is the input file"], named, "-o", tmp_path / "b.parquet", "--skip-invalid")
    (tmp_path / "c.parquet.parts").write_text("mine")
    refused(tmp_path, 2, [str(tmp_path / "c.parquet.parts"), "not a directory"], src, "-o", tmp_path / "c.parquet")
    inside = tmp_path / "d.parquet.parts"
    inside.mkdir()
    shutil.copy(src, inside / "q.parquet")
    refused(tmp_path, 2, [str(inside / "q.parquet"), "inside", str(inside)], inside / "q.parquet", "-o",
            tmp_path / "d.parquet")


# ---------------------------------------------------------------- 2: malformed bank entries

def bank_copy(bank: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of `bank` and the path of one of its entry files."""
    copy = tmp_path / "bank"
    shutil.copytree(bank, copy)
    return copy, sorted((copy / "entries").glob("*/*.safetensors"))[0]


def rewrite_header(path: Path, edit) -> None:
    """Replace an entry file's safetensors header by edit(header text), keeping its data."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    head = edit(data[8:8 + n].decode()).encode()
    path.write_bytes(len(head).to_bytes(8, "little") + head + data[8 + n:])


@pytest.fixture(scope="module")
def bank(tmp_path_factory, template) -> tuple[Path, Path]:
    """A bank of the example's six documents, one of whose doc ids holds a terminal escape code, and the
    output of the run that made it."""
    d = tmp_path_factory.mktemp("bank")
    table = pq.read_table(EXAMPLES / "questions.parquet")
    ids = [("\x1b[31mmarket" if v == "market" else v) for v in table.column("doc_id").to_pylist()]
    src = put(d / "q.parquet", table.set_column(0, "doc_id", pa.array(ids)))
    run_job(RunOptions(input=src, output=d / "out.parquet", device="cpu", template=template, bank=d / "bank"))
    return d / "bank", d / "out.parquet"


HEADERS = {"dtype-dict": lambda h: h.replace('"dtype":"F32"', '"dtype":{"x":1}', 1),
           "shape-1e400": lambda h: h.replace('"shape":[', '"shape":[1e400,', 1)}


@pytest.mark.parametrize("index", ["index", "no-index"])
@pytest.mark.parametrize("header", list(HEADERS))
def test_malformed_entry_header_is_a_warning_and_a_recompute(tmp_path, bank, template, header, index):
    root, out = bank
    copy, entry = bank_copy(root, tmp_path)
    rewrite_header(entry, HEADERS[header])
    if index == "no-index":
        (copy / INDEX).unlink()
    for args in ([], ["--verify"], ["--json"]):
        inspected = invoke("bank-inspect", copy, *args)
        assert inspected.exit_code == (1 if args == ["--verify"] else 0), (inspected.stderr, inspected.exception)
        assert inspected.exception is None or isinstance(inspected.exception, SystemExit), inspected.exception
        assert "malformed" in inspected.stdout or index == "no-index"
    result = invoke("run", out.parent / "q.parquet", "-o", tmp_path / "out.parquet", "--device", "cpu",
                    "--template", template, "--bank", copy)
    assert result.exit_code == 0, (result.stderr, result.exception)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings and all("malformed" in w or INDEX in w for w in warnings), result.stderr
    got, want = (pq.read_table(path).column("probs").to_pylist() for path in (tmp_path / "out.parquet", out))
    for g, w in zip(got, want):  # the recomputed entry was prefilled alone, not in the first run's pack
        assert g == pytest.approx(w, abs=1e-6)


def test_any_damage_to_an_entry_header_raises_entry_error_only(tmp_path, bank):
    """Random edits of a real header (values replaced by hostile ones, keys dropped, bytes flipped)."""
    import random

    _, entry = bank_copy(bank[0], tmp_path)
    data = entry.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    hostile = [{}, [], None, -1, 2 ** 70, "x", True, 1.5, [[[]]], {"a": [1]}, "1e400", [0, -5], ["F32"]]
    rng = random.Random(0)

    def mutate(node, depth=0):
        if isinstance(node, dict) and node and rng.random() < 0.8:
            key = rng.choice(sorted(node))
            if rng.random() < 0.15:
                del node[key]
            elif depth < 3 and rng.random() < 0.6:
                mutate(node[key], depth + 1)
            else:
                node[key] = rng.choice(hostile)
        elif isinstance(node, list) and node:
            node[rng.randrange(len(node))] = rng.choice(hostile)

    for i in range(300):
        h = json.loads(json.dumps(header))
        for _ in range(rng.randint(1, 3)):
            mutate(h)
        text = json.dumps(h).replace('"1e400"', "1e400").encode()
        if i % 5 == 0:  # flip bytes of the header itself
            text = bytearray(text)
            for _ in range(3):
                text[rng.randrange(len(text))] = rng.randrange(256)
            text = bytes(text)
        entry.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])
        try:
            read_header(entry)
        except EntryError:
            pass


def test_bank_inspect_escapes_control_characters_in_doc_ids(bank):
    shown = invoke("bank-inspect", bank[0])
    assert shown.exit_code == 0 and "\x1b" not in shown.stdout and "\\x1b[31mmarket" in shown.stdout


# ---------------------------------------------------------------- 3: disk full, directory gone

@pytest.mark.parametrize("point, what", [("manifest-write:1", "manifest.json"), ("part-write:1", "part-000000"),
                                         ("manifest-write:2", "manifest.json"), ("merge:1", "out.parquet")])
def test_disk_full_is_one_line_and_keeps_what_was_completed(tmp_path, src, template, scored, fault, point, what):
    fault("KEVSCORE_TEST_ENOSPC", point)
    out = tmp_path / "out.parquet"
    result = invoke("run", src, "-o", out, "--device", "cpu", "--template", template, "--window", 2, "--log-json")
    one_error(result, 1, [what, "No space left on device"])
    parts = sorted(p.name for p in parts_dir(out).iterdir()) if parts_dir(out).exists() else []
    kept = {"manifest-write:1": 0, "part-write:1": 0, "manifest-write:2": 1, "merge:1": 3}[point]
    assert not out.exists() and len([p for p in parts if p.startswith("part-")]) == kept
    assert not any(p.endswith(".tmp") for p in parts) and (kept or not parts)  # nothing left when nothing was kept
    rerun = invoke("run", src, "-o", out, "--device", "cpu", "--template", template, "--window", 2)
    assert rerun.exit_code == 0, rerun.stderr  # the hook fired once: the disk has room again
    assert out.read_bytes() == scored.read_bytes()


def test_output_directory_removed_mid_run(tmp_path, src, template, monkeypatch):
    where = tmp_path / "outdir"
    where.mkdir()
    point = faults.point

    def remove_at_part_done(name: str) -> None:
        if name == "part-done":
            shutil.rmtree(where)
        point(name)

    monkeypatch.setattr(faults, "point", remove_at_part_done)
    result = invoke("run", src, "-o", where / "out.parquet", "--device", "cpu", "--template", template, "--log-json")
    one_error(result, 1, [str(parts_dir(where / "out.parquet") / "manifest.json"), "No such file or directory"])
    assert not where.exists()


# ---------------------------------------------------------------- 4-6: undecodable and ambiguous input

@pytest.mark.parametrize("column", ["document", "question", "doc_id", "question_id", "labels"])
def test_invalid_utf8_in_a_column(tmp_path, example_rows, column):
    table = pa.Table.from_pylist([{**r, "labels": ["Yes", "No"]} for r in example_rows])
    values = table.column(column).to_pylist()
    typ = pa.list_(pa.string()) if column == "labels" else pa.string()
    table = table.set_column(table.schema.get_field_index(column), column, not_utf8(values, 3, typ))
    path = put(tmp_path / "in.parquet", table)
    refused(tmp_path, 2, [str(path), f"column {column!r}", "not valid UTF-8", "row 3"], path)


def test_invalid_utf8_in_a_csv_names_its_column_and_row(tmp_path, example_rows):
    """The CSV reader's own check would name only the column's number: the scan names the column and the row."""
    quoted = [[r[c].replace('"', '""') for c in ("document", "question")] for r in example_rows[:4]]
    lines = [f'"{doc}","{question}"'.encode() for doc, question in quoted]
    lines[2] = lines[2][:-1] + b'\xff"'  # in the question's text
    path = tmp_path / "in.csv"
    path.write_bytes(b"\n".join([b"document,question", *lines, b""]))
    refused(tmp_path, 2, [str(path), "column 'question'", "not valid UTF-8", "row 2"], path)


def test_invalid_utf8_in_the_documents_file(tmp_path):
    shutil.copytree(EXAMPLES / "two-file", tmp_path / "two")
    docs = pq.read_table(tmp_path / "two" / "documents.parquet")
    bad = docs.set_column(docs.schema.get_field_index("document"), "document",
                          not_utf8(docs.column("document").to_pylist(), 1))
    path = put(tmp_path / "two" / "documents.parquet", bad)
    refused(tmp_path, 2, [str(path), "column 'document'", "not valid UTF-8", "row 1"],
            tmp_path / "two" / "questions.parquet", "--documents", path)


def test_invalid_utf8_in_a_carried_column_is_found_before_any_work(tmp_path, example_rows, template):
    """A column only carried into the output (here text inside a list) is checked with the input, not at the merge
    after all the scoring; --no-carry does not read it."""
    table = pa.Table.from_pylist(example_rows).append_column("note", pa.array(["n"] * len(example_rows)))
    path = put(tmp_path / "in.parquet", table.append_column("tags", not_utf8([["a"]] * len(example_rows), 4,
                                                                             pa.list_(pa.string()))))
    refused(tmp_path, 2, [str(path), "column 'tags'", "not valid UTF-8", "row 4"], path, "--template", template)
    result = invoke("run", path, "--device", "cpu", "--template", template, "--quiet", "--no-carry")
    assert result.exit_code == 0 and (tmp_path / "in.scores.parquet").exists(), result.stderr


def test_output_names_too_long_for_what_is_written_beside_them(tmp_path, src, template):
    """A name that fits, though its parts directory's and temporary files' names are longer, is written; one whose
    own, parts directory's or errors file's name would pass 255 bytes is refused on one line before any work."""
    fits = tmp_path / ("x" * 241 + ".parquet")  # 249 bytes: its parts directory's name is 255
    result = invoke("run", src, "-o", fits, "--device", "cpu", "--template", template, "--quiet")
    assert result.exit_code == 0 and sorted(os.listdir(tmp_path)) == sorted(["q.parquet", fits.name]), result.stderr
    for name, args, words in [("y" * 242 + ".parquet", (), "the name of its parts directory would be 256 bytes"),
                              ("y" * 248 + ".parquet", (), "its name would be 256 bytes long"),
                              ("é" * 130, (), "its name would be 260 bytes long"),
                              (fits.name, ("--skip-invalid", "--overwrite"), "errors.parquet: its name would be 256")]:
        refused(tmp_path, 2, [words, "choose a shorter --output"], src, "-o", tmp_path / name, "--template",
                template, *args)


def test_template_that_is_not_utf8(tmp_path, src):
    t = tmp_path / "t.txt"
    t.write_bytes(b"{document}\n\xff{question}")
    refused(tmp_path, 2, [str(t), "not UTF-8", "0xff", "offset 11"], src, "--template", t)


def test_duplicate_column_names(tmp_path, example_rows):
    cols = [pa.array([r[c] for r in example_rows]) for c in ("document", "question", "question")]
    path = put(tmp_path / "in.parquet", pa.Table.from_arrays(cols, names=["document", "question", "question"]))
    refused(tmp_path, 2, [str(path), "'question'", "more than once"], path)


# ---------------------------------------------------------------- 8: interruptions, reruns

def test_ctrl_c_while_starting_ends_on_one_line(tmp_path, src):
    """SIGINT at moments through start-up (imports, model load): exit 130, one line, nothing written."""
    code = ("import sys; from kevscore.__main__ import main; sys.argv = ['kevscore'] + sys.argv[1:]; "
            "print('go', flush=True); main()")
    for delay in (0.05, 0.2, 0.4, 0.8):
        proc = subprocess.Popen([sys.executable, "-c", code, "run", str(src), "--device", "cpu"], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "go\n"
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130 and "Traceback" not in err, (delay, err)
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: interrupted"), (delay, err)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["q.parquet"]


def test_sigterm_outside_the_scoring_ends_on_one_line(tmp_path, src):
    """A scheduler's SIGTERM where no stop is awaited (here in the merge) ends the run as Ctrl-C does: exit 130,
    one line, the input's temporary copy removed, the windows kept for the rerun."""
    (tmp_path / "tmp").mkdir()
    (tmp_path / "marks").mkdir()
    pq.write_table(pq.read_table(src), tmp_path / "q.parquet")
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"), KEVSCORE_TEST_MARKS=str(tmp_path / "marks"),
               KEVSCORE_TEST_PAUSE="merge")
    # --limit: the input read through a temporary copy
    args = [sys.executable, "-m", "kevscore", "run", str(tmp_path / "q.parquet"), "--device", "cpu", "--limit", "40",
            "-o", str(tmp_path / "out.parquet"), "--quiet"]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "marks" / "merge").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.strip().splitlines() == [f"error: {INTERRUPTED_RUN}"], err
    assert list((tmp_path / "tmp").iterdir()) == [] and parts_dir(tmp_path / "out.parquet").is_dir()
    resumed = subprocess.run(args, cwd=ROOT, env=dict(env, KEVSCORE_TEST_PAUSE=""), capture_output=True, text=True)
    assert resumed.returncode == 0 and "resuming: 1 of 1 windows" in resumed.stderr, resumed.stderr
    assert pq.read_table(tmp_path / "out.parquet").num_rows == pq.read_table(src).num_rows


# `kevscore --version` with something left for the interpreter's exit: a thread it waits for (until a line on
# stdin), or an object whose finalizer runs in the teardown after Python put back the OS's signal actions
ENDING = """import os, sys, threading, time
from kevscore.__main__ import main
class Slow:
    def __del__(self, write=os.write, sleep=time.sleep):
        write(1, b"teardown\\n")
        sleep(1)
slow = Slow()
if sys.argv[1] == "thread":
    threading.Thread(target=sys.stdin.readline).start()
sys.argv = ["kevscore", "--version"]
main()"""


@pytest.mark.parametrize("waiting", ["thread", "teardown"])
def test_sigterm_after_the_command_ended_keeps_its_status(waiting):
    """A SIGTERM once the command has ended (its output printed), while the interpreter exits: the process ends
    with the command's status, no traceback, not killed by the signal (143)."""
    proc = subprocess.Popen([sys.executable, "-c", ENDING, waiting], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("kevscore ")
    if waiting == "teardown":
        assert proc.stdout.readline() == "teardown\n"
    else:
        time.sleep(0.3)  # the exit is waiting for the thread
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and err == "", (proc.returncode, err)


def test_an_interrupt_outside_a_commands_own_handling_is_one_line(monkeypatch):
    """Ctrl-C (or SIGTERM) while a command prints its result: one line, exit status 130 (typer would end silently)."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_module, "inspect_bank", lambda *args: {"bad_entries": []})
    monkeypatch.setattr(display, "print_inspect", interrupted)
    one_error(invoke("bank-inspect", "DIR"), 130, ["interrupted"])


def test_rerun_of_a_finished_job_is_already_complete(tmp_path, src, template):
    out = tmp_path / "out.parquet"
    args = ["run", src, "-o", out, "--device", "cpu", "--template", template]
    assert invoke(*args).exit_code == 0
    before = (out.read_bytes(), out.stat().st_mtime_ns)
    again = invoke(*args)
    assert again.exit_code == 0 and "already complete" in again.stderr, again.stderr
    logged = invoke(*args, "--log-json")
    assert logged.exit_code == 0 and json.loads(logged.stdout.splitlines()[-1])["already_complete"] is True
    assert (out.read_bytes(), out.stat().st_mtime_ns) == before
    other = invoke(*args, "--batch-rows", 8, "--log-json")
    one_error(other, 2, [str(out), "already exists", "another job", "--overwrite"])
    assert (out.read_bytes(), out.stat().st_mtime_ns) == before


def test_labels_holding_little_mass_are_warned_about(tmp_path, src):
    """' Yes' and 'yes' are single tokens of the demo tokenizer, but not how it answers: a warning, not silence."""
    result = invoke("run", src, "-o", tmp_path / "a.parquet", "--device", "cpu", "--labels", '" Yes",yes', "--log-json")
    assert result.exit_code == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    warned = [e["message"] for e in events if e["event"] == "warning"]
    assert len(warned) == 1 and "less than 10% of the model's probability on 15 of 15 rows" in warned[0], warned
    assert "' Yes', 'yes'" in warned[0] and warned[0] in result.stderr
    plain = invoke("run", src, "-o", tmp_path / "b.parquet", "--device", "cpu", "--log-json")
    assert plain.exit_code == 0 and '"warning"' not in plain.stdout and "warning" not in plain.stderr


# ---------------------------------------------------------------- 9: --batch-invariant across thread counts

def test_batch_invariant_results_do_not_depend_on_the_thread_count(tmp_path, src, template):
    """A torchrun rank runs with OMP_NUM_THREADS=1, a plain run with every core: under --batch-invariant the
    CPU job scores with one thread whatever the setting, so the bits agree (and the setting is restored)."""
    import torch

    from kevscore.engine.pipeline import Reporter

    seen = []

    class Threads(Reporter):
        def event(self, name: str, **fields) -> None:
            if name == "start":
                seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    outputs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = tmp_path / f"out{n}.parquet"
            run_job(RunOptions(input=src, output=out, device="cpu", template=template, batch_invariant=True),
                    Threads())
            assert torch.get_num_threads() == n
            outputs.append(out.read_bytes())
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 1, 1] and outputs[0] == outputs[1] == outputs[2]


def test_a_gpu_job_runs_torch_cpu_ops_on_one_thread_and_restores_the_count():
    """On a GPU the job's host ops run on one intra-op thread (no pool waiting for the tokenizer's cores); the
    process's count is back afterwards, and a CPU job without --batch-invariant keeps it."""
    import torch

    from kevscore.engine.backend import job_threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with job_threads(torch.device("cuda"), False):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with job_threads(torch.device("cpu"), False):
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- random mutations: scored, or one clean error

def _pick(table: pa.Table, rng, names=None) -> tuple[int, str, pa.DataType] | None:
    """A random column (index, name, type), among `names` when given; None when there is none."""
    found = [i for i, n in enumerate(table.column_names) if names is None or n in names]
    if not found:
        return None
    i = rng.choice(found)
    return i, table.column_names[i], table.schema.field(i).type


def _retype(table: pa.Table, rng) -> pa.Table:
    i, name, typ = _pick(table, rng)
    n = table.num_rows
    new = rng.choice([pa.array(range(n), pa.int64()), pa.array([0.5] * n), pa.array([b"x"] * n, pa.binary()),
                      pa.array([["a"]] * n, pa.list_(pa.string())), pa.array([{"a": 1}] * n),
                      table.column(i).cast(pa.large_string()) if pa.types.is_string(typ) else pa.array([True] * n)])
    return table.set_column(i, name, new)


def _nulls(table: pa.Table, rng) -> pa.Table:
    i, name, typ = _pick(table, rng)
    values = table.column(i).to_pylist()
    for r in rng.sample(range(len(values)), k=min(len(values), rng.randint(1, 2))):
        values[r] = None
    return table.set_column(i, name, pa.array(values, typ))


def _bad_bytes(table: pa.Table, rng) -> pa.Table:
    strings = [n for n, t in zip(table.column_names, table.schema.types) if pa.types.is_string(t)]
    picked = _pick(table, rng, strings)
    if picked is None or not table.num_rows:
        return table
    i, name, _ = picked
    return table.set_column(i, name, not_utf8(table.column(i).to_pylist(), rng.randrange(table.num_rows)))


def _duplicate_name(table: pa.Table, rng) -> pa.Table:
    i, name, typ = _pick(table, rng)
    return table.append_column(pa.field(name, typ), table.column(i))


def _drop(table: pa.Table, rng) -> pa.Table:
    return table.remove_column(_pick(table, rng)[0])


def _rename(table: pa.Table, rng) -> pa.Table:
    i = _pick(table, rng)[0]
    return table.rename_columns([c.upper() if k == i else c for k, c in enumerate(table.column_names)])


def _empty(table: pa.Table, rng) -> pa.Table:
    return table.slice(0, 0)


def _huge(table: pa.Table, rng) -> pa.Table:
    picked = _pick(table, rng, ["document", "question"])
    if picked is None or not pa.types.is_string(picked[2]) or not table.num_rows:
        return table
    i, name, _ = picked
    values = table.column(i).to_pylist()
    values[0] = ("word " * 6000) if values[0] is None else values[0] * 60  # far over the model's positions
    return table.set_column(i, name, pa.array(values, pa.string()))


def _labels(table: pa.Table, rng) -> pa.Table:
    pick = [["Yes", "No"], [], None, ["Yes", "Yes"], ["Yes", None], ["Maybe so", "No"], ["No", "Yes", "A"]]
    values = [rng.choice(pick) for _ in range(table.num_rows)]
    return table.append_column("labels", pa.array(values, pa.list_(pa.string())))


def _same_id_other_text(table: pa.Table, rng) -> pa.Table:
    picked = _pick(table, rng, ["doc_id"])
    if picked is None or table.num_rows < 2:
        return table
    i, name, typ = picked
    ids = table.column(i).to_pylist()
    ids[-1] = ids[0]
    return table.set_column(i, name, pa.array(ids, typ))


MUTATIONS = [_retype, _nulls, _bad_bytes, _duplicate_name, _drop, _rename, _empty, _huge, _labels,
             _same_id_other_text]


def test_random_mutations_of_the_input_score_or_fail_on_one_line(tmp_path, template):
    """Random schema and value mutations of the example's first rows, one to three at a time: each run either
    scores every row (or, with --skip-invalid, sets rows aside) or stops on one clean line with nothing written."""
    import random

    base = pq.read_table(EXAMPLES / "questions.parquet").slice(0, 5)
    rng = random.Random(18)
    outcomes = Counter()
    for case in range(30):
        table = base
        for mutation in rng.sample(MUTATIONS, k=rng.randint(1, 3)):
            table = mutation(table, rng)
        d = tmp_path / f"case{case}"
        d.mkdir()
        src = put(d / "in.parquet", table)
        skip = ["--skip-invalid"] if case % 3 == 0 else []
        before = snapshot(d)
        result = invoke("run", src, "--device", "cpu", "--template", template, "--log-json", *skip)
        if result.exit_code == 0:
            out = pq.read_table(d / "in.scores.parquet")
            aside = pq.read_table(d / "in.scores.errors.parquet").num_rows if skip else 0
            assert out.num_rows + aside == table.num_rows, (case, table.schema)
            outcomes["scored"] += 1
        else:
            one_error(result, result.exit_code, [])
            assert result.exit_code in (1, 2) and snapshot(d) == before, (case, result.stderr)
            outcomes[result.exit_code] += 1
    print(dict(outcomes))
    assert outcomes["scored"] >= 3 and outcomes[2] >= 10, outcomes
