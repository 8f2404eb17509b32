"""A job's start on the GPU, step by step, each start in a fresh process: imports, the CUDA context, cuBLAS's
first matmul, and the warm-up's kernel compilation (kevscore.engine.warmup.compile_kernels at the model's layer
shapes) with an empty Triton cache (a user's first job) and with the cache a cold start left; the cold start
once with the parallel compile (kevscore.kernels.precompile) and once without. Prints a table, writes JSON.

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

# (name, empty cache first, KEVSCORE_PARALLEL_COMPILE)
STARTS = (("cold, parallel", True, "1"), ("warm", False, "1"), ("cold, serial", True, "0"))


def child(model: str) -> dict:
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
    from kevscore.kernels import tuning
    from kevscore.model.config import SHAPES
    lap("import kevscore's GPU modules")
    torch.cuda.init()
    lap("torch.cuda.init")
    torch.ones(1, device="cuda").sum().item()
    lap("CUDA context")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    lap("first cuBLAS matmul")
    tuning.pin_for(torch.cuda.get_device_name())
    compiles = {"compiled": 0, "cache hits": 0}

    def listen(*, cache_hit: bool, **_):
        compiles["cache hits" if cache_hit else "compiled"] += 1

    import triton
    triton.knobs.compilation.listener = listen
    warm_up = compile_kernels(SHAPES[model], torch.device("cuda"), "indexed")
    lap("compile_kernels")
    return {"steps": steps, "warm_up": warm_up, "compiles_in_this_process": compiles}


def run_start(model: str, cache: str, parallel: str) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=cache, KEVSCORE_PARALLEL_COMPILE=parallel)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--child", "--model", model], env=env, capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    report = json.loads(out.stdout.strip().splitlines()[-1])
    report["process_s"] = time.perf_counter() - t0
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="kev-4b")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model)))
        return
    caches = {True: None, False: None}
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for i, (name, cold, parallel) in enumerate(STARTS):
            cache = caches[False] if not cold else str(Path(root) / f"cache{i}")
            caches[False] = caches[False] or cache
            results[name] = run_start(args.model, cache, parallel)
    names = list(results)
    rows = sorted({k for r in results.values() for k in r["steps"]}, key=list(results[names[0]]["steps"]).index)
    print(f"{'step (seconds)':34}" + "".join(f"{n:>16}" for n in names))

    def cell(value) -> str:
        return f"{value:16.2f}" if isinstance(value, float) else f"{value!s:>16}"

    for k in rows:
        print(f"{k:34}" + "".join(cell(r["steps"].get(k, "-")) for r in results.values()))
    print(f"{'  of which the real pass':34}" + "".join(cell(r["warm_up"]["run_s"]) for r in results.values()))
    for k in ("dry_s", "compile_s", "kernels", "compiled", "workers"):
        print(f"{'  precompile ' + k:34}" + "".join(cell(r["warm_up"].get("precompile", {}).get(k, "-"))
                                                   for r in results.values()))
    for k in ("compiled", "cache hits"):
        print(f"{'  in-process ' + k:34}" + "".join(f"{r['compiles_in_this_process'][k]:16d}" for r in results.values()))
    print(f"{'process':34}" + "".join(f"{r['process_s']:16.2f}" for r in results.values()))
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "starts": results}, indent=1))


if __name__ == "__main__":
    main()
