"""`kevscore compare`: the gathered and indexed paths timed against each other and checked for parity.

Both paths run on the same weights, inputs and device, in one process, timed in alternating order and
checked for exact parity.

A case is a workload (documents, rows) and a prefix temperature: the share of its documents the timed call
finds in the bank. `warm` cases time scoring alone; in `cold` and `mixed` cases the timed call first
prefills the others again (into the same slots every time), then scores.
"""
from __future__ import annotations

import math
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

from kevscore.baselines import naive_call
from kevscore.durable import write_atomic, write_json
from kevscore.engine.backend import build_runner, resolve_device, resolve_dtype
from kevscore.engine.pipeline import Engine, RunStats, Scores
from kevscore.errors import KevscoreError, KevscoreFailure, rows_phrase
from kevscore.job.data import argmax, read_input
from kevscore.measure import environment, events_ms, timed
from kevscore.model.checkpoint import load_checkpoint, model_directory
from kevscore.model.prompt import Encoded, encode, first_and_tails, label_token_ids, load_template
from kevscore.reference import reference_model

PATHS = ("gathered", "indexed")
TEMPERATURES = {"cold": 0.0, "mixed": 0.5, "warm": 1.0}
CASES = ("shared", "distinct", "padded", "long-branch", "long-document", *TEMPERATURES)


@dataclass(frozen=True, slots=True)
class CaseSpec:
    name: str
    docs: int
    doc_len: int
    questions: int          # rows per document
    q_len: tuple[int, int]  # branch tokens, inclusive range
    warm: float             # share of the documents prefilled before the timed call
    seed: int


def case_specs(small: bool) -> dict[str, CaseSpec]:
    """The synthetic cases; `small` (the CPU) keeps their structure at a size a CPU runs in seconds."""
    doc, q, long_q = (48, 12, (40, 80)) if small else (1024, 64, (256, 512))
    specs = [CaseSpec("shared", 16, doc, 6, (q, q), 1.0, 1),
             CaseSpec("distinct", 24 if small else 96, doc, 1, (q, q), 1.0, 2),
             CaseSpec("padded", 13, doc, 7, (q, q), 1.0, 3),  # 91 rows: fits no row bucket
             CaseSpec("long-branch", 4 if small else 8, doc, 4, long_q, 1.0, 4),
             # many questions on each long document: every row reads its document's K/V (issue 21's W2 shape)
             CaseSpec("long-document", 4 if small else 8, 192 if small else 8192, 12, (q, q), 1.0, 6)]
    specs += [CaseSpec(t, 16, doc, 6, (q, q), w, 5) for t, w in TEMPERATURES.items()]
    return {s.name: s for s in specs}


def synthetic(spec: CaseSpec, vocab: int, label_ids: list[list[int]]) -> Encoded:
    """The case's random documents and questions, labelled Yes and No (`label_ids`: their tokens)."""
    rng = random.Random(spec.seed)
    tokens = lambda n: [rng.randrange(100, min(vocab, 1200)) for _ in range(n)]  # noqa: E731
    prefixes = [tokens(spec.doc_len) for _ in range(spec.docs)]
    rows = [d for d in range(spec.docs) for _ in range(spec.questions)]
    branches = [tokens(rng.randint(*spec.q_len)) for _ in rows]
    firsts, tails = first_and_tails(label_ids)
    return Encoded(prefixes, rows, branches, [["Yes", "No"]] * len(rows), [firsts] * len(rows),
                   [tails] * len(rows) if any(tails) else None)


@dataclass(slots=True)
class CaseResult:
    name: str
    definition: dict
    rows: int
    documents: int
    prefilled_in_call: int
    latency_ms: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PATHS})
    wall_s: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PATHS})
    warmup_s: dict[str, float] = field(default_factory=dict)
    capture_s: float = 0.0
    max_abs_diff: float | None = 0.0           # None: a path's probabilities are not finite
    non_finite: list[str] = field(default_factory=list)  # the paths whose probabilities are not all finite
    flips: int = 0
    bank_unchanged: bool = True
    hf_ms: list[float] | None = None
    fp32_ms: list[float] | None = None          # the fp32 baseline's timed calls (indexed path)
    fp32_max_abs_diff: float | None = None      # max |p_bf16 - p_fp32| over the rows (indexed path)
    fp32_flipped: list[int] | None = None       # rows whose prediction differs between bf16 and fp32

    @property
    def parity(self) -> bool:
        return self.flips == 0 and self.max_abs_diff == 0.0 and self.bank_unchanged and not self.non_finite

    def summary(self) -> dict:
        out = {p: {"median_ms": statistics.median(self.latency_ms[p]), "p10_ms": float(np.quantile(self.latency_ms[p], 0.1)),
                   "p90_ms": float(np.quantile(self.latency_ms[p], 0.9)),
                   "rows_per_s": self.rows / statistics.median(self.wall_s[p])} for p in PATHS}
        g, i = out["gathered"], out["indexed"]
        out |= {"indexed_over_gathered": i["median_ms"] / g["median_ms"], "parity": self.parity,
                "spread_overlap": i["p10_ms"] <= g["p90_ms"] and g["p10_ms"] <= i["p90_ms"]}
        for base in ("hf", "fp32"):
            if samples := getattr(self, f"{base}_ms"):
                out[f"{base}_median_ms"] = statistics.median(samples)
                out[f"{base}_over_indexed"] = out[f"{base}_median_ms"] / i["median_ms"]
        return out


def case_call(engine: Engine, enc: Encoded, warm: float) -> tuple[Callable[[str], None], dict[str, Scores]]:
    """A case's timed call on `engine` (`path` -> its scores into the dict returned beside it): the case's documents
    are prefilled into the bank as one wave; each call prefills again all but the `warm` share of them (into the
    same slots every time), then scores every row."""
    docs = list(range(len(enc.prefixes)))
    n_warm = round(warm * len(docs))
    stats, rows, scores = RunStats(), list(range(len(enc))), {p: Scores.empty(len(enc)) for p in PATHS}
    slot_of = engine.prefill_wave(enc, docs, stats)

    def call(path: str) -> None:
        if n_warm < len(docs):
            engine.prefill_into(enc, docs[n_warm:], slot_of, stats)
        engine.score_rows(enc, rows, slot_of, path, scores[path])

    return call, scores


def finite(probs: list[list[float]]) -> bool:
    return all(math.isfinite(x) for pr in probs for x in pr)


def differences(a: list[list[float]], b: list[list[float]]) -> tuple[float | None, list[int]]:
    """(max |pa - pb| over every row's probabilities, None (never parity) with a NaN/inf; the rows whose
    prediction differs)."""
    diff = max((abs(x - y) for pa, pb in zip(a, b) for x, y in zip(pa, pb)), default=0.0)
    return diff if finite(a) and finite(b) else None, [r for r, (pa, pb) in enumerate(zip(a, b)) if argmax(pa) != argmax(pb)]


def run_case(engine: Engine, name: str, enc: Encoded, warm: float, definition: dict, reps: int, warmup: int,
             hf: Callable[[Encoded], Callable[[], torch.Tensor]] | None = None, hf_reps: int = 3,
             log: Callable[[str], None] = lambda s: None, fp32: Engine | None = None) -> CaseResult:
    """The case on both paths (warm-up, then `reps` alternating timed calls, parity, the bank unchanged),
    then its baselines: transformers (`hf`) timed, and the model in fp32 (`fp32`: an engine of the same
    weights) timed on the indexed path and compared with it."""
    runner, device = engine.runner, engine.runner.device
    call, scores = case_call(engine, enc, warm)
    res = CaseResult(name, definition, len(enc), len(enc.prefixes), len(enc.prefixes) - round(warm * len(enc.prefixes)))
    first = "warm-up and graph capture" if device.type == "cuda" else "warm-up"
    for p in PATHS:  # first calls capture each path's graphs; warm-up is reported apart from latency
        log(f"{name}: {first}, {p} path ({max(warmup, 1)} calls)")
        res.warmup_s[p] = timed(lambda p=p: [call(p) for _ in range(max(warmup, 1))], device)[1]
    res.capture_s = sum(scores[p].stats.capture_s for p in PATHS)  # the warm-up's calls are all the scores had
    snapshot = [t.clone() for t in runner.bank.used()]
    log(f"{name}: timing {reps} calls per path, alternating")
    for i in range(reps):
        for p in (PATHS if i % 2 == 0 else PATHS[::-1]):  # A B, B A, A B, ...
            ms, wall = timed(lambda p=p: call(p), device)
            res.latency_ms[p].append(ms)
            res.wall_s[p].append(wall)
    res.bank_unchanged = all(torch.equal(a, b) for a, b in zip(snapshot, runner.bank.used()))
    del snapshot
    res.max_abs_diff, flipped = differences(scores["gathered"].probs, scores["indexed"].probs)
    res.flips = len(flipped)
    res.non_finite = [p for p in PATHS if not finite(scores[p].probs)]
    if hf is not None:
        log(f"{name}: transformers baseline ({hf_reps} calls)")
        res.hf_ms = events_ms(hf(enc), hf_reps, 1, device)
    if fp32 is not None:
        log(f"{name}: fp32 baseline ({hf_reps} calls)")
        fp32_call, base = case_call(fp32, enc, warm)
        res.fp32_ms = events_ms(lambda: fp32_call("indexed"), hf_reps, 1, device)  # the warm-up captures graphs
        res.fp32_max_abs_diff, res.fp32_flipped = differences(base["indexed"].probs, scores["indexed"].probs)
    return res


@dataclass(slots=True)
class CompareOptions:
    model: str = "demo"
    data: Path | None = None
    documents: Path | None = None
    cases: list[str] | None = None
    reps: int = 15
    warmup: int = 3
    device: str = "auto"
    batch_rows: int = 64
    baseline: str | None = None
    json_path: Path | None = None
    plot: Path | None = None


def _check(opts: CompareOptions) -> list[str]:
    if opts.reps < 1 or opts.warmup < 0:
        raise KevscoreError(f"--reps {opts.reps} --warmup {opts.warmup}: need reps >= 1 and warmup >= 0")
    if opts.baseline not in (None, "hf", "fp32"):  # transformers timed; the model in fp32 timed and compared
        raise KevscoreError(f"--baseline {opts.baseline}: choose hf or fp32")
    if opts.batch_rows < 1:
        raise KevscoreError(f"--batch-rows {opts.batch_rows}: must be at least 1")
    allowed = tuple(TEMPERATURES) if opts.data else CASES
    cases = opts.cases or list(allowed)
    if bad := [c for c in cases if c not in allowed]:
        why = "with --data, the cases are the prefix temperatures" if opts.data else "choose among"
        raise KevscoreError(f"--cases {','.join(bad)}: {why} {', '.join(allowed)}")
    if opts.documents and not opts.data:
        raise KevscoreError(f"--documents {opts.documents}: goes with --data (the rows it holds the documents of)")
    _check_outputs(opts)
    return list(dict.fromkeys(cases))


def _same(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))


def _check_outputs(opts: CompareOptions) -> None:
    """Refuse, before any work, a --json/--plot that is an input (--data, --documents, inside the model's
    directory), a directory, in no folder, or the file the other option names."""
    try:
        model = model_directory(opts.model, download=False)
    except KevscoreError:
        model = None  # the load reports it
    outs = {flag: Path(p) for flag, p in (("--json", opts.json_path), ("--plot", opts.plot)) if p is not None}
    for flag, path in outs.items():
        if not path.parent.is_dir():
            raise KevscoreError(f"{flag} {path}: its folder does not exist")
        if path.is_dir():
            raise KevscoreError(f"{flag} {path}: is a directory; choose a file name")
        for src_flag, src in (("--data", opts.data), ("--documents", opts.documents)):
            if src is not None and _same(path, Path(src)):
                raise KevscoreError(f"{flag} {path}: is the {src_flag} input; choose another file")
        if model is not None and path.resolve().is_relative_to(model.resolve()):
            raise KevscoreError(f"{flag} {path}: is inside the model's directory {model}; choose another file")
    if len(outs) == 2 and _same(*outs.values()):
        raise KevscoreError(f"--json and --plot both name {outs['--json']}: choose two files")


def compare(opts: CompareOptions, log: Callable[[str], None] = lambda s: None) -> dict:
    """Run the cases; returns the report (also written to `opts.json_path` when given)."""
    cases = _check(opts)
    device = resolve_device(opts.device)
    if opts.baseline == "fp32" and device.type != "cuda":
        raise KevscoreError("--baseline fp32: the CPU runs fp32 already; it compares a GPU's bf16 with fp32 "
                            "(--device cuda)")
    load_before = os.getloadavg()[0]
    log(f"loading {opts.model} on {device.type}")
    ckpt = load_checkpoint(opts.model, device)
    small = device.type != "cuda"
    workloads = _workloads(opts, ckpt, cases, small)
    first = next(iter(workloads.values()))[0]  # the transformers baseline reads each row's label logits at its last token
    if opts.baseline == "hf" and (several := [r for r in range(len(first)) if not first.one_token_labels(r)]):
        raise KevscoreError(f"{Path(opts.data).name if opts.data else 'compare'}: --baseline hf times labels of one "
                            f"token; labels of several tokens at {rows_phrase(several)}")
    doc_tokens = [len(p) for enc, _, _ in workloads.values() for p in enc.prefixes]
    t0 = time.perf_counter()
    engine = Engine(build_runner(ckpt, device, doc_tokens), max_rows=opts.batch_rows)
    fp32 = None if opts.baseline != "fp32" else Engine(  # the same weights in fp32, beside the bf16 model
        build_runner(ckpt, device, doc_tokens, dtype=torch.float32), max_rows=opts.batch_rows)
    load_s = time.perf_counter() - t0
    hf = None if opts.baseline != "hf" else partial(  # the transformers baseline's call on a case's rows
        naive_call, reference_model(ckpt, str(device), resolve_dtype("auto", device)), device=device, batch=16)
    results = []
    for k, c in enumerate(cases, start=1):
        enc, warm, definition = workloads[c]
        log(f"case {k}/{len(cases)} {c}: {len(enc)} rows, {len(enc.prefixes)} documents")
        results.append(run_case(engine, c, enc, warm, definition, opts.reps, opts.warmup, hf,
                                hf_reps=min(opts.reps, 3), log=log, fp32=fp32))
    report = {"kind": "kevscore compare", "timer": "cuda-events" if device.type == "cuda" else "cpu-wall-clock",
              "model": ckpt.name, "options": {"reps": opts.reps, "warmup": opts.warmup, "batch_rows": opts.batch_rows,
                                              "baseline": opts.baseline, "small_cases": small},
              "environment": environment(device) | {"load_average": [load_before, os.getloadavg()[0]]},
              "load_s": load_s, "cases": [asdict(r) | {"summary": r.summary()} for r in results],
              "parity": all(r.parity for r in results)}
    report["warnings"] = spread_warnings(report)
    if opts.json_path:
        write_json(Path(opts.json_path), report, indent=1)
    if opts.plot:
        plot(report, Path(opts.plot))
    if both := [r.name for r in results if len(r.non_finite) == len(PATHS)]:
        raise KevscoreFailure(f"{', '.join(both)}: both paths' probabilities are non-finite (the model produced "
                              "NaN/inf): parity cannot be judged; check the model's weights")
    return report


def _workloads(opts: CompareOptions, ckpt, cases: list[str], small: bool) -> dict[str, tuple[Encoded, float, dict]]:
    """Per case: its encoded rows, its warm-up share and what defines it (the --data rows, else synthetic)."""
    if not opts.data:
        labels = label_token_ids(ckpt.tokenizer, ["Yes", "No"], "compare")
        specs = case_specs(small)
        return {c: (synthetic(specs[c], ckpt.config.vocab_size, labels), specs[c].warm, asdict(specs[c])) for c in cases}

    enc = encode(read_input(Path(opts.data), Path(opts.documents) if opts.documents else None), ckpt.tokenizer,
                 load_template(None, ckpt.tokenizer), ["Yes", "No"], ckpt.config.max_position_embeddings)
    if not len(enc):
        raise KevscoreError(f"--data {opts.data}: no rows to compare")
    return {c: (enc, TEMPERATURES[c], {"data": Path(opts.data).name, "rows": len(enc),
                                       "documents": len(enc.prefixes), "warm": TEMPERATURES[c]}) for c in cases}


def spread_warnings(report: dict) -> list[str]:
    """Why a ratio may not be trusted: the two paths' p10-p90 ranges overlap, or the machine was busy
    (a load average, before or after, of at least half its cores)."""
    out = [f"case {c['name']}: the paths' p10-p90 latencies overlap, so its ratio "
           f"{c['summary']['indexed_over_gathered']:.3f} is within the noise"
           for c in report["cases"] if c["summary"]["spread_overlap"]]
    cores = os.cpu_count() or 1
    if (load := max(report["environment"]["load_average"])) >= cores / 2:
        out.append(f"this machine was busy (load average {load:.1f} on {cores} cores): timings vary between runs; "
                   "compare again on an idle machine")
    return out


def plot(report: dict, path: Path) -> None:
    """Latency distributions per case and path, one panel per case."""
    try:
        from matplotlib.figure import Figure  # a figure of its own: no pyplot state, no backend to choose
    except ImportError as exc:
        raise KevscoreError("--plot needs matplotlib: pip install 'kevscore[plot]'") from exc

    cases = report["cases"]
    fig = Figure(figsize=(2.6 * len(cases) + 1, 3.6))
    axes = fig.subplots(1, len(cases), squeeze=False)
    for ax, case in zip(axes[0], cases):
        data = [case["latency_ms"][p] for p in PATHS]
        ax.boxplot(data, showfliers=True)
        ax.set_xticks([1, 2], list(PATHS))
        for i, d in enumerate(data, start=1):
            ax.scatter([i] * len(d), d, s=6, alpha=0.5)
        ax.set_title(f"{case['name']} ({case['rows']} rows)\nindexed / gathered "
                     f"{case['summary']['indexed_over_gathered']:.3f}", fontsize=9)
    axes[0][0].set_ylabel("GPU ms (CUDA events)" if report["timer"] == "cuda-events" else "CPU ms (wall clock)")
    fig.suptitle(f"kevscore compare · {report['model']} · {report['environment'].get('gpu', 'CPU')}", fontsize=10)
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110))
