"""One job on 1 GPU against the same job on N GPUs of one machine (torch's launcher), Kev-4B shape.
Prints a table and writes JSON.

    python benchmarks/bench_scaling.py --model kev-4b --gpus 2 --docs 3000 \
        --json benchmarks/results/scaling-kev-4b-h200x2.json
    python benchmarks/bench_scaling.py --model demo --device cpu --gpus 2 --docs 40      # a CPU smoke run

The input is synthetic text (documents of about --doc-words words, --questions questions each), written
to a temporary folder. Each configuration runs as `kevscore run --gpus N` (N = 1 runs the same code path
in one process). Reported per configuration: the whole command's wall time, and the job's own figures
from rank 0 (its `--log-json` `done` line): per-rank load time (model, encode, bank) and work time (prefill +
scoring). Scaling = work time on 1 GPU over the slowest rank's work time on N GPUs; the wall-clock
scaling (start-up included) is reported beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

WORDS = ("market bread coffee river train meeting doctor budget project weather garden music city school "
         "report engine window silver orange forest summer winter station letter museum").split()


def make_input(path: Path, docs: int, doc_words: int, questions: int, seed: int) -> int:
    rng = random.Random(seed)
    rows = {"doc_id": [], "question_id": [], "document": [], "question": []}
    for d in range(docs):
        text = " ".join(rng.choice(WORDS) for _ in range(doc_words)) + "."
        for q in range(questions):
            rows["doc_id"].append(f"d{d}")
            rows["question_id"].append(f"d{d}-q{q}")
            rows["document"].append(text)
            rows["question"].append(f"Does the document mention {rng.choice(WORDS)} before {rng.choice(WORDS)}?")
    pq.write_table(pa.table(rows), path)
    return docs * questions


def run(args, input_path: Path, gpus: int, out_dir: Path) -> dict:
    out = out_dir / f"out-{gpus}.parquet"
    cmd = [sys.executable, "-m", "kevscore", "run", str(input_path), "-o", str(out), "--overwrite", "--log-json",
           "--model", args.model, "--device", args.device, "--gpus", str(gpus)]
    if gpus == 1:  # one rank through the same distributed code path
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m",
               "kevscore", *cmd[3:-2]]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"{gpus} GPU(s) failed:\n{res.stderr[-4000:]}")
    report = next(json.loads(line) for line in res.stdout.splitlines()[::-1] if line.startswith('{"event": "done"'))
    report["wall_s"] = wall
    report["work_s"] = max(r["work_s"] for r in report["ranks"])
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="kev-4b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--docs", type=int, default=3000)
    ap.add_argument("--doc-words", type=int, default=700)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.device == "cuda" and (os.environ.get("WORLD_SIZE") or 0):
        sys.exit("run this script directly, not under torchrun")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = make_input(tmp / "q.parquet", args.docs, args.doc_words, args.questions, seed=0)
        one, many = run(args, tmp / "q.parquet", 1, tmp), run(args, tmp / "q.parquet", args.gpus, tmp)
        same = pq.read_table(tmp / "out-1.parquet").column("prediction").equals(
            pq.read_table(tmp / f"out-{args.gpus}.parquet").column("prediction"))
    report = {"workload": vars(args) | {"json": None, "rows": rows}, "one": one, "many": many,
              "work_scaling": one["work_s"] / many["work_s"], "wall_scaling": one["wall_s"] / many["wall_s"],
              "same_predictions": same}
    print(f"\n{rows:,} rows, {args.docs:,} documents, {args.model} on {args.device}")
    print(f"{'GPUs':>5}{'wall s':>10}{'work s (slowest rank)':>24}{'rows/s (work)':>15}")
    for n, r in ((1, one), (args.gpus, many)):
        print(f"{n:>5}{r['wall_s']:>10.1f}{r['work_s']:>24.1f}{rows / r['work_s']:>15.1f}")
    print(f"scaling: {report['work_scaling']:.2f}x (work), {report['wall_scaling']:.2f}x (wall, start-up included); "
          f"same predictions: {same}")
    for r in many["ranks"]:
        print(f"  rank {r['rank']}: {r['rows']:,} rows, load {r['load_s']:.1f} s, work {r['work_s']:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
