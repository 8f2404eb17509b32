"""EXPERIMENT (NOTES 101): document prefill with its groups on one CUDA stream or round-robin over two, in one
process, interleaved A/B/A/B; the bank's bytes compared between the two."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_score as bench  # noqa: E402

from kevscore.engine.cuda_runner import build_cuda_runner  # noqa: E402
from kevscore.engine.pipeline import Engine, Scores  # noqa: E402
from kevscore.measure import events_ms  # noqa: E402
from kevscore.model.checkpoint import load_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc-tokens", default="1700,8192")
    ap.add_argument("--tokens", type=int, default=262144)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rate = bench.MatmulRate()
    tflops = statistics.median(rate.samples(20, warmup=3))
    del rate
    ckpt = load_checkpoint("kev-4b", "cuda")
    report = {"tflops": tflops, "runs": []}
    for doc_tokens in map(int, args.doc_tokens.split(",")):
        docs = max(1, args.tokens // doc_tokens)
        enc = bench.workload(ckpt.config, docs, doc_tokens, 1, 8, seed=1)
        runner = build_cuda_runner(ckpt, torch.device("cuda"), [doc_tokens] * docs, None, False)
        full = runner.prefill_tokens
        variants = {"1 stream": (1, full), "2 streams": (2, full), "2 streams, half groups": (2, full // 2)}
        engine = Engine(runner, prefill_tokens=full)
        stats = Scores.empty(0).stats
        roof_ms = bench.prefill_flops(ckpt.config, docs * doc_tokens) / tflops / 1e9
        sums, times = {}, {name: [] for name in variants}
        for name, (streams, group) in variants.items():  # warm-up each, and the bank it leaves
            engine.prefill_streams, engine.prefill_tokens = streams, group
            events_ms(lambda: engine.prefill_wave(enc, list(range(docs)), stats), reps=1, warmup=1)
            torch.cuda.synchronize()
            sums[name] = runner.bank.checksum()
        for _ in range(args.rounds):
            for name, (streams, group) in variants.items():
                engine.prefill_streams, engine.prefill_tokens = streams, group
                times[name] += events_ms(lambda: engine.prefill_wave(enc, list(range(docs)), stats), reps=1, warmup=0)
        for name in variants:
            ms = statistics.median(times[name])
            run = {"doc_tokens": doc_tokens, "docs": docs, "group_tokens": variants[name][1], "variant": name,
                   "ms": ms, "all_ms": times[name], "roof_share": roof_ms / ms,
                   "bank_same_as_1_stream": sums[name] == sums["1 stream"],
                   "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
            report["runs"].append(run)
            print(f"{doc_tokens:>6} {name:<24} group {variants[name][1]:>6} {ms:8.1f} ms  roof {roof_ms / ms:5.1%}  "
                  f"bank same {run['bank_same_as_1_stream']}  runs {[round(t, 1) for t in times[name]]}", flush=True)
        del runner, engine
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
