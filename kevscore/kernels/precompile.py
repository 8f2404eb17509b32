"""A run's Triton kernels compiled side by side in forked processes while the run's dry pass meets them.

A dry pass of a run records every kernel it would compile (nothing is compiled or launched); each one is
compiled into Triton's cache by a process forked for it the moment the pass meets it (at most one per core at
a time, the others queued longest first), and the run itself then finds each one there.

Triton compiles one kernel at a time and holds the GIL while it does, so a cold start compiles ~40 kernels
in a row; the forked processes spread them over the CPU's cores, and the slowest start before the pass ends.
Everything here is an optimization: a kernel no process could compile is compiled by the run as usual, and any
surprise ends the dry pass early.
"""
from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import threading
import time
from typing import Callable


class Unpinned(RuntimeError):
    """The dry pass met an autotuner with several configurations: timing them needs real launches."""


@dataclasses.dataclass(slots=True)
class Precompiled:
    kernels: int = 0        # specializations the dry pass met
    compiled: int = 0       # of those, compiled (or found in the cache) by the forked processes
    workers: int = 0        # compile processes at once, at most
    dry_s: float = 0.0      # the dry pass
    compile_s: float = 0.0  # from the first fork to the last compile's end (it overlaps the dry pass)
    skipped: str | None = None  # why there was no parallel compilation
    first: int = 0          # kernels met before the dry pass's mark (what the caller is released on)
    released_s: float | None = None  # seconds from the pass's start until their compiles had ended (None: never)
    # the slowest compiles: (kernel, seconds its process took, seconds into the dry pass it was met)
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
def _recording(found: dict, met: Callable[[tuple, tuple], None]):
    """This thread's Triton launches record their compilation in `found` (and call `met` with each new one's name
    and record) instead of compiling, and launch nothing; other threads' launches run as usual."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    def record(self, key, signature, device, constexprs, options, attrs, warmup):
        target, name = self.device_caches[device][2], _name(self, key)
        if name not in found:
            found[name] = (self, signature, constexprs, options, attrs, target, time.perf_counter())
            met(name, found[name])
        # Triton's launcher returns without launching when there is no kernel

    def refuse_timing(self, *args, **kwargs):
        if len(self.configs) > 1:
            raise Unpinned(getattr(self.fn, "__name__", str(self.fn)))
        return tune(self, *args, **kwargs)

    with on_this_thread(JITFunction, "_do_compile", record), on_this_thread(Autotuner, "run", refuse_timing) as tune:
        yield


def _name(jit, key) -> tuple[str, str, str]:
    """A kernel specialization's name: its JIT function's module and name, and Triton's key."""
    return jit.module, jit.fn.__qualname__, str(key)


@contextlib.contextmanager
def _waiting(compiles: _Compiles, timeout_s: float):
    """Within the block, another thread's launch of a kernel that a process is compiling (or will) waits for that
    compile, then finds the kernel in Triton's cache, rather than compiling it a second time beside it."""
    from triton.runtime.jit import JITFunction

    original = JITFunction._do_compile

    def do_compile(self, key, *args, **kwargs):
        if (ended := compiles.ended.get(_name(self, key))) is not None:
            ended.wait(timeout_s)
        return original(self, key, *args, **kwargs)

    JITFunction._do_compile = do_compile
    try:
        yield
    finally:
        JITFunction._do_compile = original


def _compile_one(i: int, kernel: tuple, results) -> None:
    """In a forked process: compile recorded `kernel` (which the fork hands over in memory, not pickled) into
    Triton's cache (a hit there returns at once); put (i, the seconds it took) in `results`, None for seconds if
    it failed."""
    from triton.compiler import ASTSource, compile
    jit, signature, constexprs, options, attrs, target, _ = kernel
    t0, took = time.perf_counter(), None
    with contextlib.suppress(Exception):  # the run compiles it in its own process and reports any error there
        compiled = compile(ASTSource(jit, signature, constexprs, attrs), target=target, options=options.__dict__)
        took = time.perf_counter() - t0  # compiled, whether or not the launcher below builds
        from triton.runtime import driver  # Triton versions that build a C launcher per signature (3.6) keep it
        driver.active.launcher_cls(compiled.src, compiled.metadata)  # in the same cache
        took = time.perf_counter() - t0
    results.put((i, took))


class _Compiles:
    """Each recorded kernel (`pending`, in the order met) compiled in a process forked for it (which holds this
    process's memory as it was: the kernel's JIT function and everything it refers to), at most `slots` at a
    time; the others queued, the longest first when a slot frees. The first fork waits until `ready()` (kernels
    queue meanwhile, and the dry pass goes on), then runs `before_fork`. Driven by the dry pass's thread: `add`
    as it meets each kernel, then `finish`."""

    def __init__(self, slots: int, before_fork: Callable[[], None], ready: Callable[[], bool]):
        self.context = multiprocessing.get_context("fork")  # the processes never touch the GPU
        self.results = self.context.SimpleQueue()
        self.slots, self.before_fork, self.ready = slots, before_fork, ready
        self.pending: list[tuple] = []
        self.queued: list[int] = []  # indices into pending, the longest source last
        self.running: dict[int, multiprocessing.Process] = {}
        self.seconds: dict[int, float | None] = {}
        self.started: float | None = None  # the first fork
        self.most = 0                      # processes at once, at most
        self.first: int | None = None      # pending[:first]: the kernels `released` waits for (`mark`)
        self.released: Callable[[], None] | None = None
        self.pass_ended = False            # `released` waits for the dry pass too: its torch ops run on the GPU
        self.released_at: float | None = None
        self.ended: dict[tuple, threading.Event] = {}  # by kernel name, in pending's order: set once its compile ends

    def add(self, name: tuple, kernel: tuple) -> None:
        self.pending.append(kernel)
        self.ended[name] = threading.Event()
        self.queued.append(len(self.pending) - 1)
        # those met before the mark first, then by source length: the longest compile first, so the compiles'
        # wall (set by the last to end) is not a slow one begun after the quick ones
        self.queued.sort(key=lambda j: (self.first is None or j < self.first,
                                        len(getattr(self.pending[j][0], "src", ""))))
        self._fill()

    def mark(self, released: Callable[[], None]) -> None:
        """Call `released` once the compiles of every kernel met so far have ended, whatever their outcome, and
        the dry pass has ended without an error (`end_pass`)."""
        self.first, self.released = len(self.pending), released
        self._fill()

    def end_pass(self) -> None:
        self.pass_ended = True
        self._fill()

    def _fill(self) -> None:
        self._collect()
        while self.queued and len(self.running) < self.slots:
            if self.started is None:
                if not self.ready():
                    return
                self.before_fork()
                # a tokenizer used before the fork would print a warning in each process unless this is set
                os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
                self.started = time.perf_counter()
            i = self.queued.pop()
            self.running[i] = self.context.Process(target=_compile_one, args=(i, self.pending[i], self.results),
                                                   daemon=True)
            self.running[i].start()
            self.most = max(self.most, len(self.running))

    def _collect(self) -> None:
        while not self.results.empty():
            i, took = self.results.get()
            self.seconds[i] = took
        self.running = {i: process for i, process in self.running.items() if process.exitcode is None}
        for i, ended in enumerate(self.ended.values()):
            if i not in self.running and i not in self.queued:
                ended.set()
        if self.released is not None and self.pass_ended and not any(i < self.first for i in (*self.queued, *self.running)):
            released, self.released, self.released_at = self.released, None, time.perf_counter()
            released()

    def finish(self, timeout_s: float) -> list[float | None]:
        """Wait for every compile (queued ones forked as slots free); each one's seconds, None where it failed."""
        from multiprocessing.connection import wait

        deadline = time.perf_counter() + timeout_s
        self.ready = lambda: True  # before_fork waits for what `ready` waited for
        self._fill()
        while self.running:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise TimeoutError(f"{len(self.running) + len(self.queued)} compiles left after {timeout_s:.0f} s")
            wait([p.sentinel for p in self.running.values()], timeout=left)
            self._fill()
        self._collect()
        return [self.seconds.get(i) for i in range(len(self.pending))]

    def stop(self) -> None:
        self.queued.clear()
        for process in self.running.values():
            process.kill()
            process.join()
        self.running.clear()
        for ended in self.ended.values():  # what was left is the caller's to compile now
            ended.set()


def workers_for() -> int:
    """Compile processes at once: two cores are the dry pass's and the job's (its load beside the warm-up)."""
    cores = os.cpu_count() or 1
    return max(0, min(cores - (2 if cores > 2 else 1), 16))


def precompile(dry_run: Callable, before_fork: Callable[[], None] = lambda: None,
               ready: Callable[[], bool] = lambda: True, released: Callable[[], None] | None = None,
               timeout_s: float = 120.0) -> Precompiled:
    """Call `dry_run` (a run whose output is thrown away) with compilation recorded, each kernel it meets
    compiled in a forked process from then on, and wait for the compiles. The first fork waits until `ready()`
    holds (or the pass ends), then calls `before_fork`: what the processes should inherit. With `released`, the
    dry run is called with `mark`, which it calls once it has met the kernels its caller needs first: they
    compile first, and `released()` is called as soon as they have and the dry run has ended (its torch ops run
    on the GPU, and its caller's graph captures must not run beside them; the rest may still be compiling). On a
    surprise (an autotuner to time, an error in the dry run, a compile stuck) it stops and says why in
    `skipped`; the caller's real run then compiles what is left."""
    report, found, compiles = Precompiled(), {}, _Compiles(workers_for(), before_fork, ready)
    t0 = time.perf_counter()
    try:
        with _waiting(compiles, timeout_s):  # other threads' launches of what the processes compile wait for them
            try:
                with _recording(found, compiles.add):  # no slots (one core): each kernel waits, and is never forked
                    dry_run() if released is None else dry_run(lambda: compiles.mark(released))
                compiles.end_pass()
            except Exception as exc:  # noqa: BLE001 - the dry run's output is garbage anyway; the real run decides
                report.skipped = f"dry pass: {type(exc).__name__}: {exc}".splitlines()[0]
            report.dry_s, report.kernels = time.perf_counter() - t0, len(found)
            if not report.skipped and not (compiles.slots and found):
                report.skipped = "no kernels to compile" if compiles.slots else "one core: no compile processes"
            if not report.skipped:
                # each compiled kernel: (its name, its process's seconds, seconds into the dry pass it was met)
                done = [(kernel[0].fn.__name__, round(took, 3), round(kernel[-1] - t0, 3))
                        for kernel, took in zip(compiles.pending, compiles.finish(timeout_s)) if took is not None]
                report.compiled, report.slowest = len(done), sorted(done, key=lambda c: -c[1])[:5]
    except Exception as exc:  # noqa: BLE001 - a timeout or a failed fork: the run compiles the rest
        report.skipped = f"workers: {type(exc).__name__}: {exc}".splitlines()[0]
    finally:
        compiles.stop()
    report.workers, report.first = compiles.most, compiles.first or 0
    report.released_s = compiles.released_at - t0 if compiles.released_at else None
    report.compile_s = time.perf_counter() - compiles.started if compiles.started else 0.0
    return report
