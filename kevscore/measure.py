"""Measuring: timed calls, and the machine and code a result comes from (compare, benchmarks).

Calls are timed by CUDA events on a GPU, by the wall clock on a CPU."""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kevscore.engine.backend import queue_mark, synchronize

PACKAGES = ("torch", "triton", "transformers", "fla-core", "flash-linear-attention", "pyarrow")


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """(latency ms, wall s) of one call: CUDA-event time on a GPU (the wall clock on a CPU), and the wall
    time from before the call to the end of its GPU work."""
    synchronize(device)
    t0 = time.perf_counter()
    start = queue_mark(device)
    fn()
    end = queue_mark(device)
    synchronize(device)
    wall = time.perf_counter() - t0
    return (wall * 1000 if start is None else start.elapsed_time(end)), wall


def events_ms(fn: Callable[[], object], reps: int, warmup: int, device: torch.device = torch.device("cuda")) -> list[float]:
    """`reps` latencies (ms, `timed`) of `fn` after `warmup` calls that are not timed."""
    for _ in range(warmup):
        fn()
    return [timed(fn, device)[0] for _ in range(reps)]


def source_digests() -> dict[str, str]:
    """SHA-256 of kevscore's source files, by path relative to the package (no machine paths)."""
    root = Path(__file__).parent
    return {str(p.relative_to(root.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*.py"))}


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return out.strip().splitlines()[0] if out.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def _version(package: str) -> str | None:
    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict:
    """What a result was measured on: device, driver, CUDA and package versions, and the code's digests.
    Holds no host name, path or user name."""
    hardware = ({"gpu": torch.cuda.get_device_name(device), "driver": _driver_version(), "cuda": torch.version.cuda}
                if device.type == "cuda" else {"cpu": platform.machine(), "threads": torch.get_num_threads()})
    return {"device": device.type, "python": platform.python_version(),
            "versions": {pkg: _version(pkg) for pkg in PACKAGES}, "source_sha256": source_digests()} | hardware

