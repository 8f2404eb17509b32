"""A run's Triton kernels compiled side by side in forked workers before the run launches them.

Triton kernels compiled side by side: a dry pass of a run records every kernel it would compile (nothing
is compiled or launched), forked worker processes compile them into Triton's cache, and the run itself
then finds each one there.

Triton compiles one kernel at a time and holds the GIL while it does, so a cold start compiles ~40 kernels
in a row; the workers spread them over the CPU's cores. Everything here is an optimization: a kernel the
workers could not compile is compiled by the run as usual, and any surprise ends the dry pass early.
"""
from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import threading
import time
from typing import Callable

# the kernels the dry pass met, read by the forked workers from their copy of this process's memory
_PENDING: list[tuple] = []


class Unpinned(RuntimeError):
    """The dry pass met an autotuner with several configurations: timing them needs real launches."""


@dataclasses.dataclass(slots=True)
class Precompiled:
    kernels: int = 0        # specializations the dry pass met
    compiled: int = 0       # of those, compiled (or found in the cache) by the workers
    workers: int = 0
    dry_s: float = 0.0      # the dry pass
    compile_s: float = 0.0  # the workers, start to end
    skipped: str | None = None  # why there was no parallel compilation
    # the slowest compiles: (kernel, seconds its worker took, seconds into the dry pass it was met)
    slowest: list[tuple[str, float, float]] = dataclasses.field(default_factory=list)


# (owner, attribute) -> {thread ident: its replacement}, for `on_this_thread`
_PATCHES: dict[tuple[int, str], dict[int, Callable]] = {}
_PATCHES_LOCK = threading.Lock()


@contextlib.contextmanager
def on_this_thread(owner, name: str, replacement: Callable):
    """Within the block, `owner.name` (a function of a module, or of a class: a method) calls `replacement` on
    this thread and its own code on every other. Blocks of several threads may overlap and end in any order:
    the attribute goes back to its own object when the last one ends. Not re-entrant on one thread. Yields the
    original."""
    key, me = (id(owner), name), threading.get_ident()
    with _PATCHES_LOCK:
        threads = _PATCHES.setdefault(key, {})
        if not threads:
            setattr(owner, name, _dispatcher(key, getattr(owner, name)))
        original = getattr(owner, name).original
        threads[me] = replacement
    try:
        yield original
    finally:
        with _PATCHES_LOCK:
            del threads[me]
            if not threads:
                setattr(owner, name, original)
                del _PATCHES[key]


def _dispatcher(key: tuple[int, str], original: Callable) -> Callable:
    """What `on_this_thread` puts in the attribute's place: each call goes to its thread's replacement, if any."""
    def dispatch(*args, **kwargs):
        return _PATCHES.get(key, {}).get(threading.get_ident(), original)(*args, **kwargs)

    dispatch.original = original
    return dispatch


@contextlib.contextmanager
def _recording(found: dict):
    """This thread's Triton launches record their compilation instead of compiling, and launch nothing; other
    threads' launches run as usual."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    def record(self, key, signature, device, constexprs, options, attrs, warmup):
        target = self.device_caches[device][2]
        found.setdefault((self.module, self.fn.__qualname__, str(key)),
                         (self, signature, constexprs, options, attrs, target, time.perf_counter()))
        # Triton's launcher returns without launching when there is no kernel

    def refuse_timing(self, *args, **kwargs):
        if len(self.configs) > 1:
            raise Unpinned(getattr(self.fn, "__name__", str(self.fn)))
        return tune(self, *args, **kwargs)

    with on_this_thread(JITFunction, "_do_compile", record), on_this_thread(Autotuner, "run", refuse_timing) as tune:
        yield


def _compile_one(i: int) -> float | None:
    """In a worker: compile pending kernel `i` into Triton's cache (a hit there returns at once); returns the
    seconds it took, None if it failed."""
    from triton.compiler import ASTSource, compile
    jit, signature, constexprs, options, attrs, target, _ = _PENDING[i]
    t0 = time.perf_counter()
    try:
        kernel = compile(ASTSource(jit, signature, constexprs, attrs), target=target, options=options.__dict__)
    except Exception:  # noqa: BLE001 - the run compiles it in its own process and reports any error there
        return None
    try:  # Triton versions that build a C launcher per signature (3.6) keep it in the same cache
        from triton.runtime import driver
        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001 - the run builds it
        pass
    return time.perf_counter() - t0


def longest_first(pending) -> list[tuple]:
    """Recorded kernels, those of the longest source first: the workers' wall is set by the last compile to
    end, so the slowest start before the quick ones fill the gaps."""
    return sorted(pending, key=lambda kernel: -len(getattr(kernel[0], "src", "")))


def _slowest(pending, seconds, dry_start: float, most: int = 5) -> list[tuple[str, float, float]]:
    """The `most` longest compiles: (kernel name, its worker's seconds, seconds into the dry pass it was met)."""
    compiles = [(kernel[0].fn.__name__, round(took, 3), round(kernel[-1] - dry_start, 3))
                for kernel, took in zip(pending, seconds) if took is not None]
    return sorted(compiles, key=lambda c: -c[1])[:most]


def workers_for(kernels: int) -> int:
    return max(0, min(kernels, (os.cpu_count() or 1) - 1, 16))


def precompile(dry_run: Callable[[], None], before_fork: Callable[[], None] = lambda: None,
               timeout_s: float = 120.0) -> Precompiled:
    """Call `dry_run` (a run whose output is thrown away) with compilation recorded, then `before_fork` (what
    the workers should inherit), then compile what it met in forked workers. On a surprise (an autotuner to
    time, an error in the dry run, a worker stuck) it stops and says why in `skipped`; the caller's real run
    then compiles what is left."""
    global _PENDING
    report, found = Precompiled(), {}
    t0 = time.perf_counter()
    try:
        with _recording(found):
            dry_run()
    except Exception as exc:  # noqa: BLE001 - the dry run's output is garbage anyway; the real run decides
        report.skipped = f"dry pass: {type(exc).__name__}: {exc}".splitlines()[0]
    report.dry_s, report.kernels = time.perf_counter() - t0, len(found)
    report.workers = workers_for(len(found))
    if report.skipped or not report.workers:
        report.skipped = report.skipped or "no kernels to compile"
        return report
    before_fork()
    t1 = time.perf_counter()
    _PENDING = longest_first(found.values())
    # a tokenizer used before the fork would print a warning in each worker unless this is set (its default)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    try:
        # fork: the workers share this process's imported kernels; they never touch the GPU
        with multiprocessing.get_context("fork").Pool(report.workers) as pool:
            seconds = pool.map_async(_compile_one, range(len(_PENDING)), chunksize=1).get(timeout_s)
        report.compiled = sum(s is not None for s in seconds)
        report.slowest = _slowest(_PENDING, seconds, t0)
    except Exception as exc:  # noqa: BLE001 - a timeout or a failed fork: the run compiles the rest
        report.skipped = f"workers: {type(exc).__name__}: {exc}".splitlines()[0]
    finally:
        _PENDING = []
    report.compile_s = time.perf_counter() - t1
    return report
