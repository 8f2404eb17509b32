"""The parallel compile of a run's Triton kernels (kevscore.kernels.precompile), on a CPU: Triton compiles for
an sm90 target without a GPU, so the dry pass's record, the forked workers and Triton's cache are all real;
only the launch that a GPU run would make is simulated (the call Triton's launcher makes on a miss)."""
from __future__ import annotations

import time

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile, make_backend  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from kevscore.kernels import precompile as pc  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


@triton.jit
def _double(x, y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n) * 2, mask=i < n)


@triton.jit
def _broken(x, y, n, BLOCK: tl.constexpr):
    tl.static_assert(BLOCK < 0)


def launch_miss(block: int, kernel=_double) -> None:
    """What Triton's launcher does when `kernel` at this BLOCK is in no cache: ask `_do_compile` for it."""
    backend = make_backend(TARGET)
    kernel.device_caches[0] = ({}, {}, TARGET, backend, None)
    signature = {"x": "*fp32", "y": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    kernel._do_compile(("key", block), signature, 0, {(3,): block}, backend.parse_options({"num_warps": 4}), {},
                       False)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    return tmp_path / "triton"


def test_workers_compile_what_the_dry_pass_met_into_tritons_cache(cache):
    report = pc.precompile(lambda: [launch_miss(b) for b in (128, 256, 128)])
    assert report.skipped is None, report.skipped
    assert (report.kernels, report.compiled) == (2, 2) and report.workers >= 1
    # each compile's seconds, and when the dry pass met its kernel
    assert [name for name, _, _ in report.slowest] == ["_double", "_double"]
    assert all(0 < took <= report.compile_s + 1e-3 and 0 <= met <= report.dry_s + 1e-3  # (rounded to 1 ms)
               for _, took, met in report.slowest)
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 2  # one cache group per specialization
    assert JITFunction._do_compile.__name__ == "_do_compile"  # Triton's own again after the pass
    hits = []
    backend = make_backend(TARGET)
    import triton as tr
    tr.knobs.compilation.listener = lambda *, cache_hit, **_: hits.append(cache_hit)
    try:
        compile(ASTSource(_double, {"x": "*fp32", "y": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {(3,): 256}, {}),
                target=TARGET, options=backend.parse_options({"num_warps": 4}).__dict__)
    finally:
        tr.knobs.compilation.listener = None
    assert hits == [True]  # the run finds the workers' kernel


def test_another_threads_launches_compile_during_the_dry_pass(cache, monkeypatch):
    """The job's thread may launch while the warm-up's dry pass records: its kernels go to Triton's compile."""
    import threading

    compiled = []  # what reached Triton's own _do_compile (here a stand-in: no GPU to compile for in-process)
    monkeypatch.setattr(JITFunction, "_do_compile", lambda self, key, *args: compiled.append(key))

    def dry_run() -> None:
        launch_miss(128)
        other = threading.Thread(target=launch_miss, args=(512,))
        other.start()
        other.join()

    report = pc.precompile(dry_run)
    assert report.skipped is None and report.kernels == 1  # the dry pass's own kernel only
    assert compiled == [("key", 512)]


def test_another_threads_launch_of_a_kernel_a_process_compiles_waits_for_it(cache, monkeypatch):
    """A job released before the compiles end, launching a kernel a process is compiling: it waits for that
    process and finds the kernel in Triton's cache, rather than compiling it a second time beside it."""
    import threading

    in_cache = []  # at each launch that reached Triton's own _do_compile (a stand-in: no GPU to compile for here)
    monkeypatch.setattr(JITFunction, "_do_compile",
                        lambda self, key, *args: in_cache.append(any(p.is_dir() for p in cache.glob("*"))))
    job = threading.Thread(target=launch_miss, args=(128,))

    def dry_run(mark) -> None:
        mark()  # nothing the job needs first: released at once
        launch_miss(128)
        job.start()

    report = pc.precompile(dry_run, released=lambda: None)
    job.join(60)
    assert report.compiled == 1 and in_cache == [True]
    assert JITFunction._do_compile.__name__ == "<lambda>"  # the stand-in again after the compiles


def test_a_failing_dry_pass_or_an_autotuner_to_time_ends_it_with_a_reason(cache):
    def boom():
        raise ValueError("no such shape")

    assert pc.precompile(boom).skipped == "dry pass: ValueError: no such shape"
    tuner = Autotuner.__new__(Autotuner)
    tuner.configs, tuner.fn = [triton.Config({}), triton.Config({})], _double
    report = pc.precompile(lambda: tuner.run())
    assert report.skipped.startswith("dry pass: Unpinned") and report.kernels == 0
    assert Autotuner.run.__name__ == "run"
    assert pc.precompile(lambda: None).skipped == "no kernels to compile"


def test_a_kernel_the_workers_cannot_compile_is_left_to_the_run(cache):
    report = pc.precompile(lambda: (launch_miss(64, _broken), launch_miss(64)))
    assert (report.kernels, report.compiled, report.skipped) == (2, 1, None)


def test_before_fork_runs_once_before_the_first_compile_process(cache):
    order = []
    report = pc.precompile(lambda: (order.append("dry"), launch_miss(128), launch_miss(256)),
                           lambda: order.append("before fork"))
    assert order == ["dry", "before fork"] and report.compiled == 2
    order.clear()
    pc.precompile(lambda: order.append("dry"), lambda: order.append("before fork"))
    assert order == ["dry"]  # nothing to compile: no process, nothing to prepare for one
    order.clear()  # not ready during the pass: its kernels wait, and the pass goes on
    report = pc.precompile(lambda: (launch_miss(128), order.append("dry")), lambda: order.append("before fork"),
                           ready=lambda: False)
    assert order == ["dry", "before fork"] and report.compiled == 1


def test_a_kernel_compiles_while_the_dry_pass_goes_on(cache):
    """The process for a kernel is forked when the pass meets it: its result reaches Triton's cache before
    the pass ends."""
    seen = []

    def dry_run() -> None:
        launch_miss(128)
        deadline = time.perf_counter() + 60
        while not any(p.is_dir() for p in cache.glob("*")) and time.perf_counter() < deadline:
            time.sleep(0.05)
        seen.append(any(p.is_dir() for p in cache.glob("*")))

    report = pc.precompile(dry_run)
    assert seen == [True] and report.compiled == 1


def test_kernels_past_the_free_slots_wait_for_one(cache, monkeypatch):
    monkeypatch.setattr(pc, "workers_for", lambda: 1)
    report = pc.precompile(lambda: [launch_miss(b) for b in (32, 64, 128)])
    assert (report.kernels, report.compiled, report.workers) == (3, 3, 1)
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 3


def test_queued_kernels_compile_longest_first(cache, tmp_path, monkeypatch):
    """Kernels met while no process may start (one slot, not ready) start, once it frees, longest source first."""
    started = tmp_path / "started"

    def note(i, kernel, results):
        with started.open("a") as f:
            f.write(f"{kernel[0].fn.__name__}:{kernel[2][(3,)]}\n")
        results.put((i, 0.01))

    monkeypatch.setattr(pc, "workers_for", lambda: 1)
    monkeypatch.setattr(pc, "_compile_one", note)
    report = pc.precompile(lambda: (launch_miss(64, _broken), launch_miss(64), launch_miss(128)), ready=lambda: False)
    assert report.compiled == 3 and len(_double.src) > len(_broken.src)
    assert started.read_text().split() in (["_double:64", "_double:128", "_broken:64"],
                                           ["_double:128", "_double:64", "_broken:64"])


def test_kernels_met_before_the_mark_compile_first_and_release_the_caller(cache, tmp_path, monkeypatch):
    """What the dry pass met before it called `mark` (a warm-up: prefill's kernels) compiles first; `released` is
    called once those have ended, before the rest start."""
    started = tmp_path / "started"

    def note(i, kernel, results):
        with started.open("a") as f:
            f.write(f"{kernel[0].fn.__name__}:{kernel[2][(3,)]}\n")
        results.put((i, 0.01))

    def dry_run(mark) -> None:
        launch_miss(64)
        mark()
        launch_miss(64, _broken)
        launch_miss(128)

    def released() -> None:
        with started.open("a") as f:
            f.write("released\n")

    monkeypatch.setattr(pc, "workers_for", lambda: 1)
    monkeypatch.setattr(pc, "_compile_one", note)
    t0 = time.perf_counter()
    report = pc.precompile(dry_run, ready=lambda: False, released=released)
    assert report.compiled == 3 and report.first == 1 and 0 < report.released_s < time.perf_counter() - t0
    assert started.read_text().split() == ["_double:64", "released", "_double:128", "_broken:64"]
    started.unlink()
    assert pc.precompile(lambda mark: mark(), released=released).skipped == "no kernels to compile"
    assert started.read_text().split() == ["released"]  # nothing to wait for


def test_the_caller_is_released_only_once_the_dry_pass_has_ended(cache, monkeypatch):
    """The kernel met before the mark has compiled long before the dry pass ends, but the caller is released
    only after it: the pass's own torch ops run on the GPU, beside which a job's graph captures would fail."""
    events = []

    def dry_run(mark) -> None:
        launch_miss(64)
        mark()
        time.sleep(0.5)  # the compile of the kernel met before the mark ends meanwhile
        launch_miss(128)
        events.append("pass ended")

    monkeypatch.setattr(pc, "_compile_one", lambda i, kernel, results: results.put((i, 0.01)))
    report = pc.precompile(dry_run, released=lambda: events.append("released"))
    assert events == ["pass ended", "released"] and report.compiled == 2


def test_triton_hashes_its_files_on_a_thread():
    """The warm-up's thread fills Triton's once-per-process cache key, which every compile then reads."""
    from triton.runtime.cache import triton_key

    from kevscore.engine.warmup import hash_triton

    triton_key.cache_clear()
    hash_triton()()  # start, then wait
    assert triton_key.cache_info().currsize == 1


def test_patches_of_overlapping_threads_end_in_any_order():
    """Two threads' blocks on one attribute, ended first-in first-out: each thread sees its own replacement,
    others the original, and afterwards the attribute is its own object again, for any thread."""
    import threading
    import types

    owner = types.SimpleNamespace(f=lambda: "original")
    own = owner.f
    entered, release, seen = threading.Barrier(2), {0: threading.Event(), 1: threading.Event()}, {}

    def hold(i: int) -> None:
        with pc.on_this_thread(owner, "f", lambda: f"thread {i}") as original:
            assert original is own
            entered.wait()
            seen[i] = owner.f()
            release[i].wait()

    threads = [threading.Thread(target=hold, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    while len(seen) < 2:
        threading.Event().wait(0.01)
    assert owner.f() == "original"  # this thread holds no block
    release[0].set()  # the first to enter ends first
    threads[0].join()
    assert owner.f() == "original" and seen == {0: "thread 0", 1: "thread 1"}
    release[1].set()
    threads[1].join()
    assert owner.f is own
