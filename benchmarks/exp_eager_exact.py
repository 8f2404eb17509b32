"""Experiment (NOTES 117): a job's scoring phase eager at exact branch lengths against CUDA graphs at padded ones.

    python benchmarks/exp_eager_exact.py --docs 256 --json benchmarks/results/eager-exact-kev-4b-h200-v1.json

The rows of the job input's first `--docs` documents (bench_job's input, bench_job's `sample_rows`), prefilled
once; then the scoring phase (`Engine.score_rows`, indexed) under each variant, in ABCDE EDCBA order, each the
median of `--reps` after one warm-up call (which captures a graph variant's buckets):

- graphs: the job's path (graph buckets: rows 1, 2, 4, 8, 12, ..., lengths in steps of 8 past 64 tokens);
- graphs-4: the same with lengths in steps of 4;
- eager: the eager runner (its upload through pinned memory, so the host does not wait for the GPU), padded
  as the graphs are;
- eager-exact: the eager runner at each batch's exact longest length and row count;
- eager-exact-128: the same with batches of up to 128 rows and 16,384 tokens.

Prints the table (ms, rows/s, padded tokens, max |dp| against `graphs`, an eager batch's launch time on the
host) and writes JSON.
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
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script's logic (no pinned memory)")
    args = ap.parse_args()

    import bench_job
    import numpy as np
    import torch

    from kevscore.engine import plan
    from kevscore.engine.cuda_runner import build_cuda_runner
    from kevscore.engine.pipeline import Engine, Scores
    from kevscore.engine.runner import EagerRunner
    from kevscore.measure import events_ms

    launch_s = []  # host seconds of each eager batch's launches (nothing in them waits for the GPU)

    class PinnedEager(EagerRunner):
        def score(self, batch, branches, slots, prefix_lens, path):
            t0 = time.perf_counter()
            try:
                return self._score(batch, branches, slots, prefix_lens, path)
            finally:
                launch_s.append(time.perf_counter() - t0)

        def _score(self, batch, branches, slots, prefix_lens, path):
            buf = self.upload(batch, branches, slots, prefix_lens)
            if self.device.type == "cuda":
                buf = buf.pin_memory()
            buf = buf.to(self.device, non_blocking=True)
            return self.forward(buf, batch, path)[: len(branches) * batch.scored].float()

    job_args = argparse.Namespace(rows=6000, docs=1000, doc_words=1000, question_words=40)
    folder = Path(tempfile.mkdtemp())
    data = bench_job.make_input(job_args, folder)
    enc, ckpt = bench_job.sample_rows(data, args.docs, args.model, args.device)
    if args.device == "cuda":
        graphs = build_cuda_runner(ckpt, torch.device("cuda"), [len(p) for p in enc.prefixes], None, False)
    else:
        from kevscore.engine.backend import build_runner
        graphs = build_runner(ckpt, torch.device("cpu"), [len(p) for p in enc.prefixes])
    eager = PinnedEager(graphs.model, graphs.bank, ckpt.pad_id)
    slot_of = Engine(graphs, prefill_tokens=graphs.prefill_tokens).prefill_wave(
        enc, list(range(len(enc.prefixes))), Scores.empty(0).stats)
    rows = list(range(len(enc)))
    branch_len = [len(b) for b in enc.branches]
    prefix_len = [len(enc.prefixes[d]) for d in enc.row_prefix]

    by8, rows_ladder = plan.length_bucket, plan.row_bucket
    by4 = lambda n: -(-n // 4) * 4 if 64 < n <= 128 else plan.ladder(n)  # noqa: E731
    exact = lambda n: n  # noqa: E731
    exact_rows = lambda n, most: n  # noqa: E731
    variants = {"graphs": (graphs, by8, rows_ladder, 64, 8192), "graphs-4": (graphs, by4, rows_ladder, 64, 8192),
                "eager": (eager, by8, rows_ladder, 64, 8192), "eager-exact": (eager, exact, exact_rows, 64, 8192),
                "eager-exact-128": (eager, exact, exact_rows, 128, 16384)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    host: dict[str, list[float]] = {name: [] for name in variants}
    probs, padded, batches = {}, {}, {}
    for name in [*variants, *reversed(variants)]:
        runner, lengths, row_counts, max_rows, max_tokens = variants[name]
        plan.length_bucket, plan.row_bucket = lengths, row_counts
        engine = Engine(runner, max_rows=max_rows, max_tokens=max_tokens)
        scores = Scores.empty(len(rows))
        call = partial(engine.score_rows, enc, rows, slot_of, "indexed", scores)
        n_launch = len(launch_s)
        times[name] += events_ms(call, reps=args.reps, warmup=1 if not times[name] else 0, device=args.device)
        host[name] += launch_s[n_launch:]  # the warm-up's first launches too: the median is of steady ones
        probs[name] = np.array(scores.probs, dtype=np.float64)
        planned = plan.plan_batches(rows, branch_len, prefix_len, max_rows, max_tokens)
        padded[name], batches[name] = sum(b.size * b.length for b in planned), len(planned)
    plan.length_bucket, plan.row_bucket = by8, rows_ladder

    real = sum(branch_len)
    base = statistics.median(times["graphs"])
    out = []
    print(f"{len(rows)} rows of {args.docs} documents, {real} branch tokens")
    print(f"{'variant':>16} {'ms':>9} {'vs graphs':>9} {'rows/s':>8} {'batches':>7} {'padded':>7} {'max |dp|':>9} "
          f"{'launch ms':>9}")
    for name in variants:
        ms = statistics.median(times[name])
        dp = float(np.nanmax(np.abs(probs[name] - probs["graphs"])))
        launch = statistics.median(host[name]) * 1000 if host[name] else float("nan")
        out.append({"variant": name, "ms": ms, "all_ms": times[name], "rows_per_s": len(rows) / ms * 1000,
                    "batches": batches[name], "padded_tokens": padded[name], "real_tokens": real, "max_dp": dp,
                    "launch_ms_per_batch": launch})
        print(f"{name:>16} {ms:9.1f} {ms / base:9.3f} {len(rows) / ms * 1000:8.0f} {batches[name]:7d} "
              f"{padded[name] / real:7.3f} {dp:9.2e} {launch:9.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, "docs": args.docs, "rows": len(rows),
                                         "variants": out}, indent=1))


if __name__ == "__main__":
    main()
