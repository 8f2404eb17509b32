"""A whole `kevscore run` job, phase by phase, against its matmul floor and against transformers (naive and
prefix-cached) on a sample of the same rows; and document prefill alone against the matmul roof. Prints a
table and writes JSON.

    python benchmarks/bench_job.py --model kev-4b --json benchmarks/results/job-kev-4b-h200.json

The job (defaults: the shape of issue 17's table): `make_long_input.py --rows 6000 --docs 1000 --doc-words
1000 --question-words 40`, ~1,700-token documents with 6 questions of ~85 tokens each, run through
`kevscore.job.run.run_job` (the code behind `kevscore run`, Parquet in and out) in a child process per start:
`cold` with empty Triton, FLA and kevscore caches (a user's first job), then `warm` on the caches the cold run left.
The GPU's idle time between phases comes from CUDA events recorded around each prefill and scoring phase.
The floor is the job's weight-matmul FLOPs at the bf16 rate measured in the same run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

HERE = Path(__file__).parent
STARTS = ("cold", "warm")


def job_floor_s(cfg, prefix_tokens: int, branch_tokens: int, rows: int, tflops: float) -> dict[str, float]:
    """Seconds of weight-matmul work at `tflops`: prefill of every document token, scoring of every question."""
    bench = _bench_score()
    prefill = bench.prefill_flops(cfg, prefix_tokens) / tflops / 1e12
    score = bench.matmul_flops(cfg, branch_tokens, rows) / tflops / 1e12
    return {"prefill": prefill, "score": score, "job": prefill + score}


def idle_between(phases: list[tuple[str, float, float]]) -> float:
    """Seconds the GPU had nothing queued between consecutive phases, from (name, start, end) times in
    seconds on one stream's clock; overlapping phases count no idle time."""
    ordered = sorted(phases, key=lambda p: p[1])
    return sum(max(0.0, nxt[1] - cur[2]) for cur, nxt in zip(ordered, ordered[1:]))


def _bench_score():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_score", HERE / "bench_score.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the child: one job in a fresh process -------------------------------------------------------------

def compile_log(t0: float) -> list[list]:
    """Every Triton kernel this process compiles or loads from the cache from now on, as [start s since t0,
    seconds, kernel, thread] (the forked compile workers' are not seen): which kernels a job still waits on."""
    import threading

    from triton import knobs

    events, started = [], {}

    def before(**kw):  # returns None: the compile goes ahead
        started[threading.get_ident(), kw["fn"].name] = time.perf_counter()

    def after(**kw):
        start = started.pop((threading.get_ident(), kw["fn"].name), None)
        if start is not None:
            events.append([round(start - t0, 3), round(time.perf_counter() - start, 3), kw["fn"].name,
                           threading.current_thread().name])

    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after
    return events


def sample_stacks(t0: float, seconds: float, every: float = 0.02):
    """A sampling profiler of this process's threads for `seconds` from now (the job's start: the imports before
    it are `import_s`): returns a function that stops it and gives the samples, each [seconds since t0, thread
    name, its innermost frames as file:line function]."""
    import threading
    import traceback

    samples, stop, begin = [], threading.Event(), time.perf_counter()

    def run() -> None:
        while not stop.is_set() and time.perf_counter() - begin < seconds:
            names = {t.ident: t.name for t in threading.enumerate()}
            now = round(time.perf_counter() - t0, 3)
            for ident, frame in sys._current_frames().items():
                if ident != threading.get_ident():
                    stack = traceback.extract_stack(frame)[-8:]
                    samples.append([now, names.get(ident, str(ident)),
                                    [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(stack)]])
            time.sleep(every)

    sampler = threading.Thread(target=run, name="stack-sampler", daemon=True)
    sampler.start()

    def finish() -> list:
        stop.set()
        sampler.join()
        return samples

    return finish


def child(args) -> None:
    t0 = time.perf_counter()
    import torch

    from kevscore.engine.pipeline import Reporter
    from kevscore.job.options import RunOptions
    from kevscore.job.run import run_job

    import_s = time.perf_counter() - t0

    class Timeline(Reporter):
        """CUDA events around each phase and after each prefill group and scoring batch's launches, read after
        the job: no synchronization while it runs (but one after the first group when it is traced)."""

        def __init__(self):
            self.marks: list[tuple[str, object, object]] = []
            self.steps: list[tuple[str, object]] = []
            self.host_steps: list[float] = []
            self.traced = False

        def advance(self, phase: str, n: int) -> None:
            self.steps.append((phase, torch.cuda.Event(enable_timing=True)))
            self.steps[-1][1].record()
            self.host_steps.append(time.perf_counter())  # when the host had launched this group or batch
            if tracer is not None and phase == "prefill" and sum(p == "prefill" for p, _ in self.steps) == 1:
                torch.cuda.synchronize()  # the first group's kernels, all of them in the trace
                tracer.stop()

        @contextmanager
        def phase(self, name: str):
            if tracer is not None and name == "prefill" and not self.traced:
                self.traced = True
                tracer.start()  # the job's first prefill group, up to its first `advance`
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            yield
            end.record()
            self.marks.append((name, start, end))

        def warn(self, message: str) -> None:
            print(f"warning: {message}", file=sys.stderr)

    cuda = args.device == "cuda"
    timeline = Timeline() if cuda else Reporter()
    compiles = compile_log(t0) if cuda else []
    sampling = sample_stacks(t0, args.sample_stacks) if args.sample_stacks else None
    tracer = None
    if args.trace and cuda:  # the first prefill group's kernels and launches (torch's profiler)
        tracer = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA])
    if cuda:
        torch.cuda.init()
        origin = torch.cuda.Event(enable_timing=True)
        origin.record()  # on an idle GPU: it runs at once, so its time is also the host's `origin_host`
        origin_host = time.perf_counter()
    opts = RunOptions(input=Path(args.input), output=Path(args.output), model=args.model, device=args.device,
                      overwrite=True, batch_rows=args.batch_rows)
    host_groups = time_prefill_on_host() if cuda else []
    swaps = contextlib.nullcontext()
    if args.fla:  # an A/B: fla_ops' functions of these swaps replaced by FLA's own ops, on every thread
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from fla_oracles import swapped

        swaps = swapped(*args.fla)
    with swaps:
        result = run_job(opts, timeline)
    phases, steps, host_steps = [], [], []
    if cuda:
        torch.cuda.synchronize()  # events of the job's phases, on the clock of `origin`
        phases = [(name, origin.elapsed_time(a) / 1000, origin.elapsed_time(b) / 1000) for name, a, b in timeline.marks]
        steps = [(name, round(origin.elapsed_time(e) / 1000, 4)) for name, e in timeline.steps]
        host_steps = [round(t - origin_host, 4) for t in timeline.host_steps]
    s = result.stats
    out = {"import_s": import_s, "process_s": time.perf_counter() - t0, "wall_s": result.wall_s,
           "load_s": result.load_s, "load_phases": result.load_phases, "warm_up": result.warm_up,
           "read_s": s.read_s, "prefill_s": s.prefill_s, "score_s": s.score_s, "capture_s": s.capture_s,
           "captures": s.captures,
           "write_s": s.write_s, "rows": s.rows, "documents": result.documents, "prefix_tokens": s.prefix_tokens,
           "branch_tokens": s.branch_tokens, "batches": s.batches, "waves": s.waves,
           "gpu_idle_between_phases_s": idle_between(phases), "phases": phases, "steps": steps,
           "host_steps": host_steps,
           "peak_gpu_bytes": result.peak_gpu, "compiles": compiles}
    out["host_groups"] = host_groups
    if cuda:  # the caching allocators' counts: a retried device allocation frees the cache after a synchronize
        device = torch.cuda.memory_stats()
        out["allocator"] = {k: device.get(k, 0) for k in ("num_alloc_retries", "num_sync_all_streams",
                                                           "num_device_alloc", "num_device_free", "num_ooms")}
        with contextlib.suppress(AttributeError, RuntimeError):
            out["allocator"].update({f"host_{k}": v for k, v in torch.cuda.host_memory_stats().items()
                                     if k.startswith("num_")})
    if tracer is not None and timeline.traced:
        tracer.export_chrome_trace(str(args.trace))
        out["first_group_kernels"] = kernel_summary(json.loads(Path(args.trace).read_text()))
    Path(args.child).write_text(json.dumps(out))
    if sampling is not None and args.logs:
        args.logs.write_text("".join(json.dumps(s) + "\n" for s in sampling()))


def time_prefill_on_host() -> list[dict]:
    """Host time of each prefill group on the job's thread, by step: its inputs (`prefill_inputs`) and each
    layer's launches (forward hooks; the last entry is the last layer's bank write). A step that waits for the
    GPU shows as one long step. Returns the list the groups are appended to."""
    import threading

    from kevscore.engine import runner as runner_module
    from kevscore.model.kev import KevModel

    groups: list[dict] = []
    main = threading.main_thread()
    inputs_of, prefill_of = runner_module.prefill_inputs, KevModel.prefill

    def timed_inputs(*args, **kwargs):
        t0 = time.perf_counter()
        out = inputs_of(*args, **kwargs)
        if threading.current_thread() is main:
            groups.append({"inputs_ms": round(1000 * (time.perf_counter() - t0), 2), "layers_ms": []})
        return out

    def timed_prefill(model, ids, ctx):
        if threading.current_thread() is not main:
            return prefill_of(model, ids, ctx)
        marks = [time.perf_counter()]
        hooks = [block.register_forward_hook(lambda *_: marks.append(time.perf_counter())) for block in model.layers]
        try:
            prefill_of(model, ids, ctx)
        finally:
            for hook in hooks:
                hook.remove()
        marks.append(time.perf_counter())
        if groups:
            groups[-1]["layers_ms"] = [round(1000 * (b - a), 2) for a, b in zip(marks, marks[1:])]

    runner_module.prefill_inputs, KevModel.prefill = timed_inputs, timed_prefill
    return groups


def host_summary(groups: list[dict]) -> str:
    """The median group after the first: its inputs' and its layers' host ms, and the slowest layers."""
    steady = [g for g in groups[1:] if g.get("layers_ms")]
    if not steady:
        return "not recorded"
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    layers = [median([g["layers_ms"][i] for g in steady if len(g["layers_ms"]) > i])
              for i in range(max(len(g["layers_ms"]) for g in steady))]
    slowest = sorted(range(len(layers)), key=lambda i: -layers[i])[:4]
    worst = max(steady, key=lambda g: max(g["layers_ms"]))
    return (f"inputs {median([g['inputs_ms'] for g in steady]):.1f} ms, layers {sum(layers):.0f} ms "
            f"(median of {len(steady)} groups); slowest layers " + ", ".join(f"{i}: {layers[i]:.1f}" for i in slowest)
            + f"; the longest step of any group: layer {worst['layers_ms'].index(max(worst['layers_ms']))} "
            f"{max(worst['layers_ms']):.0f} ms")


def kernel_summary(trace: dict, top: int = 8) -> dict:
    """From a chrome trace of a job's first prefill group: the span from its first kernel to its last, the time
    some kernel ran within it (against the span: the GPU's idle share) and the kernels that took longest."""
    kernels = sorted((e["ts"], e["dur"], e["name"]) for e in trace.get("traceEvents", [])
                     if e.get("cat") == "kernel" and "dur" in e)
    if not kernels:
        return {}
    busy, reach = 0.0, kernels[0][0]
    for ts, dur, _ in kernels:  # the union of the kernels' intervals (streams may overlap)
        busy += max(0.0, ts + dur - max(reach, ts))
        reach = max(reach, ts + dur)
    totals: dict[str, float] = {}
    for _, dur, name in kernels:
        totals[name] = totals.get(name, 0.0) + dur
    longest = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return {"span_ms": (reach - kernels[0][0]) / 1000, "busy_ms": busy / 1000, "kernels": len(kernels),
            "longest_ms": [(name[:80], round(us / 1000, 2)) for name, us in longest]}


# ---- the parent ----------------------------------------------------------------------------------------

def make_input(args, folder: Path) -> Path:
    path = folder / "job.parquet"
    cmd = [sys.executable, str(HERE / "make_long_input.py"), str(path), "--rows", str(args.rows), "--docs",
           str(args.docs), "--doc-words", str(args.doc_words), "--question-words", str(args.question_words)]
    subprocess.run(cmd, check=True, capture_output=True)
    return path


def run_start(args, start: str, data: Path, folder: Path, cache: Path) -> dict:
    """One job in a child process; `cold` starts from empty Triton, FLA, kevscore and CUDA driver caches in
    `cache` (what kernels the driver or cuDNN build at run time, a user's first job on a machine builds too)."""
    if start == "cold" and cache.exists():
        import shutil

        shutil.rmtree(cache)
    cache.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "KEVSCORE_CACHE": str(cache / "kevscore"),
           "CUDA_CACHE_PATH": str(cache / "cuda"), "PYTHONUNBUFFERED": "1"}  # the driver's compiled-kernel cache too
    report = folder / f"{start}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(report), "--input", str(data),
           "--output", str(folder / f"{start}.scores.parquet"), "--model", args.model, "--device", args.device,
           "--batch-rows", str(args.batch_rows), "--sample-stacks", str(args.sample_stacks)]
    if args.sample_stacks and args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
        cmd += ["--logs", str(args.logs / f"stacks-{start}.jsonl")]
    if args.trace_first_group:
        cmd += ["--trace", str((args.logs or folder) / f"trace-{start}.json")]
    if args.fla:
        cmd += ["--fla", *args.fla]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
        (args.logs / f"job-{start}.log").write_text(res.stdout + res.stderr)
    if res.returncode != 0:
        raise SystemExit(f"{start} job failed:\n{res.stderr[-4000:]}")
    out = json.loads(report.read_text())
    out["spawn_to_exit_s"] = time.perf_counter() - t0
    return out


def sample_rows(data: Path, docs: int, model: str, device: str = "cuda"):
    """The rows of the input's first `docs` documents, encoded as the job encodes them: (Encoded, checkpoint)."""
    import numpy as np

    from kevscore.job.rows import RowReader
    from kevscore.job.scan import scan_input
    from kevscore.model.checkpoint import load_checkpoint
    from kevscore.model.prompt import encode, load_template

    scan = scan_input(data, None)
    keep = list(dict.fromkeys(scan.doc_of_row[scan.doc_of_row >= 0].tolist()))[:docs]  # the first, in input order
    ckpt = load_checkpoint(model, device)
    table = RowReader(scan).read(np.flatnonzero(np.isin(scan.doc_of_row, keep)))
    enc = encode(table, ckpt.tokenizer, load_template(None, ckpt.tokenizer), ["Yes", "No"],
                 ckpt.config.max_position_embeddings)
    return enc, ckpt


def cache_keyword(model) -> str:
    """The forward's cache argument: `cache` from transformers 5.2x, `past_key_values` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"


def prefix_cached_call(model, enc, device, batch: int, rows=None):
    """The prefix-cached transformers baseline (calls as `kevscore.baselines.naive_call`): each document once
    into a `DynamicCache`, then its questions `batch` at a time, right-padded, from a copy of that cache
    expanded to the batch."""
    import copy

    import torch
    from transformers import DynamicCache

    from kevscore.baselines import label_logits, length_batches, padded_batch

    device, rows = torch.device(device), list(range(len(enc)) if rows is None else rows)
    keyword = cache_keyword(model)
    width = max(len(enc.label_ids[r]) for r in rows)
    by_doc: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_doc.setdefault(enc.row_prefix[r], []).append(i)
    plan = []
    for d, members in by_doc.items():
        groups = length_batches([len(enc.branches[rows[i]]) for i in members], batch)
        batches = [padded_batch([enc.branches[rows[members[j]]] for j in g],
                                [enc.label_ids[rows[members[j]]] for j in g], [members[j] for j in g],
                                len(enc.prefixes[d]), width, device) for g in groups]
        plan.append((torch.tensor([enc.prefixes[d]], device=device), batches))

    @torch.no_grad()
    def call() -> torch.Tensor:
        out = torch.empty(len(rows), width, device=device)
        for doc, batches in plan:
            cache = DynamicCache(config=model.config)
            model.model(input_ids=doc, use_cache=True, **{keyword: cache})
            for k, b in enumerate(batches):
                rows_cache = cache if k == len(batches) - 1 else copy.deepcopy(cache)
                rows_cache.reorder_cache(torch.zeros_like(b.rows))  # [1] -> [B]: every row from the document
                out[b.out] = label_logits(model, b, {keyword: rows_cache})
        return out

    return call


def baselines(args, data: Path) -> dict:
    """Rows/s of naive and prefix-cached transformers (bf16, on the GPU) on the first documents' rows."""
    import torch

    from kevscore.baselines import naive_call
    from kevscore.measure import events_ms
    from kevscore.reference import reference_model

    enc, ckpt = sample_rows(data, args.baseline_docs, args.model)
    model = reference_model(ckpt, device="cuda", dtype=torch.bfloat16)
    out = {"rows": len(enc)}
    for name, make in (("naive", naive_call), ("prefix_cached", prefix_cached_call)):
        ms = events_ms(make(model, enc, torch.device("cuda"), args.baseline_batch), reps=args.baseline_reps, warmup=1)
        out[name] = {"ms": ms, "rows_per_s": len(enc) / (statistics.median(ms) / 1000)}
    del model
    torch.cuda.empty_cache()
    return out


def scoring_budgets(args, data: Path, tflops: float) -> list[dict]:
    """The scoring phase alone at each batch budget (rows x padded branch tokens) on the rows of the input's
    first documents, prefilled once: ms, rows/s and x its matmul floor, median of 3 after a warm-up (which
    captures the budget's graphs). What `--batch-rows` (and the engine's token cap) should be."""
    import torch

    from kevscore.engine.cuda_runner import build_cuda_runner
    from kevscore.engine.pipeline import Engine, Scores
    from kevscore.engine.plan import plan_batches
    from kevscore.measure import events_ms

    enc, ckpt = sample_rows(data, args.budget_docs, args.model)
    runner = build_cuda_runner(ckpt, torch.device("cuda"), [len(p) for p in enc.prefixes], None, False)
    slot_of = Engine(runner, prefill_tokens=runner.prefill_tokens).prefill_wave(
        enc, list(range(len(enc.prefixes))), Scores.empty(0).stats)
    rows = list(range(len(enc)))
    branch_len = [len(b) for b in enc.branches]
    prefix_len = [len(enc.prefixes[d]) for d in enc.row_prefix]
    floor_ms = _bench_score().matmul_flops(ckpt.config, sum(branch_len), len(rows)) / tflops / 1e9
    out = []
    for budget in args.budgets.split(","):
        max_rows, max_tokens = map(int, budget.split("x"))
        engine = Engine(runner, max_rows=max_rows, max_tokens=max_tokens)
        scores = Scores.empty(len(rows))
        ms = statistics.median(events_ms(partial(engine.score_rows, enc, rows, slot_of, "indexed", scores),
                                         reps=3, warmup=1))
        out.append({"max_rows": max_rows, "max_tokens": max_tokens, "rows": len(rows),
                    "batches": len(plan_batches(rows, branch_len, prefix_len, max_rows, max_tokens,
                                                exact_from=runner.exact_from)),
                    "ms": ms, "rows_per_s": len(rows) / ms * 1000, "x_floor": ms / floor_ms})
    del runner
    torch.cuda.empty_cache()
    return out


def prefill_alone(args, cfg_name: str, tflops: float, doc_tokens: int) -> dict:
    """Prefill of synthetic documents of `doc_tokens` tokens through the engine's own groups: tokens/s and the
    share of the matmul roof (weight matmuls; and with attention's FLOPs too), median of 3 after a warm-up, with
    a profile by kernel group."""
    import torch

    from kevscore.engine.cuda_runner import build_cuda_runner
    from kevscore.engine.pipeline import Engine, Scores
    from kevscore.measure import events_ms
    from kevscore.model.checkpoint import load_checkpoint

    bench = _bench_score()
    ckpt = load_checkpoint(cfg_name, "cuda")
    docs = max(1, args.prefill_tokens // doc_tokens)
    enc = bench.workload(ckpt.config, docs, doc_tokens, 1, 8, seed=1)
    runner = build_cuda_runner(ckpt, torch.device("cuda"), [doc_tokens] * docs, None, False)
    engine = Engine(runner, prefill_tokens=runner.prefill_tokens)
    stats = Scores.empty(0).stats
    call = lambda: engine.prefill_wave(enc, list(range(docs)), stats)  # noqa: E731
    ms = statistics.median(events_ms(call, reps=3, warmup=1))
    tokens = docs * doc_tokens
    roof_ms = bench.prefill_flops(ckpt.config, tokens) / tflops / 1e9
    attention_ms = bench.prefill_attention_flops(ckpt.config, doc_tokens, docs) / tflops / 1e9
    out = {"doc_tokens": doc_tokens, "documents": docs, "tokens": tokens, "group_tokens": runner.prefill_tokens,
           "ms": ms, "tokens_per_s": tokens / ms * 1000, "roof_share": roof_ms / ms,
           "roof_share_with_attention": (roof_ms + attention_ms) / ms}
    if args.profile:
        out["profile_ms"] = bench.profile(call, reps=1)
    return out


def main() -> None:
    from kevscore.job.options import BATCH_ROWS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="kev-4b")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--rows", type=int, default=6000)
    ap.add_argument("--docs", type=int, default=1000)
    ap.add_argument("--doc-words", type=int, default=1000)
    ap.add_argument("--question-words", type=int, default=40)
    ap.add_argument("--batch-rows", type=int, default=BATCH_ROWS, help="the job's --batch-rows (scoring batch size)")
    ap.add_argument("--starts", default="cold,warm", help="which jobs to run: cold, warm, both or none ('')")
    ap.add_argument("--baseline-docs", type=int, default=16, help="documents whose rows the baselines score; 0: none")
    ap.add_argument("--baseline-batch", type=int, default=16)
    ap.add_argument("--baseline-reps", type=int, default=5)
    ap.add_argument("--budgets", default="32x4096,64x8192,96x12288,128x16384,192x24576",
                    help="scoring batch budgets (max rows x max padded tokens) to time alone; '' skips them")
    ap.add_argument("--budget-docs", type=int, default=128, help="documents whose rows the budgets score")
    ap.add_argument("--prefill-docs", default="1700,8192", help="document lengths of the prefill-alone runs")
    ap.add_argument("--prefill-tokens", type=int, default=131072, help="tokens per prefill-alone run")
    ap.add_argument("--profile", action="store_true", help="profile the prefill-alone runs by kernel group")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--logs", type=Path, help="keep each job's output here (e.g. with TRITON_PRINT_AUTOTUNING=1)")
    ap.add_argument("--sample-stacks", type=float, default=0.0,
                    help="sample every thread's stack each 20 ms for a job's first SECONDS, into --logs")
    ap.add_argument("--trace-first-group", action="store_true",
                    help="trace each job's first prefill group with torch's profiler (chrome trace in --logs) and "
                         "summarize its kernels: GPU busy against the group's span")
    ap.add_argument("--fla", nargs="+", default=[], choices=["conv", "solve", "wy", "prefill", "prefill-stages"],
                    help="A/B: the jobs with the fla_ops functions of these swaps run as FLA's own ops "
                         "(tests/fla_oracles.py SWAPS; the warm start is the measure, a cold one also autotunes them)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--trace", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--input", help=argparse.SUPPRESS)
    ap.add_argument("--output", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    report = run(args)
    print_table(report)


def save(args, report: dict) -> None:
    """The report so far to --json: after every section, so a run cut short keeps what it measured."""
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


def run(args) -> dict:
    from kevscore.model.config import SHAPES

    cuda = args.device == "cuda"
    skip = ("child", "input", "output", "json", "logs")
    report: dict = {"workload": {k: v for k, v in vars(args).items() if k not in skip}}
    tflops = None
    if cuda:
        import torch

        from kevscore.measure import environment

        rate = _bench_score().MatmulRate()
        tflops = statistics.median(rate.samples(20, warmup=3))
        del rate
        torch.cuda.empty_cache()
        report["environment"] = environment(torch.device("cuda"))
    report["matmul_tflops"] = tflops
    with tempfile.TemporaryDirectory(prefix="kevscore-bench-job-") as tmp:
        folder = Path(tmp)
        data = make_input(args, folder)
        starts = [s for s in STARTS if s in args.starts.split(",")]
        report["jobs"] = {s: run_start(args, s, data, folder, folder / "triton-cache") for s in starts}
        first = next(iter(report["jobs"].values()), None)
        if tflops and first and args.model in SHAPES:
            cfg = SHAPES[args.model]
            report["floor_s"] = job_floor_s(cfg, first["prefix_tokens"], first["branch_tokens"], first["rows"], tflops)
            for start, job in report["jobs"].items():
                job["x_floor"] = job["wall_s"] / report["floor_s"]["job"]
                job["prefill_roof_share"] = report["floor_s"]["prefill"] / job["prefill_s"]
                print(f"job {start}: wall {job['wall_s']:.1f} s, {job['x_floor']:.2f}x floor", flush=True)
        save(args, report)
        if cuda and args.baseline_docs:
            report["baselines"] = baselines(args, data)
            save(args, report)
        if cuda and args.budgets:
            report["budgets"] = scoring_budgets(args, data, tflops)
            save(args, report)
        if cuda and args.prefill_docs:
            report["prefill"] = []
            for n in args.prefill_docs.split(","):
                report["prefill"].append(prefill_alone(args, args.model, tflops, int(n)))
                save(args, report)
                torch.cuda.empty_cache()  # the run's model and bank, freed with its locals
    return report


def host_lead(steps: list, host_steps: list, phase: str) -> str:
    """How far the host ran ahead of the GPU in a phase whose steps are recorded when the host has launched a
    group (prefill): for each group after the first, from the host's last launch of it to the GPU's end of the
    one before (negative: the GPU finished first and waited on the host's launches, or the host on it)."""
    ms = [1000 * (gpu - host) for (p, gpu), (q, _), host in zip(steps, steps[1:], host_steps[1:]) if p == q == phase]
    if not ms:
        return "not recorded"
    ms.sort()
    return (f"min {ms[0]:.0f} ms, median {ms[len(ms) // 2]:.0f} ms, "
            f"{sum(x < 0 for x in ms)} of {len(ms)} behind the GPU")


def group_times(phases: list, steps: list) -> str:
    """The first five prefill groups' GPU times and the median of the rest, each from the end of the one before
    (or its phase's start)."""
    ms = []
    for name, start, end in phases if isinstance(phases, list) else ():
        if name == "prefill":
            ends = [t for n, t in steps if n == "prefill" and start <= t <= end]
            ms += [1000 * (b - a) for a, b in zip([start, *ends], ends)]
    if not ms:
        return "not recorded"
    rest = sorted(ms[5:])
    return (" ".join(f"{x:.0f}" for x in ms[:5]) + (f", then median {rest[len(rest) // 2]:.0f}" if rest else "")
            + f" ({len(ms)} groups)")


def print_table(r: dict) -> None:
    env = r.get("environment", {})
    w = r["workload"]
    print(f"\n{env.get('gpu', 'cpu')} | {w['model']} | {w['rows']:,} rows over {w['docs']:,} documents"
          + (f" | matmul {r['matmul_tflops']:.0f} TFLOP/s" if r.get("matmul_tflops") else ""))
    floor = r.get("floor_s")
    if floor:
        print(f"job floor {floor['job']:.1f} s (prefill {floor['prefill']:.1f} + scoring {floor['score']:.1f})")
    print(f"{'start':<6}{'wall s':>8}{'rows/s':>8}{'x floor':>8}{'load':>7}{'read':>6}{'prefill':>8}{'score':>7}"
          f"{'write':>7}{'idle':>6}{'roof':>6}")
    for name, j in r.get("jobs", {}).items():
        print(f"{name:<6}{j['wall_s']:>8.1f}{j['rows'] / j['wall_s']:>8.0f}{j.get('x_floor', float('nan')):>8.2f}"
              f"{j['load_s']:>7.1f}{j['read_s']:>6.1f}{j['prefill_s']:>8.1f}{j['score_s']:>7.1f}{j['write_s']:>7.1f}"
              f"{j['gpu_idle_between_phases_s']:>6.2f}{j.get('prefill_roof_share', float('nan')):>6.0%}")
    jobs = r.get("jobs", {})
    if "cold" in jobs and "warm" in jobs:
        print(f"first run's extra (JIT, tuning): {jobs['cold']['wall_s'] - jobs['warm']['wall_s']:.1f} s")
    for name, j in jobs.items():  # the GPU time of each prefill group: a slow start, or slow throughout
        print(f"{name} job, prefill GPU ms per group: " + group_times(j.get("phases", []), j.get("steps", []))
              + (f"; scoring's graph captures {j['capture_s']:.2f} s" if "capture_s" in j else "")
              + (f" ({j['captures']} graphs)" if "captures" in j else ""))
        if j.get("host_groups"):
            print(f"{name} job, prefill on the host: " + host_summary(j["host_groups"]))
        if j.get("allocator"):
            print(f"{name} job, allocators: " + ", ".join(f"{k} {v}" for k, v in j["allocator"].items() if v))
        if j.get("host_steps"):
            # prefill only: a scoring batch's step is recorded once the host has waited for its scores
            print(f"{name} job, host ahead of the GPU in prefill: " + host_lead(j["steps"], j["host_steps"], "prefill"))
    for name, j in jobs.items():  # Triton compiles and cache loads in the job's process, by thread
        by_thread: dict[str, list] = {}
        for _, sec, kernel, thread in j.get("compiles", []):
            by_thread.setdefault(thread, []).append((sec, kernel))
        for thread, got in by_thread.items():
            top = ", ".join(f"{k} {sec:.2f}" for sec, k in sorted(got, reverse=True)[:4])
            print(f"{name} job, {thread}: {len(got)} kernels compiled or loaded, {sum(s for s, _ in got):.1f} s ({top})")
        pre = (j.get("warm_up") or {}).get("precompile") or {}
        if pre.get("workers"):  # the warm-up's dry pass and its workers (kevscore.kernels.precompile)
            slow = ", ".join(f"{k} {took:.1f} s (met at {met:.1f})" for k, took, met in pre.get("slowest", []))
            released = pre.get("released_s")
            first = f"; prefill's {pre['first']} compiled at {released:.2f} s" if released is not None else ""
            print(f"{name} job, warm-up: dry pass {pre['dry_s']:.2f} s, {pre['workers']} workers {pre['compile_s']:.2f} s"
                  f"{first}; slowest compiles {slow}")
    for name, j in jobs.items():
        k = j.get("first_group_kernels")
        if k:
            print(f"{name} job, first prefill group traced: kernels busy {k['busy_ms']:.0f} ms of a "
                  f"{k['span_ms']:.0f} ms span ({k['kernels']} kernels); longest: "
                  + ", ".join(f"{n[:40]} {ms:.0f}" for n, ms in k["longest_ms"][:4]))
    base = r.get("baselines")
    if base:
        for name in ("naive", "prefix_cached"):
            line = f"transformers {name.replace('_', '-')}: {base[name]['rows_per_s']:.1f} rows/s ({base['rows']} rows)"
            for start, j in jobs.items():
                line += f"; kevscore {start} {j['rows'] / j['wall_s'] / base[name]['rows_per_s']:.1f}x"
            print(line)
    for b in r.get("budgets", []):
        print(f"scoring alone, {b['rows']} rows in batches of <= {b['max_rows']} rows x {b['max_tokens']} tokens "
              f"({b['batches']} batches): {b['ms']:.0f} ms, {b['rows_per_s']:.0f} rows/s, {b['x_floor']:.2f}x floor")
    for p in r.get("prefill", []):
        print(f"prefill alone, {p['documents']} x {p['doc_tokens']} tokens in groups of {p['group_tokens']}: "
              f"{p['ms']:.0f} ms, {p['tokens_per_s'] / 1000:.1f}k tokens/s, {p['roof_share']:.0%} of the roof"
              f" ({p.get('roof_share_with_attention', float('nan')):.0%} counting attention's FLOPs)")
        if "profile_ms" in p:
            prof = p["profile_ms"]
            print("  " + ", ".join(f"{g} {ms:.1f}" for g, ms in prof["groups"].items())
                  + f"; {prof['launches_per_call']:.0f} launches")


if __name__ == "__main__":
    main()
