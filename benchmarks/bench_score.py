"""Scoring-call latency of the gathered and indexed paths on one GPU, against the matmul floor and naive
transformers. Prints a table and writes JSON.

    python benchmarks/bench_score.py --model kev-4b --json benchmarks/results/score-kev-4b-h200.json

Workload (defaults, the DESIGN.md reference shape): 16 documents of 1024 tokens, 6 questions of 64 tokens
each (96 rows), one scoring call = one padded batch of 96 x 64, prefill excluded, CUDA graphs captured.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kevscore.baselines import naive_call
from kevscore.measure import environment, events_ms
from kevscore.model.config import SHAPES, KevConfig
from kevscore.model.prompt import Encoded


class MatmulRate:
    """The bf16 matmul rate (TFLOP/s) of an n^3 product, sampled with CUDA events: 20 back-to-back products
    before the timed calls give the floor; single products between the calls are kept as a diagnostic of
    the clocks (they read ~10% lower than the rate the model's own GEMMs reach in the profile, so they are
    not used for the floor: benchmarks/NOTES.md 10)."""

    def __init__(self, n: int = 8192):
        self.n = n
        self.a, self.b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def samples(self, reps: int, warmup: int = 0) -> list[float]:
        return [2 * self.n**3 / ms / 1e9 for ms in events_ms(lambda: self.a @ self.b, reps=reps, warmup=warmup)]


def token_flops(cfg: KevConfig) -> tuple[int, int]:
    """Weight-matmul FLOPs per token: (through every layer, of the last layer's output projection and MLP)."""
    h = cfg.hidden_size
    delta = h * (cfg.conv_dim + cfg.value_dim + 2 * cfg.linear_num_value_heads)
    attn = h * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    out = {"linear_attention": cfg.value_dim * h, "full_attention": cfg.num_attention_heads * cfg.head_dim * h}
    mlp = 3 * h * cfg.intermediate_size
    total = sum((delta if kind == "linear_attention" else attn) + out[kind] + mlp for kind in cfg.layer_types)
    return 2 * total, 2 * (out[cfg.layer_types[-1]] + mlp)


def matmul_flops(cfg: KevConfig, tokens: int, rows: int) -> float:
    """Weight-matmul FLOPs of scoring `rows` rows of `tokens` branch tokens in all: every token through every
    projection except the last layer's output projection and MLP, which (like the LM head) run at each
    row's last position only, as `KevModel.branch` does."""
    every, last_only = token_flops(cfg)
    return every * tokens - last_only * (tokens - rows) + 2 * cfg.hidden_size * cfg.vocab_size * rows


def prefill_flops(cfg: KevConfig, tokens: int) -> float:
    """Weight-matmul FLOPs of prefilling `tokens` document tokens: every projection but what the last layer
    would compute after its bank entry (`Block.write_bank`: its output projection and MLP, and an attention
    layer's q|gate projection); no LM head."""
    every, last_only = token_flops(cfg)
    q_gate = 2 * cfg.num_attention_heads * cfg.head_dim * cfg.hidden_size if cfg.layer_types[-1] == "full_attention" else 0
    return (every - last_only - 2 * q_gate) * tokens


def attention_flops(cfg: KevConfig, doc_len: int, q_len: int, rows: int) -> float:
    """FLOPs of the attention layers' scores and weighted sums (4 x head_dim per query head and key it attends
    to) when `rows` rows of `q_len` tokens attend to their document's `doc_len` tokens and causally to their
    own: work the model does beyond the weight matmuls, which grows with the documents' length."""
    pairs = q_len * doc_len + q_len * (q_len + 1) // 2
    return 4 * cfg.head_dim * cfg.num_attention_heads * cfg.layer_types.count("full_attention") * pairs * rows


def prefill_attention_flops(cfg: KevConfig, doc_len: int, docs: int) -> float:
    """The same for prefilling `docs` documents of `doc_len` tokens, each causally over itself; a last attention
    layer computes none (prefill stops at its bank entry)."""
    layers = cfg.layer_types.count("full_attention") - (cfg.layer_types[-1] == "full_attention")
    return 4 * cfg.head_dim * cfg.num_attention_heads * layers * docs * doc_len * (doc_len + 1) // 2


def workload(cfg: KevConfig, docs: int, doc_len: int, questions: int, q_len: int, seed: int) -> Encoded:
    gen = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(100, min(cfg.vocab_size, 1200), (n,), generator=gen).tolist()  # noqa: E731
    prefixes = [rand(doc_len) for _ in range(docs)]
    rows = [d for d in range(docs) for _ in range(questions)]
    n = len(rows)
    return Encoded(prefixes, rows, [rand(q_len) for _ in range(n)], [["Yes", "No"]] * n, [[361, 383]] * n)


# a kernel counts in the first group one of whose keys is in its name (our fused gate|up GEMM is a matmul)
KERNEL_GROUPS = [
    ("gated delta rule (ours)", ("_branch_wy_kernel", "_chunks_wy_kernel", "_kkt_solve_kernel", "_gate_cumsum_kernel")),
    ("state scan (FLA)", ("chunk_gated_delta_rule_fwd_kernel_h",)),
    ("FLA chunk pipeline", ("chunk_", "recompute_w_u", "l2norm", "cumsum")),
    ("causal conv", ("causal_conv1d", "_branch_conv_kernel")),
    ("attention", ("_branch_attn_kernel", "fmha", "flash", "attention", "efficient")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "Kernel2")),
    ("norms / swiglu / gates", ("layer_norm", "rms_norm", "gated_norm", "swiglu", "norm_rope", "sigmoid_gate")),
    ("gather / copy", ("index", "gather", "cat", "copy", "Copy", "Memcpy", "Memset")),
]


def profile(fn, reps: int = 3) -> dict[str, dict]:
    """GPU time per call (ms) by kernel group and for the 25 costliest kernels (with launches per call), and
    the number of kernel launches per call, from the torch profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    events = [(evt.key, getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0), evt.count)
              for evt in prof.key_averages()]
    return summarize(events, reps)


def summarize(events: list[tuple[str, float, int]], reps: int) -> dict[str, dict]:
    """(kernel name, total us, launches) over `reps` calls -> per-call groups, top kernels and totals. Names
    are shortened to 90 characters for the table; kernels whose short names collide (torch's templated
    elementwise kernels) are added together, not overwritten."""
    groups: dict[str, float] = {}
    kernels: dict[str, float] = {}
    calls: dict[str, float] = {}
    for key, total, count in events:
        if total <= 0:
            continue
        name = next((g for g, keys in KERNEL_GROUPS if any(k in key for k in keys)), "elementwise / other")
        groups[name] = groups.get(name, 0.0) + total / 1000 / reps
        short = key[:90]
        kernels[short] = kernels.get(short, 0.0) + total / 1000 / reps
        calls[short] = calls.get(short, 0.0) + count / reps
    top = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:25])
    return {"groups": dict(sorted(groups.items(), key=lambda kv: -kv[1])), "top_kernels": top,
            "top_kernel_launches": {k: calls[k] for k in top}, "launches_per_call": sum(calls.values()),
            "kernel_ms_per_call": sum(kernels.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="kev-4b", choices=sorted(SHAPES))
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--doc-len", type=int, default=1024)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--q-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--hf-reps", type=int, default=3, help="0 skips the naive transformers baseline")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--fla", nargs="+", default=[], choices=["conv", "solve", "wy", "prefill", "prefill-stages"],
                    help="A/B: the fla_ops functions of these swaps run as FLA's own ops (tests/fla_oracles.py SWAPS)")
    args = ap.parse_args()
    if args.fla:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from fla_oracles import swapped

        swapped(*args.fla).__enter__()  # for the whole process: nothing to restore

    from kevscore.engine.cuda_runner import build_cuda_runner
    from kevscore.engine.pipeline import Engine, Scores
    from kevscore.model.checkpoint import load_checkpoint

    rate = MatmulRate()
    tflops = statistics.median(rate.samples(20, warmup=3))  # the floor's rate
    ckpt = load_checkpoint(args.model, "cuda")
    cfg = ckpt.config
    enc = workload(cfg, args.docs, args.doc_len, args.questions, args.q_len, seed=0)
    rows = list(range(len(enc)))
    t0 = time.perf_counter()
    runner = build_cuda_runner(ckpt, torch.device("cuda"), [len(p) for p in enc.prefixes], None, False)
    engine = Engine(runner, max_rows=len(rows), max_tokens=len(rows) * args.q_len, prefill_tokens=32768)
    load_s = time.perf_counter() - t0
    stats = Scores.empty(0).stats
    prefill_ms = statistics.median(events_ms(
        lambda: engine.prefill_wave(enc, list(range(args.docs)), stats), reps=3, warmup=1))
    slot_of = {d: d for d in range(args.docs)}
    before = [t.cpu() for t in runner.bank.used()]  # on the host: the GPU's memory as the run leaves it
    results = {p: Scores.empty(len(rows)) for p in ("gathered", "indexed")}
    call = {p: (lambda p=p: engine.score_rows(enc, rows, slot_of, p, results[p])) for p in results}
    for p in call:  # capture each path's graph; capture + warm-up time is reported apart
        call[p]()
    samples = {p: [] for p in call}
    rates: list[float] = []  # matmul TFLOP/s sampled between the timed calls
    wall = {p: [] for p in call}
    for _ in range(args.warmup):
        for p in call:
            call[p]()
    for i in range(args.reps):
        order = ("gathered", "indexed") if i % 2 == 0 else ("indexed", "gathered")  # A B, B A, ...
        for p in order:
            t = time.perf_counter()
            samples[p] += events_ms(call[p], reps=1, warmup=0)
            wall[p].append(time.perf_counter() - t)
        rates += rate.samples(3)
    # each path's captured graphs replayed alone: the GPU side of a call; the rest is host work (planning,
    # filling the upload buffer, reading the probabilities back) and the label head
    replay = {p: 0.0 for p in call}
    for key, entry in runner.graphs.items():
        replay[key[-1]] += statistics.median(events_ms(entry.graph.replay, reps=args.reps, warmup=1))
    bank_unchanged = all(torch.equal(a, b.cpu()) for a, b in zip(before, runner.bank.used()))
    diff = max(abs(a - b) for ra, rb in zip(results["gathered"].probs, results["indexed"].probs)
               for a, b in zip(ra, rb))
    floor_ms = matmul_flops(cfg, len(rows) * args.q_len, len(rows)) / tflops / 1e9
    attention_ms = attention_flops(cfg, args.doc_len, args.q_len, len(rows)) / tflops / 1e9
    med = {p: statistics.median(s) for p, s in samples.items()}
    report = {
        "workload": vars(args) | {"json": str(args.json) if args.json else None, "rows": len(rows)},
        "environment": environment(torch.device("cuda")), "matmul_tflops": tflops,
        "matmul_tflops_between_calls": rates, "floor_ms": floor_ms, "attention_floor_ms": attention_ms,
        "load_s": load_s, "prefill_ms": prefill_ms, "capture_s": runner.capture_s,
        "samples_ms": samples, "wall_s": wall, "median_ms": med, "replay_ms": replay,
        "p10_p90_ms": {p: statistics.quantiles(s, n=10)[::8] for p, s in samples.items()},
        "rows_per_s": {p: len(rows) / statistics.median(w) for p, w in wall.items()},
        "indexed_over_gathered": med["indexed"] / med["gathered"], "indexed_over_floor": med["indexed"] / floor_ms,
        "max_abs_prob_diff": diff, "bank_unchanged": bank_unchanged,
    }
    if args.profile:
        report["profile_ms"] = {p: profile(call[p]) for p in call}
    if args.hf_reps:
        from kevscore.reference import reference_model

        del engine, runner, call, rate
        torch.cuda.empty_cache()
        model = reference_model(ckpt, device="cuda", dtype=torch.bfloat16)
        hf = events_ms(naive_call(model, enc, "cuda", args.hf_batch, rows), reps=args.hf_reps, warmup=1)
        torch.cuda.empty_cache()
        report["hf_naive_ms"] = hf
        report["hf_rows_per_s"] = len(rows) / (statistics.median(hf) / 1000)
    print_table(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


def print_table(r: dict) -> None:
    print(f"\n{r['environment']['gpu']} | {r['workload']['model']} | rows {r['workload']['rows']} x "
          f"{r['workload']['q_len']} tokens | matmul {r['matmul_tflops']:.0f} TFLOP/s | floor {r['floor_ms']:.1f} ms")
    if r.get("matmul_tflops_between_calls"):
        print(f"matmul between the calls: median {statistics.median(r['matmul_tflops_between_calls']):.0f} TFLOP/s")
    print(f"prefill {r['prefill_ms']:.1f} ms | capture+warm-up {r['capture_s']:.1f} s | "
          f"max |dp| {r['max_abs_prob_diff']:.3g} | bank unchanged {r['bank_unchanged']}")
    print(f"{'path':<10}{'median ms':>11}{'p10':>9}{'p90':>9}{'rows/s':>9}{'x floor':>9}")
    for p in ("gathered", "indexed"):
        p10, p90 = r["p10_p90_ms"][p]
        print(f"{p:<10}{r['median_ms'][p]:>11.2f}{p10:>9.2f}{p90:>9.2f}{r['rows_per_s'][p]:>9.0f}"
              f"{r['median_ms'][p] / r['floor_ms']:>9.2f}")
    print(f"indexed / gathered = {r['indexed_over_gathered']:.4f}")
    if "attention_floor_ms" in r:  # the floor counts weight matmuls; attention over the documents is work too
        full = r["floor_ms"] + r["attention_floor_ms"]
        print(f"with attention's FLOPs at the same rate (+{r['attention_floor_ms']:.1f} ms): floor {full:.1f} ms, "
              f"indexed {r['median_ms']['indexed'] / full:.2f}x")
    if "replay_ms" in r:
        print("graph replay alone (ms): " + ", ".join(
            f"{p} {ms:.2f} (call - replay {r['median_ms'][p] - ms:.2f})" for p, ms in r["replay_ms"].items()))
    if "hf_naive_ms" in r:
        hf = statistics.median(r["hf_naive_ms"])
        print(f"transformers naive: {hf:.0f} ms ({r['hf_rows_per_s']:.1f} rows/s), "
              f"{hf / r['median_ms']['indexed']:.1f}x the indexed call (which excludes prefill; end to end: bench_job.py)")
    for p, prof in r.get("profile_ms", {}).items():
        print(f"profile {p} (ms/call): " + ", ".join(f"{g} {ms:.2f}" for g, ms in prof["groups"].items()))
        if "launches_per_call" in prof:
            print(f"  {prof['kernel_ms_per_call']:.2f} ms in {prof['launches_per_call']:.0f} kernel launches per call")
    indexed = r.get("profile_ms", {}).get("indexed", {})
    for name, ms in indexed.get("top_kernels", {}).items():
        print(f"  {ms:8.2f} {indexed.get('top_kernel_launches', {}).get(name, 0):5.0f}x  {name}")


if __name__ == "__main__":
    main()
