"""Two ranks on the CPU (gloo), launched by torch's launcher, against one process."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kevscore.job.options import RunOptions
from kevscore.job.parts import MANIFEST, parts_dir
from kevscore.job.run import run_job

EXAMPLES = Path(__file__).parent.parent / "examples"

LOST = r"another rank stopped \((Read error: )?Connection (closed|reset) by peer\)"  # gloo's reasons, places cut


def launch(*args, torchrun=True, cwd=None, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "kevscore",
           "run", *args] if torchrun else [sys.executable, "-m", "kevscore", "run", "--gpus", "2", *args]
    # the launcher stops the other ranks 1 s after one ends (not 0.1 s): time for their last line
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd, env={
        **__import__("os").environ, "OMP_NUM_THREADS": "1", "PET_MONITOR_INTERVAL": "1", **(env or {})})


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "single.parquet"
    run_job(RunOptions(input=EXAMPLES / "questions.parquet", output=out, device="cpu", batch_invariant=True))
    return pq.read_table(out)


def test_torchrun_two_ranks_equal_one_process(tmp_path, single):
    shutil.copy(EXAMPLES / "questions.parquet", tmp_path / "q.parquet")
    out = tmp_path / "out.parquet"
    res = launch(str(tmp_path / "q.parquet"), "--device", "cpu", "--batch-invariant", "-o", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert pq.read_table(out).equals(single)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.parquet", "q.parquet"]  # parts merged and removed
    assert "2 ranks" in res.stderr and "scored" in res.stderr


def test_failed_rank_fails_the_job_and_a_rerun_reuses_the_completed_part(tmp_path, single):
    shutil.copy(EXAMPLES / "questions.parquet", tmp_path / "q.parquet")
    out = tmp_path / "out.parquet"
    parts = parts_dir(out)
    parts.mkdir()
    blocker = parts / "part-000001.parquet"  # the one window of rank 1 (rank 0's windows come first)
    blocker.mkdir()  # rank 1 cannot write its part
    args = (str(tmp_path / "q.parquet"), "--device", "cpu", "--batch-invariant", "-o", str(out))
    res = launch(*args, torchrun=False)
    assert res.returncode != 0
    assert "rank 1 failed" in res.stderr and "is a directory" in res.stderr.lower()
    assert not out.exists()
    done = parts / "part-000000.parquet"  # rank 0's window, in the one shared store and its one manifest
    assert done.is_file() and 0 < pq.read_metadata(done).num_rows < single.num_rows
    assert json.loads((parts / MANIFEST).read_text())["identity"]["options"]["ranks"] == 2
    blocker.rmdir()
    res = launch(*args, torchrun=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count("reused") == 1 and res.stderr.count("scored") == 1  # rank 0 reused, rank 1 scored
    assert pq.read_table(out).equals(single)
    assert not parts.exists()


def test_ranks_share_one_persistent_bank(tmp_path):
    shutil.copy(EXAMPLES / "questions.parquet", tmp_path / "q.parquet")
    bank = tmp_path / "bank"
    for name in ("a", "b"):
        res = launch(str(tmp_path / "q.parquet"), "--device", "cpu", "--bank", str(bank), "-o",
                     str(tmp_path / f"{name}.parquet"))
        assert res.returncode == 0, res.stderr[-3000:]
    a, b = (pq.read_table(tmp_path / f"{n}.parquet") for n in "ab")
    assert a.column("probs").to_pylist() == b.column("probs").to_pylist()
    check = subprocess.run([sys.executable, "-m", "kevscore", "bank-inspect", str(bank), "--verify", "--json"],
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr
    report = json.loads(check.stdout)
    docs = len(set(pq.read_table(EXAMPLES / "questions.parquet").column("doc_id").to_pylist()))
    assert report["totals"]["entries"] == docs and not report["bad_entries"]


def test_skip_invalid_merges_the_ranks_errors(tmp_path, single):
    """Rows set aside (rank 0) and the rows of both ranks' documents: one errors file, one output, no parts."""
    import pyarrow as pa

    rows = pq.read_table(EXAMPLES / "questions.parquet").to_pylist()
    rows[1]["question"] = None
    rows[4]["document"] = "The market was busy and loud. " * 800  # over the demo model's 4096 positions
    rows[4]["doc_id"] = "long"
    src = tmp_path / "q.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    out = tmp_path / "out.parquet"
    res = launch(str(src), "--device", "cpu", "--batch-invariant", "--skip-invalid", "-o", str(out), "--log-json")
    assert res.returncode == 0, res.stderr[-3000:]
    done = json.loads(res.stdout.splitlines()[-1])  # --log-json: rank 0's `done` line, the ranks within it
    assert done["event"] == "done" and done["rows"] == len(rows) - 2 and len(done["ranks"]) == 2, res.stdout
    errors = pq.read_table(tmp_path / "out.errors.parquet").to_pylist()
    assert [e["row"] for e in errors] == [1, 4]
    assert "null" in errors[0]["reason"] and "positions" in errors[1]["reason"]
    scored = pq.read_table(out)
    keep = [r for r in range(len(rows)) if r not in (1, 4)]
    assert scored.column("row").to_pylist() == keep
    assert scored.column("probs").to_pylist() == [single.column("probs")[r].as_py() for r in keep]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.errors.parquet", "out.parquet", "q.parquet"]


def test_an_interrupted_launch_is_an_interrupt(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM reaches torch's launcher as its SignalException: exit 130, not a failed job."""
    import signal

    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from typer.testing import CliRunner

    from kevscore.cli import app

    def stopped(args):
        raise SignalException("Process 1 got signal: 2", signal.SIGINT)

    monkeypatch.setattr(torch.distributed.run, "main", stopped)
    res = CliRunner().invoke(app, ["run", str(EXAMPLES / "questions.parquet"), "--gpus", "2", "--device", "cpu", "-o",
                                   str(tmp_path / "out.parquet")])
    assert res.exit_code == 130 and res.stderr.strip() == \
        "error: interrupted (SIGINT); the ranks' lines above say what was kept", res.stderr


def test_launch_refuses_before_starting_ranks(tmp_path, monkeypatch):
    """--gpus N makes a one-process run's checks before torch's launcher starts any rank: one line, exit 2."""
    import torch
    import torch.distributed.run
    from typer.testing import CliRunner

    from kevscore.cli import app

    monkeypatch.setattr(torch.distributed.run, "main", lambda args: pytest.fail("ranks launched"))
    out = str(tmp_path / "g.parquet")
    for args, said in ((["nonexist.parquet"], "nonexist.parquet: no such file"),
                       ([str(EXAMPLES / "questions.parquet"), "--labels", "Yes"], "give at least two labels")):
        res = CliRunner().invoke(app, ["run", *args, "-o", out, "--gpus", "2", "--device", "cpu"])
        assert res.exit_code == 2 and res.stderr.count("\n") == 1 and said in res.stderr, res.stderr
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    res = CliRunner().invoke(app, ["run", str(EXAMPLES / "questions.parquet"), "-o", out, "--gpus", "2",
                                   "--device", "cuda"])
    assert res.exit_code == 2 and res.stderr.strip() == "error: --gpus 2: this machine has 1 CUDA GPU(s)", res.stderr
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # --device auto: GPUs wanted, not CPU processes
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    res = CliRunner().invoke(app, ["run", str(EXAMPLES / "questions.parquet"), "-o", out, "--gpus", "2"])
    assert res.exit_code == 2 and res.stderr.strip() == "error: --gpus 2: this machine has 0 CUDA GPU(s) " \
        "(--device cpu runs the ranks on the CPU)", res.stderr


def test_a_rank_interrupted_once_the_output_is_whole_says_so(tmp_path, monkeypatch, capsys):
    """Ctrl-C on rank 0 after the job (its table being drawn): the output is whole, not 'no output was written'."""
    from types import SimpleNamespace

    from kevscore import cli, display

    def interrupted(result):
        raise KeyboardInterrupt

    class Exited(Exception):
        pass

    def leave(code):
        raise Exited(code)

    monkeypatch.setattr(cli, "world_from_env", lambda: (0, 2, 0))
    monkeypatch.setattr(cli, "run_distributed", lambda opts: SimpleNamespace(output=tmp_path / "out.parquet"))
    monkeypatch.setattr(display, "ranks_table", interrupted)
    monkeypatch.setattr(cli.os, "_exit", leave)
    with pytest.raises(Exited) as exited:
        cli._run_rank(RunOptions(input=tmp_path / "in.parquet"), quiet=False, log_json=False)
    err = capsys.readouterr().err
    assert exited.value.args == (130,) and "interrupted after the output was complete" in err, err
    assert "no output was written" not in err
    monkeypatch.setattr(cli, "world_from_env", lambda: (1, 2, 1))  # another rank's interrupt: its line names it
    monkeypatch.setattr(cli, "run_distributed", lambda opts: interrupted(None))
    with pytest.raises(Exited) as exited:
        cli._run_rank(RunOptions(input=tmp_path / "in.parquet"), quiet=False, log_json=False)
    err = capsys.readouterr().err
    assert exited.value.args == (130,) and err.startswith("error: rank 1: interrupted"), err


def test_a_rank_interrupted_after_the_merge_is_in_place_says_the_output_is_whole(tmp_path, single):
    """Ctrl-C on rank 0 once its merge is renamed into place, its parts not yet removed: the output is whole."""
    shutil.copy(EXAMPLES / "questions.parquet", tmp_path / "q.parquet")
    out = tmp_path / "out.parquet"
    res = launch(str(tmp_path / "q.parquet"), "--device", "cpu", "--batch-invariant", "-o", str(out),
                 env={"KEVSCORE_TEST_SIGINT": "merged"})  # a point rank 0 alone reaches
    assert res.returncode != 0 and f"error: interrupted after the output was complete: {out} is whole; " \
        f"{parts_dir(out)} is left over and can be deleted\n" in res.stderr, res.stderr[-3000:]
    assert "no output was written" not in res.stderr and "bug in kevscore" not in res.stderr
    # rank 1, waiting for rank 0's merge: gloo's reason, the connection closed or reset
    assert re.search(r"error: rank 1: " + LOST, res.stderr), res.stderr
    assert f") after the output was complete: {out} is whole; {parts_dir(out)} is left over" in res.stderr
    assert pq.read_table(out).equals(single)


def test_a_rank_interrupted_while_the_ranks_disconnect_says_the_output_is_whole(tmp_path, monkeypatch, single):
    """Ctrl-C on a rank after every rank's job ended (the process group being torn down): the output is whole."""
    import socket

    from kevscore.job import distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    destroy = distributed.dist.destroy_process_group

    def interrupted():
        destroy()
        raise KeyboardInterrupt

    monkeypatch.setattr(distributed.dist, "destroy_process_group", interrupted)
    out = tmp_path / "out.parquet"
    shutil.copy(EXAMPLES / "questions.parquet", tmp_path / "q.parquet")
    with pytest.raises(KeyboardInterrupt) as stopped:  # an Interrupted, saying what is kept
        distributed.run_distributed(RunOptions(input=tmp_path / "q.parquet", output=out, device="cpu",
                                               batch_invariant=True))
    assert str(stopped.value) == f"interrupted after the output was complete: {out} is whole; there is nothing to rerun"
    assert pq.read_table(out).equals(single) and not parts_dir(out).exists()


def test_ranks_do_not_check_columns_they_do_not_carry(tmp_path, single):
    """The ranks' output carries none of the input's other columns: text there that is not UTF-8 stops no rank."""
    import pyarrow as pa

    table = pq.read_table(EXAMPLES / "questions.parquet")
    tags = pa.array([b"a"] * (table.num_rows - 1) + [b"caf\xe9"], pa.binary()).view(pa.string())
    pq.write_table(table.append_column("tags", tags), tmp_path / "q.parquet")
    out = tmp_path / "out.parquet"
    res = launch(str(tmp_path / "q.parquet"), "--device", "cpu", "--batch-invariant", "-o", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert pq.read_table(out).equals(single)


def test_a_killed_rank_fails_the_others_on_one_line_and_a_rerun_resumes(tmp_path, single):
    """SIGKILL to rank 1 inside its part's write: rank 0, waiting for it, says so (no 'bug' line), its part is kept;
    the rerun removes the half-written file, reuses rank 0's part and scores rank 1's."""
    shutil.copy(EXAMPLES / "questions.parquet", tmp_path / "q.parquet")
    out = tmp_path / "out.parquet"
    args = (str(tmp_path / "q.parquet"), "--device", "cpu", "--batch-invariant", "-o", str(out))
    res = launch(*args, env={"KEVSCORE_TEST_KILL": "part-write@1"})
    assert res.returncode != 0 and "bug in kevscore" not in res.stderr, res.stderr[-3000:]
    # rank 0's line, with gloo's reason: the connection closed or reset, as the kill meets its read
    assert re.match(r"error: " + LOST, res.stderr), res.stderr[-3000:]
    assert "; no output was written (completed parts are kept and reused by a rerun)\n" in res.stderr
    assert not out.exists() and (parts_dir(out) / "part-000000.parquet").is_file()
    assert [p for p in parts_dir(out).iterdir() if p.name.endswith(".tmp")]  # rank 1's write, cut off
    res = launch(*args)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count("reused") == 1 and res.stderr.count("scored") == 1
    assert pq.read_table(out).equals(single) and not parts_dir(out).exists()


def test_an_input_error_of_every_rank_is_one_error_exit_2(tmp_path):
    """Every rank refuses the same bad row: one error naming the ranks once, an `error` event with --log-json,
    and --gpus exits 2 (an input error), as a one-process run does."""
    import pyarrow as pa

    rows = pq.read_table(EXAMPLES / "questions.parquet").to_pylist()
    for row in rows:
        row["labels"] = '["Yes", "No"]'
    rows[-1]["labels"] = '["Yes"'
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "q.parquet")
    res = launch("q.parquet", "--device", "cpu", "-o", "out.parquet", "--log-json", torchrun=False, cwd=tmp_path)
    said = "ranks 0, 1 failed: q.parquet: column 'labels' (string) has text that is no JSON array of strings at row 14"
    assert res.returncode == 2 and f"error: {said}; no output was written" in res.stderr, res.stderr[-3000:]
    event = json.loads(res.stdout.splitlines()[-1])
    assert event["event"] == "error" and event["exit_code"] == 2 and said in event["message"], res.stdout


def test_a_failed_step_names_each_error_once_with_its_exit_status(monkeypatch, capsys):
    """A step's failures, gathered from every rank: each error once with its ranks; exit 2 only when every one is
    an input error; a rank's bug said to be one (its traceback with KEVSCORE_TRACEBACK=1)."""
    from kevscore.errors import KevscoreError
    from kevscore.job.distributed import Ranks

    monkeypatch.setattr(Ranks, "gather", lambda self, error: [error, error, None])  # rank 1 failed alike, 2 did not

    def failing(exc):
        with pytest.raises(KevscoreError) as failed:
            Ranks(0, 3).step(lambda: (_ for _ in ()).throw(exc))
        return failed.value

    bad = failing(KevscoreError("q.parquet: row 3 is bad"))
    assert bad.exit_code == 2 and str(bad) == "ranks 0, 1 failed: q.parquet: row 3 is bad; no output was written " \
        "(completed parts are kept and reused by a rerun)"
    disk = failing(IsADirectoryError(21, "Is a directory", "part-000001.parquet"))
    assert disk.exit_code == 1 and str(disk).startswith("ranks 0, 1 failed: part-000001.parquet: Is a directory;")
    monkeypatch.setenv("KEVSCORE_TRACEBACK", "1")
    bug = failing(ValueError("oops"))
    assert bug.exit_code == 1 and "failed: internal error, a bug in kevscore: ValueError: oops" in str(bug)
    assert "Traceback" in capsys.readouterr().err


def test_a_torchrun_environment_set_by_hand_is_one_line(tmp_path):
    """WORLD_SIZE without RANK (another launcher's, or set by hand): exit 2 before anything runs; a rank whose
    launcher address is unset: it cannot join, exit 1; neither a traceback nor a 'bug' line."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    args = [sys.executable, "-m", "kevscore", "run", str(EXAMPLES / "questions.parquet"), "--device", "cpu", "-o",
            str(tmp_path / "out.parquet")]
    for extra, code, said in (({"WORLD_SIZE": "2"}, 2, "error: WORLD_SIZE=2, RANK=(unset): not the environment of a "
                                "torchrun rank; launch with torchrun or --gpus N"),
                              ({"WORLD_SIZE": "2", "RANK": "0"}, 1, "error: rank 0 of 2 could not join the job: "
                               "Error initializing torch.distributed using env:// rendezvous: environment variable "
                               "MASTER_ADDR expected, but not set")):
        res = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**env, **extra})
        assert res.returncode == code and res.stderr.strip() == said, res.stderr[-3000:]


def test_more_ranks_on_a_machine_than_its_gpus_is_refused(monkeypatch):
    """Two ranks on one GPU would share its memory: a local rank past the machine's GPUs is one line, before the
    job starts."""
    import torch

    from kevscore.errors import KevscoreError
    from kevscore.job import distributed
    from kevscore.job.distributed import Ranks

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    started = []
    monkeypatch.setattr(distributed, "start_job", lambda *args: started.append(args))
    opts = RunOptions(input=Path("q.parquet"), model="demo", device="cuda")
    distributed._start(opts, None, Ranks(1, 3, local=1))
    with pytest.raises(KevscoreError, match=r"^local rank 2: this machine has 2 CUDA GPU\(s\); launch at most 2 "):
        distributed._start(opts, None, Ranks(2, 3, local=2))
    assert len(started) == 1
