"""A job's start on the GPU, step by step, each start in a fresh process: imports, the CUDA context, a prefill
group's first index upload, cuBLAS's first matmul, and the warm-up's kernel compilation
(kevscore.engine.warmup.compile_kernels at the model's layer shapes) with an empty Triton cache (a user's first
job) and with the cache a cold start left, then every kernel's first launch in the process (profiled); the cold
start with the parallel compile (kevscore.kernels.precompile), without it, and with its dry pass profiled; prefill
attention's first calls at long shapes, on another thread and on this one (cuDNN's kernel builds); then a
checkpoint load's steps (transformers' import, the tokenizer, seeded weights), and a warm start's slowest imports.
Prints a table, writes JSON.

    python benchmarks/bench_start.py --model kev-4b --json benchmarks/results/start-kev-4b-h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (name, empty cache first, how the warm-up compiles: forked processes beside the dry pass, those with the dry
# pass under cProfile (its calls of most cumulative seconds in the report), or no processes and no dry pass)
STARTS = (("cold, parallel", True, "parallel"), ("warm", False, "parallel"), ("cold, serial", True, "serial"),
          ("cold, dry profiled", True, "profiled"))
HEAVY = "transformers.models.auto.auto_factory"  # AutoTokenizer's import: transformers' model code


def child(model: str, mode: str) -> dict:
    steps, t = {}, time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        steps[name] = now - t
        t = now

    import torch
    lap("import torch")
    from kevscore.kernels import fla_ops  # noqa: F401 - FLA's kernel modules, as a job imports them
    steps["the import made the CUDA context"] = torch.cuda.is_initialized()
    lap("import FLA's kernels (fla_ops)")
    from kevscore.engine import cuda_runner  # noqa: F401
    from kevscore.engine.warmup import compile_kernels
    from kevscore.model.config import SHAPES
    lap("import kevscore's GPU modules")
    torch.cuda.init()
    lap("torch.cuda.init")
    torch.ones(1, device="cuda").sum().item()
    lap("CUDA context")
    first_prefill_inputs(lap)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    lap("first cuBLAS matmul")
    compiles = {"compiled": 0, "cache hits": 0}

    def listen(*, cache_hit: bool, **_):
        compiles["cache hits" if cache_hit else "compiled"] += 1

    import triton
    triton.knobs.compilation.listener = listen
    from kevscore.kernels import precompile
    dry_calls = []
    if mode == "serial":  # no forked workers: the warm-up's real pass compiles every kernel itself, one at a time
        precompile.precompile = lambda *_: precompile.Precompiled(skipped="serial")
    elif mode == "profiled":
        precompile.precompile = profiled_dry_pass(precompile.precompile, dry_calls)
    warm_up = compile_kernels(SHAPES[model], torch.device("cuda"), "indexed")
    lap("compile_kernels")
    steps["dry pass's slowest calls"] = dry_calls
    steps["first launches' slowest calls"] = first_launches(SHAPES[model], lap)
    first_attention_calls(SHAPES[model], lap)
    from kevscore.model.checkpoint import load_tokenizer, random_weights
    from kevscore.model.demo import demo_checkpoint_dir
    tokenizer_dir = demo_checkpoint_dir()
    t = time.perf_counter()
    load_tokenizer(tokenizer_dir)
    lap("load the tokenizer as a job does")  # the snapshot an earlier process kept: no transformers import
    steps["it imported dynamo, AutoTokenizer"] = [m in sys.modules for m in ("torch._dynamo", HEAVY)]
    steps["it imported transformers"] = "transformers" in sys.modules
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    lap("AutoTokenizer's import and load")
    steps["then dynamo, AutoTokenizer"] = [m in sys.modules for m in ("torch._dynamo", HEAVY)]
    random_weights(SHAPES[model], 0, torch.bfloat16, torch.device("cuda"))
    torch.cuda.synchronize()
    lap("seeded weights on the GPU")
    return {"steps": steps, "warm_up": warm_up, "compiles_in_this_process": compiles}


def first_prefill_inputs(lap) -> None:
    """A job-sized prefill group's index tensors (38 documents of ~1,700 tokens), the process's first and second
    time, its first pinned buffer and copy apart: a job's first group spends ~0.25 s there (NOTES 80-81)."""
    from types import SimpleNamespace

    import torch

    from kevscore.engine.runner import prefill_inputs

    host = torch.empty(3 << 20, dtype=torch.uint8, pin_memory=True)
    lap("first pinned buffer (3 MB)")
    host.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    lap("its first copy to the GPU")
    docs, bank = [list(range(1700 + i)) for i in range(38)], SimpleNamespace(entry_start=lambda s: s * 2048)
    for name in ("first", "second"):
        prefill_inputs(docs, list(range(38)), bank, "cuda", 3)
        torch.cuda.synchronize()
        lap(f"a prefill group's inputs, {name} time")


def profiled_dry_pass(precompile, calls: list, most: int = 16):
    """`precompile` with its dry pass (the warm-up's Python through every shape, launching nothing) run under
    cProfile: its calls of most cumulative seconds go into `calls` (the pass holds the GIL that a cold job's load
    needs for ~2.5-4 s, NOTES 85)."""
    import cProfile

    def run(dry_run, *args, **kwargs):
        profile = cProfile.Profile()

        def profiled(*mark):
            try:
                profile.runcall(dry_run, *mark)
            finally:
                calls.extend(slowest_calls(profile, most, skip=("_contextlib",)))
        return precompile(profiled, *args, **kwargs)

    return run


def slowest_calls(profile, most: int, skip: tuple[str, ...]) -> list[tuple[str, float]]:
    """A cProfile run's calls of most cumulative seconds, but those in files whose path holds one of `skip`."""
    import pstats

    stats = pstats.Stats(profile).stats
    calls = [(f"{Path(f).name}:{line} {name}", row[3]) for (f, line, name), row in stats.items()
             if not any(part in f for part in skip) and "builtins.exec" not in name]
    return [(name, round(s, 4)) for name, s in sorted(calls, key=lambda c: -c[1])[:most]]


def first_launches(cfg, lap, most: int = 12, device: str = "cuda") -> list[tuple[str, float]]:
    """The warm-up's model through every shape, twice, after `compile_kernels`: on a warm start (its marker: no
    pass ran) the first time is each Triton kernel's first launch in the process, which a warm job's first
    prefill group pays with the GPU idle (~0.3 s, NOTES 87); on a cold one the warm-up's real pass paid it. The
    first pass runs under cProfile: returns its calls of most cumulative seconds outside kevscore and torch.nn."""
    import cProfile

    import torch

    from kevscore.engine.warmup import attention_stubbed, shape_pass

    run = shape_pass(cfg, torch.device(device), "indexed", None)  # each pass synchronizes at its end
    lap("the warm-up's model built again")
    profile = cProfile.Profile()
    with attention_stubbed(torch.device(device)):  # as compile_kernels runs it: no cuDNN build at its shapes
        profile.runcall(run)
        lap("its pass through every shape, first time (profiled)")
        run()
    lap("its pass, second time")
    return slowest_calls(profile, most, skip=("kevscore", "torch/nn", "_contextlib"))


def first_attention_calls(cfg, lap) -> None:
    """Prefill's SDPA (cuDNN) at long padded shapes: on another thread, then on this one at the same shape and
    at new ones. Says whether what cuDNN builds at a process's first long shapes is kept per thread or per shape
    (benchmarks/NOTES.md 35-36), where the warm-up ran it only at its short shapes."""
    import threading

    import torch

    from kevscore.kernels.fla_ops import sdpa_causal

    def attend(docs: int, length: int) -> None:
        q = torch.zeros(docs, length, cfg.num_attention_heads, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
        kv = torch.zeros(docs, length, cfg.num_key_value_heads, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
        sdpa_causal(q, kv, kv)
        torch.cuda.synchronize()

    other = threading.Thread(target=attend, args=(8, 2048))
    other.start()
    other.join()
    lap("SDPA 8 x 2,048 on another thread")
    attend(8, 2048)
    lap("SDPA the same on this thread")
    # batches of fewer than 40 documents and more, lengths on multiples of 64 and 128 and off them (NOTES 39, 45)
    for docs, length in ((39, 1664), (40, 1600), (40, 1632), (40, 1650), (40, 1700), (41, 1728), (2, 8192)):
        attend(docs, length)
        lap(f"SDPA {docs} x {length:,} (mod 64: {length % 64}, mod 128: {length % 128})")


def top_imports(stderr: str, most: int = 25) -> list[tuple[str, float]]:
    """The imports that took longest, with what they imported (`python -X importtime`'s cumulative column)."""
    rows = []
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = line.split("|")
            if cumulative.strip().isdigit():
                rows.append((name.rstrip(), int(cumulative) / 1e6))
    return sorted(rows, key=lambda r: -r[1])[:most]


def run_start(model: str, cache: str, mode: str, importtime: bool = False) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=cache,
               CUDA_CACHE_PATH=str(Path(cache) / "cuda"))  # the driver's compiled kernels: cold with the cache
    t0 = time.perf_counter()
    flags = ["-X", "importtime"] if importtime else []
    out = subprocess.run([sys.executable, *flags, __file__, "--child", "--model", model, "--mode", mode], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    report = json.loads(out.stdout.strip().splitlines()[-1])
    report["process_s"] = time.perf_counter() - t0
    if importtime:
        report["imports"] = top_imports(out.stderr)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="kev-4b")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="parallel", help=argparse.SUPPRESS)  # a child's compile: STARTS' third field
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.mode)))
        return
    caches = {True: None, False: None}
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for i, (name, cold, mode) in enumerate(STARTS):
            cache = caches[False] if not cold else str(Path(root) / f"cache{i}")
            caches[False] = caches[False] or cache
            results[name] = run_start(args.model, cache, mode)
        # the warm start again under -X importtime (its own timings are inflated by the tracing)
        imports = run_start(args.model, caches[False], "parallel", importtime=True)["imports"]
    names = list(results)
    rows = sorted({k for r in results.values() for k in r["steps"]}, key=list(results[names[0]]["steps"]).index)
    print(f"{'step (seconds)':34}" + "".join(f"{n:>16}" for n in names))

    def cell(value) -> str:
        return f"{value:16.2f}" if isinstance(value, float) else f"{value!s:>16}"

    for k in rows:
        if k not in ("first launches' slowest calls", "dry pass's slowest calls"):
            print(f"{k:34}" + "".join(cell(r["steps"].get(k, "-")) for r in results.values()))
    print(f"{'  of which the real pass':34}" + "".join(cell(r["warm_up"].get("run_s", 0.0)) for r in results.values()))
    for k in ("dry_s", "compile_s", "kernels", "compiled", "workers"):
        print(f"{'  precompile ' + k:34}" + "".join(cell(r["warm_up"].get("precompile", {}).get(k, "-"))
                                                   for r in results.values()))
    for k in ("compiled", "cache hits"):
        print(f"{'  in-process ' + k:34}" + "".join(f"{r['compiles_in_this_process'][k]:16d}" for r in results.values()))
    print(f"{'process':34}" + "".join(f"{r['process_s']:16.2f}" for r in results.values()))
    print("a warm start's first launches, slowest calls (cumulative s, cProfile):")
    for name, seconds in results["warm"]["steps"]["first launches' slowest calls"]:
        print(f"  {seconds:6.3f} {name}")
    print("a cold start's dry pass, slowest calls (cumulative s, cProfile):")
    for name, seconds in results["cold, dry profiled"]["steps"]["dry pass's slowest calls"]:
        print(f"  {seconds:6.3f} {name}")
    print("slowest imports of a warm start (cumulative s, under -X importtime):")
    for name, seconds in imports[:12]:
        print(f"  {seconds:6.2f} {name}")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "starts": results, "imports": imports}, indent=1))


if __name__ == "__main__":
    main()
