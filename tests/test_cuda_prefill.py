"""GPU tests (marked `cuda`) of document prefill: packed groups against one document at a time and against
FLA's whole ops, and a prefill that never waits on the GPU."""
import importlib

import pytest
import torch
from conftest import cpu_engine, gpu_engine, synthetic, transformers_states

from kevscore.engine.pipeline import Scores

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DOCS = [1, 5, 63, 64, 65, 200, 700, 129]


def entries(engine, enc, budget: int) -> tuple[torch.Tensor, ...]:
    """The bank's recurrent states, conv states and K/V after prefilling every document in groups of `budget`."""
    engine.prefill_tokens = budget
    engine.prefill_wave(enc, list(range(len(enc.prefixes))), Scores.empty(0).stats)
    bank = engine.runner.bank
    n = len(enc.prefixes)
    return (bank.state[:, :n].float().cpu(), bank.conv[:, :n].float().cpu(),
            bank.kv[:, :, :bank.used_tokens].float().cpu())


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("docs", [DOCS, [190, 200, 170, 210], [128] * 5],
                         ids=["flash-varlen", "sdpa-padded", "sdpa-equal"])
def test_packed_prefill_equals_one_document_at_a_time(tiny, docs):
    """Attention over a packed group takes flash attention (lengths far apart), SDPA on a padded batch
    (similar lengths) or SDPA on the packed tokens as they lie (equal lengths); one document alone always
    the last."""
    enc = synthetic(docs, [4])
    engine = gpu_engine(tiny, enc.prefixes)
    alone = entries(engine, enc, 1)
    for budget in (300, 1 << 16):
        packed = entries(engine, enc, budget)
        for name, a, b in zip(("state", "conv", "kv"), packed, alone):
            assert relative(a, b) < 5e-3, (name, budget, relative(a, b))


def test_fused_prefill_close_to_fla_whole_ops(tiny):
    """Our packed conv front end and the fused gated delta rule after FLA's solve, against FLA's conv +
    `chunk_gated_delta_rule` (what prefill ran before; attention alike on both sides): in bf16 both round
    differently, so each is measured against the fp32 CPU prefill, and ours may be no farther from it than
    FLA's whole ops (and close to them; tests/fla_oracles.py)."""
    from fla_oracles import swapped

    enc = synthetic(DOCS, [4])
    exact = entries(cpu_engine(tiny, docs=enc.prefixes), enc, 1 << 16)
    ours = entries(gpu_engine(tiny, enc.prefixes), enc, 1 << 16)
    with swapped("prefill"):
        theirs = entries(gpu_engine(tiny, enc.prefixes), enc, 1 << 16)
    for name, a, b, c in zip(("state", "conv", "kv"), ours, theirs, exact):
        print(f"{name}: ours {relative(a, c):.3g} from fp32, FLA's whole ops {relative(b, c):.3g}, "
              f"ours from FLA's {relative(a, b):.3g}")
        assert relative(a, c) <= 1.25 * relative(b, c) + 1e-4 and relative(a, b) < 1e-2, name


def test_prefill_never_waits_on_the_gpu(tiny):
    """Once its kernels are compiled, a packed prefill enqueues everything without one host synchronization
    (torch's sync debug mode turns any into an error)."""
    enc = synthetic(DOCS, [4])
    engine = gpu_engine(tiny, enc.prefixes)
    runner = engine.runner
    slots = [runner.bank.alloc(len(d)) for d in enc.prefixes]
    runner.bank.publish()
    runner.prefill(enc.prefixes, slots)  # compiles and tunes
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runner.prefill(enc.prefixes, slots)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_prefill_group_budget_fits_the_gpu(tiny):
    from kevscore.engine.cuda_runner import prefill_bytes_per_token
    from kevscore.model.config import SHAPES

    engine = gpu_engine(tiny, [[1] * 100])
    assert 2048 <= engine.runner.prefill_tokens <= 65536
    per_token = prefill_bytes_per_token(SHAPES["kev-4b"])
    assert 150_000 < per_token < 400_000  # the Kev-4B shape: ~270 KB of activations per token


def test_a_job_launches_no_fla_kernel(tiny, monkeypatch):
    """A prefill and scoring batches run our kernels only: FLA's autotuned kernels (which would time every
    configuration at a first launch) are the oracles' (tests/fla_oracles.py)."""
    import fla_oracles

    launched = []
    for module, kernel in fla_oracles.PINS["H200"]:
        tuner = fla_oracles.autotuner(getattr(importlib.import_module(module), kernel))
        monkeypatch.setattr(tuner, "run", lambda *args, name=kernel, **kwargs: launched.append(name))
    enc = synthetic([70, 200], [5, 90, 130])
    gpu_engine(tiny, enc.prefixes).run(enc, "indexed")
    assert launched == []


def test_warm_up_thread_compiles_the_kernels_without_error(tiny):
    from kevscore.engine.warmup import prepare_device

    warm = prepare_device(torch.device("cuda"), tiny.config, "indexed")
    report = warm.join(600)  # the job may start: its prefill's kernels are built (the rest may still compile)
    assert warm.ready.is_set()
    warm.thread.join(600)
    assert report["error"] is None and report["seconds"] is not None  # the report the thread went on filling


COLD_START = """
import json, torch, triton
from kevscore.model.config import SHAPES
from kevscore.engine.warmup import compile_kernels, shape_pass
own = []
triton.knobs.compilation.listener = lambda *, cache_hit, **_: own.append(cache_hit)
steps = compile_kernels(SHAPES["kev-0.8b"], torch.device("cuda"), "indexed")
if "real_pass" not in steps:  # a warm start runs nothing: what the job then launches must all be in the cache
    shape_pass(SHAPES["kev-0.8b"], torch.device("cuda"), "indexed", None)()
print(json.dumps({"precompile": steps["precompile"], "real_pass": "real_pass" in steps, "own_compiles": own.count(False)}))
"""


def test_a_cold_start_compiles_every_kernel_in_the_workers(tmp_path):
    """A fresh process with an empty Triton cache: the forked workers compile every kernel the warm-up model
    meets, so no real pass runs and the job's launches (the same pass, run after) compile none themselves; a
    second process skips the workers."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    out = subprocess.run([sys.executable, "-c", COLD_START], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    pre = report["precompile"]
    assert pre["skipped"] is None and pre["kernels"] >= 10 and pre["compiled"] == pre["kernels"], pre
    assert report["own_compiles"] == 0 and not report["real_pass"], report
    # the next process finds the first one's marker: no pass at all, and the job's own launches compile nothing
    again = subprocess.run([sys.executable, "-c", COLD_START], env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    report = json.loads(again.stdout.strip().splitlines()[-1])
    assert report["precompile"]["skipped"] == "every kernel is in Triton's cache" and not report["real_pass"], report
    assert report["own_compiles"] == 0, report


def test_a_first_job_waits_for_its_warm_up_to_end(tmp_path):
    """`kevscore run` on the demo task in a fresh process with an empty Triton cache: the small job may end while
    the warm-up still compiles or runs its pass; the process waits for it and exits cleanly (a daemon thread
    stopped inside torch's C++ at the interpreter's exit aborts the process), and the warm-up's finished marker
    is in the cache."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    cache = tmp_path / "triton"
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache))
    out = subprocess.run([sys.executable, "-m", "kevscore", "run", str(root / "examples" / "demo-task.parquet"),
                          "--device", "cuda", "-o", str(tmp_path / "scores.parquet"), "--quiet"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "terminate" not in out.stderr, (out.returncode, out.stderr[-2000:])
    assert list(cache.glob("kevscore-warm-up-*")), "the warm-up did not run to its end"


def test_gpu_prefill_close_to_transformers_states(tiny):
    """The GPU's packed bf16 prefill against transformers' own fp32 cache after each document (CPU)."""
    enc = synthetic([1, 5, 70, 300], [4])
    engine = gpu_engine(tiny, enc.prefixes)
    slot_of = engine.prefill_wave(enc, list(range(4)), Scores.empty(0).stats)
    bank = engine.runner.bank
    for d, doc in enumerate(enc.prefixes):
        states, convs, kvs = transformers_states(tiny, doc)
        slot, start = slot_of[d], bank.entry_start(slot_of[d])
        ours = [bank.state[:, slot].float().cpu(), bank.conv[:, slot].float().cpu(),
                bank.kv[:, :, start:start + len(doc)].float().cpu()]
        for name, a, b in zip(("state", "conv", "kv"), ours, map(torch.stack, (states, convs, kvs))):
            assert relative(a, b) < 0.05, (name, len(doc), relative(a, b))


def test_prefill_seconds_hold_its_gpu_work_queued_past_its_launches(tiny, monkeypatch):
    """Prefill returns with its work queued and scoring launches behind it; the scoring's closing synchronize
    charges prefill, not scoring, the GPU seconds that ran past prefill's launches."""
    import contextlib
    import time

    from kevscore.engine.pipeline import Reporter

    enc = synthetic([70, 200], [5, 90])
    engine = gpu_engine(tiny, enc.prefixes)
    engine.run(enc, "indexed")  # the buckets captured, every kernel loaded
    prefill = engine.runner.prefill

    def slow_prefill(*args):
        prefill(*args)
        torch.cuda._sleep(500_000_000)  # ~0.25 s of GPU time at the H200's ~2 GHz, queued behind the group

    class Clock(Reporter):
        def phase(self, name: str):
            entered[name] = time.perf_counter()
            return contextlib.nullcontext()

    entered = {}
    monkeypatch.setattr(engine.runner, "prefill", slow_prefill)
    t0 = time.perf_counter()
    stats = engine.run(enc, "indexed", Clock()).stats
    wall = time.perf_counter() - t0
    assert stats.prefill_s > 0.2 and stats.score_s < stats.prefill_s / 2, stats
    assert stats.prefill_s + stats.score_s <= wall + 1e-3, (stats, wall)
    assert entered["score"] - t0 < stats.prefill_s - 0.1  # scoring began on the host while the GPU still slept
