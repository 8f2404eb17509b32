"""Experiment (NOTES 119's lead): from what size a scoring batch should run eagerly at its own shape, per model.

    python benchmarks/exp_exact_threshold.py --model kev-4b --question-words 12 --json out.json

The rows of a bench_job-shaped input's first `--docs` documents (`make_long_input.py` with `--question-words`:
12 gives ~38-token questions, 40 the job's ~85), prefilled once; then the scoring phase (`Engine.score_rows`,
indexed) under each variant, ABCD DCBA, each the median of `--reps` after one warm-up call (which captures a
graph variant's buckets):

- graphs-64: every batch in its graph bucket, 64 rows and 8,192 tokens a batch (the job before NOTES 118);
- graphs-128: the same at 128 rows and 16,384 tokens;
- tokens-8192: the job before NOTES 120 (128 rows; batches of 8,192 padded tokens or more at their own shape);
- default: the job now (128 rows; batches of `plan.EAGER_LAYER_FLOPS` a layer or more at their own shape);
- exact-128: every batch at its own shape, eagerly, 128 rows.

Prints ms, rows/s, batches, padding, the weight-matmul TFLOP of a batch (median), GPU ms and host launch ms of an
eager batch (medians), max |dp| against graphs-64; writes JSON. An eager batch pays off where its GPU time
clearly exceeds its launch time: the ratio per model says where the threshold should sit.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="kev-4b")
    ap.add_argument("--docs", type=int, default=256, help="documents whose rows are scored")
    ap.add_argument("--question-words", type=int, default=12, help="make_long_input's --question-words")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script's logic")
    args = ap.parse_args()

    import bench_job
    import bench_score
    import numpy as np
    import torch

    from kevscore.engine import plan
    from kevscore.engine.backend import build_runner
    from kevscore.engine.pipeline import Engine, Scores
    from kevscore.engine.runner import EagerRunner
    from kevscore.measure import events_ms

    job_args = argparse.Namespace(rows=6 * args.docs, docs=args.docs, doc_words=1000, question_words=args.question_words)
    data = bench_job.make_input(job_args, Path(tempfile.mkdtemp()))
    enc, ckpt = bench_job.sample_rows(data, args.docs, args.model, args.device)
    runner = build_runner(ckpt, torch.device(args.device), [len(p) for p in enc.prefixes])
    launch_ms: list[float] = []
    eager_score = EagerRunner.score

    def timed_score(self, batch, *rest):  # an exact batch's launches on the host (nothing in them waits)
        t0 = time.perf_counter()
        out = eager_score(self, batch, *rest)
        if batch.exact:
            launch_ms.append((time.perf_counter() - t0) * 1000)
        return out

    EagerRunner.score = timed_score
    slot_of = Engine(runner, prefill_tokens=runner.prefill_tokens).prefill_wave(
        enc, list(range(len(enc.prefixes))), Scores.empty(0).stats)
    rows = list(range(len(enc)))
    branch_len = [len(b) for b in enc.branches]
    prefix_len = [len(enc.prefixes[d]) for d in enc.row_prefix]
    never = 1 << 40
    variants = {"graphs-64": (never, 64, 8192), "graphs-128": (never, 128, 16384),
                "tokens-8192": (8192, 128, 16384), "default": (runner.exact_from, 128, 16384),
                "exact-128": (0, 128, 16384)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    launches: dict[str, list[float]] = {name: [] for name in variants}
    probs, planned = {}, {}
    for name in [*variants, *reversed(variants)]:
        exact_from, max_rows, max_tokens = variants[name]
        runner.exact_from = exact_from
        engine = Engine(runner, max_rows=max_rows, max_tokens=max_tokens)
        scores = Scores.empty(len(rows))
        first = len(launch_ms)
        times[name] += events_ms(partial(engine.score_rows, enc, rows, slot_of, "indexed", scores), reps=args.reps,
                                 warmup=0 if times[name] else 1, device=args.device)
        launches[name] += launch_ms[first:]
        probs[name] = np.array(scores.probs, dtype=np.float64)
        planned[name] = plan.plan_batches(rows, branch_len, prefix_len, max_rows, max_tokens, exact_from=exact_from)

    real, base = sum(branch_len), statistics.median(times["graphs-64"])
    every, _ = bench_score.token_flops(ckpt.config)
    out = []
    print(f"{args.model}: {len(rows)} rows of {args.docs} documents, {real} branch tokens "
          f"(mean {real / len(rows):.1f})")
    print(f"{'variant':>10} {'ms':>8} {'x g-64':>7} {'rows/s':>7} {'batches':>7} {'padded':>7} {'TFLOP/b':>7} "
          f"{'GPU ms/b':>8} {'launch':>7} {'max |dp|':>9}")
    for name in variants:
        ms, batches = statistics.median(times[name]), planned[name]
        tflop = statistics.median(b.size * b.length for b in batches) * every / 1e12
        launch = statistics.median(launches[name]) if launches[name] else float("nan")
        dp = float(np.nanmax(np.abs(probs[name] - probs["graphs-64"])))
        row = {"variant": name, "ms": ms, "all_ms": times[name], "rows_per_s": len(rows) / ms * 1000,
               "batches": len(batches), "exact_batches": sum(b.exact for b in batches),
               "padding": sum(b.size * b.length for b in batches) / real, "tflop_per_batch": tflop,
               "gpu_ms_per_batch": ms / len(batches), "launch_ms_per_eager_batch": launch, "max_dp": dp}
        out.append(row)
        print(f"{name:>10} {ms:8.1f} {ms / base:7.3f} {row['rows_per_s']:7.0f} {len(batches):7d} "
              f"{row['padding']:7.3f} {tflop:7.2f} {row['gpu_ms_per_batch']:8.2f} {launch:7.2f} {dp:9.2e}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, "docs": args.docs, "rows": len(rows),
                                         "question_words": args.question_words, "variants": out}, indent=1))


if __name__ == "__main__":
    main()
