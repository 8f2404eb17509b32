"""Stopping cleanly and surviving faults: Ctrl-C / SIGTERM after the current batch, test-only fault hooks.

- `StopSignals` turns the first SIGINT or SIGTERM into a request that the engine honours after the batch
  (or prefill group) in flight, raising `Interrupted`; a second signal stops at once.
- Test hooks, read from the environment each time (so an in-process test can set them too):
  `KEVSCORE_TEST_KILL=POINT[:N]` makes the process SIGKILL itself the N-th time (default 1st) it reaches
  POINT; `KEVSCORE_TEST_SIGINT=POINT[:N]` sends it a SIGINT there instead (a Ctrl-C at a known place);
  `KEVSCORE_TEST_ENOSPC=POINT[:N]` raises OSError(ENOSPC) there (a full disk inside a write); each of the
  three takes `@RANK` last (`score:2@1`) to act in that torchrun rank alone;
  `KEVSCORE_TEST_MARKS=DIR` touches DIR/POINT at every point reached, and where `KEVSCORE_TEST_PAUSE`
  (comma-separated) names the point, waits there (at most 120 s) until DIR/POINT.go exists, so a test
  can kill, release or interleave processes at a known place;
  `KEVSCORE_TEST_OOM_ROWS=N` raises `torch.OutOfMemoryError` for every scoring batch of more than N rows,
  `KEVSCORE_TEST_OOM_DOCS=N` for every prefill group of more than N documents.
  `KEVSCORE_TEST_WRONG_ENTRY=1` makes every row read the bank entry of another document of its wave (the
  next one in document order) for its whole branch: states, conv, K/V and positions. Its scores are then
  exactly those of its question asked about that document; the demo model's accuracy drops to chance.
  Points: `prefill` (after a prefill group), `score` (after a batch), `part-write` (inside a part file's
  write, before its footer), `part-done` (a part renamed into place, the manifest not yet updated),
  `merge` (inside the final output's write), `merged` (the output renamed into place, the parts not yet
  removed), `manifest-write` (inside a write of the parts' manifest); the persistent bank's
  `bank-entry-write` and `bank-index-write` (halfway through an entry's or the index's temporary file;
  `bank-index-write-open` when a run opens the bank), `bank-lock-wait-PURPOSE` (before taking its lock),
  `bank-before-commit`, `bank-commit-locked` (the lock held, nothing renamed) and `bank-renamed` (entries
  renamed into place, the index not yet written).
"""
from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

KILL, SIGINT, ENOSPC = "KEVSCORE_TEST_KILL", "KEVSCORE_TEST_SIGINT", "KEVSCORE_TEST_ENOSPC"
OOM = {"rows": "KEVSCORE_TEST_OOM_ROWS", "docs": "KEVSCORE_TEST_OOM_DOCS"}
PAUSE_S = 120
_reached: Counter[tuple[str, str]] = Counter()  # (hook setting, point) -> times reached in this process


class Interrupted(KeyboardInterrupt):
    """A stop requested by Ctrl-C or SIGTERM, honoured between batches; the message says what was kept."""


def _reach(spec: str | None, point: str) -> bool:
    """Count this arrival at `point` under hook setting `spec`; True on the arrival the setting names."""
    where, _, rank = (spec or "").partition("@")
    if where.partition(":")[0] != point or rank not in ("", os.environ.get("RANK")):
        return False
    _reached[spec, point] += 1
    return _reached[spec, point] == int(where.partition(":")[2] or 1)


def point(name: str) -> None:
    """A place a test may mark, pause, kill or interrupt the process at, or fail a write (no-op unless a
    test hook names it)."""
    if marks := os.environ.get("KEVSCORE_TEST_MARKS"):  # touch DIR/POINT, and pause there when KEVSCORE_TEST_PAUSE says
        (Path(marks) / name).touch()
        if name in os.environ.get("KEVSCORE_TEST_PAUSE", "").split(","):
            go, deadline = Path(marks) / f"{name}.go", time.monotonic() + PAUSE_S
            while not go.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
    for hook, sig in ((KILL, signal.SIGKILL), (SIGINT, signal.SIGINT)):
        if _reach(os.environ.get(hook), name):
            os.kill(os.getpid(), sig)
    if _reach(os.environ.get(ENOSPC), name):
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected by {ENOSPC})")


def inject_oom(unit: str, n: int) -> None:
    """Test-only allocation failure: torch.OutOfMemoryError for a batch of more than N rows (unit "rows")
    or a prefill group of more than N documents (unit "docs")."""
    if (limit := os.environ.get(OOM[unit])) and n > int(limit):
        import torch

        raise torch.OutOfMemoryError(f"CUDA out of memory (injected by {OOM[unit]}={limit}: {n} {unit})")


class StopSignals:
    """While active (main thread only), the first SIGINT/SIGTERM sets `requested`; a second one raises
    KeyboardInterrupt at once. `warn` is told when a stop is requested."""

    def __init__(self, warn):
        self.requested: str | None = None
        self._warn = warn
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        self._warn(f"{self.requested}: stopping after the current batch (send it again to stop at once)")

    def check(self) -> None:
        """Raise Interrupted when a stop was requested (the engine calls this between batches)."""
        if self.requested is not None:
            raise Interrupted(self.requested)


def wrong_entry(docs: list[int]) -> dict[int, int]:
    """Under KEVSCORE_TEST_WRONG_ENTRY: each document -> the next of `docs` (cyclic); else identity."""
    if os.environ.get("KEVSCORE_TEST_WRONG_ENTRY", "") in ("", "0"):
        return {d: d for d in docs}
    order = sorted(docs)
    return {d: order[(i + 1) % len(order)] for i, d in enumerate(order)}
