"""The GPU made ready while a job reads its input: the CUDA context and every kernel compiled on a thread.

Getting the GPU ready while a job reads its input and loads its weights: the CUDA context and the
compilation of every GPU kernel, by a two-layer model of the job's shapes that prefills and scores a few
tiny batches on a thread. Triton keeps what it compiles, so the job's own first launches find every
kernel built (the same shapes give the same specializations); the job starts once its prefill's kernels
are, while the scoring kernels still compile. A warm cache makes this a few seconds of thread time that
the load hides."""
from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

from kevscore.model.config import FULL, LINEAR, KevConfig

# token counts whose divisibility by 16 differs (Triton specializes integer arguments on it), and the
# branch buckets of both kinds: prefill groups and scoring batches of the shapes a job meets (rows of
# one-token labels, and rows with a label of several tokens)
PREFILL_GROUPS = ([100, 64], [64, 64])
LABELLED = 90  # the branches whose first label has three tokens: batches that score several positions per row
# (rows per document, tokens): with the engine's 4 rows per batch, a batch of each of the fused WY kernel's tile
# pairs (16, 24-32, 48-64, 72-80, 88-96, 104-128 tokens), past 64 tokens at lengths divisible by 16 and not
BRANCHES = ((4, 32), (2, 24), (2, LABELLED), (2, 10), (2, 60), (2, 70), (2, 80), (2, 85), (2, 120), (2, 128))


def small_model(cfg: KevConfig) -> KevConfig:
    """The job's layer shapes in a DeltaNet layer and two attention layers (prefill skips the last layer's
    output, so the job's other attention layers need the middle one), over a small vocabulary."""
    return replace(cfg, layer_types=(LINEAR, FULL, FULL), vocab_size=min(cfg.vocab_size, 1024))


def compile_kernels(cfg: KevConfig, device: torch.device, path: str, dtype: torch.dtype | None = None,
                    triton_hashed: Callable[..., bool] = lambda wait=True: True, steps: dict | None = None,
                    release: Callable[[], None] = lambda: None) -> dict:
    """Run every kernel of a job on `path` once, at the layer shapes of `cfg` in the model's `dtype` (on a CPU:
    the torch ops). On a GPU the kernels are first compiled side by side (kevscore.kernels.precompile): `release`
    is called once the compiles of prefill's kernels have ended (the job may start its prefill then), and when
    every kernel compiled, nothing runs (the job's first launches load them); what the processes left, a pass
    here compiles before the release, or after it the job's own first launches. A GPU whose Triton cache holds
    this warm-up's finished marker (written once every kernel is there) runs nothing at all. `triton_hashed` is
    `hash_triton`'s, waited for before the first compile or cache lookup. Fills and returns `steps`: seconds by
    step."""
    from kevscore.kernels.precompile import Precompiled, precompile

    steps = {} if steps is None else steps
    attention = None
    marker = finished_marker(small_model(cfg), device, path, dtype) if device.type == "cuda" else None
    if device.type == "cuda" and dtype != torch.float32:
        attention = threading.Thread(target=long_attention, args=(cfg, device), name="kevscore-attention", daemon=True)
        attention.start()

    def released() -> None:  # the job's first prefill group runs SDPA too: not beside this thread's builds
        if attention is not None:
            attention.join()
        release()

    try:
        if marker is not None and marker.is_file():
            steps["precompile"] = asdict(Precompiled(skipped="every kernel is in Triton's cache"))
            first_calls(cfg, device, dtype or torch.bfloat16, triton_hashed)
            finished = True
        else:
            run_each_shape = shape_pass(cfg, device, path, dtype)
            with attention_stubbed(device):
                compiled = None
                if marker is not None:
                    compiled = precompile(run_each_shape, triton_hashed, lambda: triton_hashed(wait=False), released)
                    steps["precompile"] = asdict(compiled)
                triton_hashed()
                finished = compiled is not None and not compiled.skipped and compiled.compiled == compiled.kernels
                # what the workers did not compile, compiled here; once the job has started, by the job's own first
                # launches instead: a pass here would run beside its GPU work (and break its graph captures)
                if not finished and (compiled is None or compiled.released_s is None):
                    t0 = time.perf_counter()
                    steps["real_pass"] = run_each_shape()
                    steps["run_s"] = time.perf_counter() - t0
                    finished = True
    finally:  # even when the pass fails: the job's own first SDPA never runs beside this thread's
        if attention is not None:
            attention.join()
    if marker is not None and finished:
        with contextlib.suppress(OSError):
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
    return steps


def first_calls(cfg: KevConfig, device: torch.device, dtype: torch.dtype, triton_hashed: Callable[..., bool]) -> None:
    """A warm start's process-wide first calls, which would otherwise hold the job's first prefill group while
    the GPU idles (~0.4 s): the first cuBLAS GEMM (its handle) while Triton's hash is computed, then Triton's
    first kernel launch (its backend's imports, the ptxas hash, the launcher), one cached RMSNorm at the pass's
    own 128-token specialization."""
    from kevscore.kernels import fla_ops

    x = torch.zeros(1, sum(PREFILL_GROUPS[1]), cfg.hidden_size, dtype=dtype, device=device)
    torch.nn.functional.linear(x, x[0, :16])
    triton_hashed()
    fla_ops.rms_norm(x, torch.ones(cfg.hidden_size, device=device), cfg.rms_norm_eps)


def shape_pass(cfg: KevConfig, device: torch.device, path: str, dtype: torch.dtype | None) -> Callable[[], dict]:
    """The warm-up's model (`small_model`) on a runner, and the pass that runs it through every shape a job meets:
    two prefill groups, then a scoring batch of each kind (`BRANCHES`; the short ones also at their own shapes).
    The pass calls `after_prefill` between the two (what a job's first prefill group needs has been met then) and
    returns its seconds by phase."""
    from kevscore.engine.backend import build_runner, synchronize
    from kevscore.engine.pipeline import Engine, RunStats
    from kevscore.model.checkpoint import Checkpoint, random_weights
    from kevscore.model.prompt import Encoded

    small = small_model(cfg)
    ckpt = Checkpoint("warm-up", small, random_weights(small, 0, torch.bfloat16, device),
                      SimpleNamespace(pad_token_id=0, eos_token_id=0))
    runner = build_runner(ckpt, device, max(PREFILL_GROUPS, key=sum), None, True, dtype)  # holds either group
    engine = Engine(runner, max_rows=4, prefill_tokens=1 << 16)

    def run_each_shape(after_prefill: Callable[[], None] = lambda: None) -> dict:
        prefill_s = score_s = 0.0
        # each group's documents with half the kinds of branch: those of two chunks (their kernels compile slowest)
        # with the first, the others with the second; the branch kernels' specializations do not depend on the
        # documents
        encs = []
        for docs, branches in zip(PREFILL_GROUPS, ([b for b in BRANCHES if b[1] > 64], [b for b in BRANCHES if b[1] <= 64])):
            prefixes = [[1 + i % 500] * n for i, n in enumerate(docs)]
            rows = [(d, length) for d in range(len(docs)) for n, length in branches for _ in range(n)]  # (document, length)
            tails = [[(5, 6), ()] if length == LABELLED else [(), ()] for _, length in rows]
            encs.append(Encoded(prefixes, [d for d, _ in rows], [[7] * length for _, length in rows],
                                [["a", "b"]] * len(rows), [[3, 4]] * len(rows), tails))
        for enc in encs:  # both groups' prefill first, then each group's whole run
            engine.prefill_wave(enc, list(range(len(enc.prefixes))), RunStats())
        after_prefill()
        # the short branches once more at their own shapes, as a large model's batches of short questions run
        # (engine.plan.eager_tokens): one chunk's lengths that are no multiple of 16, which no bucket has and
        # Triton specializes on
        buckets = runner.exact_from
        for enc, exact_from in ((encs[0], buckets), (encs[1], buckets), (encs[1], 0)):
            runner.exact_from = exact_from
            stats = engine.run(enc, path).stats
            prefill_s, score_s = prefill_s + stats.prefill_s, score_s + stats.score_s
        runner.exact_from = buckets
        synchronize(device)
        return {"prefill_s": prefill_s, "score_s": score_s}

    return run_each_shape


def attention_stubbed(device: torch.device) -> contextlib.AbstractContextManager:
    """On this thread and a GPU, prefill attention's SDPA gives zeros in its output's shape and layout. The
    warm-up's passes would run it only at their small model's shapes, where cuDNN builds a kernel of its own
    (seconds) that no job uses; `long_attention` builds the job's. The Triton kernels around it (the output
    gate) run as in a job; other threads' calls run SDPA."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from kevscore.kernels import fla_ops
    from kevscore.kernels.precompile import on_this_thread

    return on_this_thread(fla_ops, "sdpa_causal", lambda q, k, v: torch.zeros_like(q))


def long_attention(cfg: KevConfig, device: torch.device) -> None:
    """Prefill's attention (SDPA through cuDNN) on padded batches of a few long documents and of many, at a
    length that is a multiple of 128 and one that is not: cuDNN builds a kernel at a process's first call and
    another for lengths off that multiple, which a job's documents nearly always are (perhaps also for batches
    of about 40 documents or more): seconds each, with the GIL released, so this thread does it beside the
    warm-up's compiles rather than the job's first prefill group."""
    from kevscore.kernels.fla_ops import sdpa_causal

    with contextlib.suppress(Exception):  # the job's own first group builds it then; it reports any real error
        for docs, length in ((2, 2048), (48, 500)):
            q = torch.zeros(docs, length, cfg.num_attention_heads, cfg.head_dim, device=device, dtype=torch.bfloat16)
            kv = torch.zeros(docs, length, cfg.num_key_value_heads, cfg.head_dim, device=device, dtype=torch.bfloat16)
            sdpa_causal(q, kv, kv)
        torch.cuda.synchronize(device)


def hash_triton() -> Callable[..., bool]:
    """Triton keys its cache by a hash of its own files (libtriton alone is ~500 MB), computed once per process
    at its first compile or cache lookup: 0.5-1.5 s. Hashing releases the GIL, so a thread does it while the
    job reads its input and the warm-up builds its model and records its kernels, and the forked compile
    processes inherit it. Returns `hashed(wait=True)`: whether the hash is done, after waiting for it unless
    `wait` is false."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # another Triton layout: the first compile hashes, as it would anyway
        return lambda wait=True: True
    thread = threading.Thread(target=triton_key, name="kevscore-triton-key")  # not a daemon: see prepare_device
    thread.start()

    def hashed(wait: bool = True) -> bool:
        if wait:
            thread.join()
        return not thread.is_alive()

    return hashed


def finished_marker(small: KevConfig, device: torch.device, path: str, dtype: torch.dtype | None) -> Path:
    """The file in Triton's cache that says this warm-up (its shapes, kevscore's sources and the versions it
    compiled with, the KEVSCORE_ switches that pick kernels and the TRITON_ ones that key Triton's cache) once ran
    to its end against that cache: every kernel it meets is there, and the next one runs no pass at all. Clearing
    the cache clears the marker with it."""
    import fla
    import triton

    from kevscore.measure import source_digests
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("KEVSCORE_", "TRITON_")) and k != "KEVSCORE_CACHE")
    what = [repr(small), str(device), path, str(dtype), torch.cuda.get_device_name(device), torch.__version__,
            triton.__version__, fla.__version__, sorted(source_digests().items()), env]
    digest = hashlib.sha256(repr(what).encode()).hexdigest()[:32]
    return Path(triton.knobs.cache.dir) / f"kevscore-warm-up-{digest}"


@dataclass(slots=True)
class WarmUp:
    """The warm-up thread, and its report as it goes: seconds (None until it ends), error, and the seconds of the
    context and of compile_kernels' steps."""
    thread: threading.Thread
    report: dict = field(default_factory=lambda: {"seconds": None, "error": None})
    # set once the job may start: prefill's kernels compiled (the rest compile on, in their processes), or the end
    ready: threading.Event = field(default_factory=threading.Event)

    def join(self, timeout: float) -> dict:
        """Wait until the job may start (at most `timeout` seconds); the report, which the thread fills on."""
        self.ready.wait(timeout)
        return self.report


def prepare_device(device: torch.device, cfg: KevConfig | None, path: str,
                   dtype: torch.dtype | None = None) -> WarmUp | None:
    """On a GPU, import the GPU kernels here (flash-linear-attention and Triton: seconds of Python; on this
    thread, so no import runs on two threads at once), then start the thread that makes the CUDA context
    and, given the model's config, compiles the kernels. Join it before the job's own GPU work."""
    if device.type != "cuda":
        return None
    from kevscore.engine import cuda_runner
    from kevscore.kernels import fla_ops  # noqa: F401

    cuda_runner.process_settings(dtype)  # before the thread compiles anything
    triton_hashed = hash_triton()

    def work() -> None:
        t0 = time.perf_counter()
        try:
            torch.ones(1, device=device).sum()
            warm.report["context_s"] = time.perf_counter() - t0
            if cfg is not None:
                compile_kernels(cfg, device, path, dtype, triton_hashed, warm.report, warm.ready.set)
        except Exception as exc:  # noqa: BLE001 - reported with the job's load, never fatal
            warm.report["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        finally:
            warm.report["seconds"] = time.perf_counter() - t0
            warm.ready.set()

    # not a daemon: the interpreter's exit waits for it (a small job may end first). It stops a daemon thread where
    # it stands, and one inside torch's C++ (freeing the warm-up model, say) aborts the process: "terminate called
    # without an active exception", after a complete job
    warm = WarmUp(threading.Thread(target=work, name="kevscore-warm-up"))
    warm.thread.start()
    return warm
