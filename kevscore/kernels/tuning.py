"""Launch configurations of FLA's autotuned kernels, pinned for the GPUs we measured.

Launch configurations of flash-linear-attention's autotuned kernels, pinned for the GPUs we measured, so a
process compiles each kernel once instead of timing every configuration on the first shapes it meets.

FLA autotunes each kernel per key (head counts and dims, not token counts) the first time it runs, and
keeps the choice in Triton's cache directory: a user's first job pays for timing every configuration, and
later jobs run with whatever the first, often tiny, shapes favoured (benchmarks/NOTES.md 14-15).
Pinning leaves one configuration in a kernel's list, chosen from its own list, so FLA's code runs as
always and Triton never benchmarks. GPUs without pins keep FLA's autotuning; `KEVSCORE_AUTOTUNE=1` keeps it
everywhere (to measure new pins: `TRITON_PRINT_AUTOTUNING=1`, benchmarks/bench_job.py --logs).
"""
from __future__ import annotations

import importlib
import os

# GPU name (as torch reports it, matched by substring) -> (module, kernel) -> the configuration's
# constexprs and launch options: the autotuner's choice at a prefill's shapes (benchmarks/bench_job.py,
# NOTES.md 14 and 27). kevscore runs only the kkt + solve kernel (our fused kernels do the rest); the others
# run in the cuda tests' oracles and the benchmarks' A/B (tests/fla_oracles.py).
# The state scan keeps 2 stages where the autotuner took 4: an fp32 model's would overflow the shared memory.
PINS: dict[str, dict[tuple[str, str], dict]] = {
    "H200": {
        ("fla.ops.gated_delta_rule.chunk_fwd", "chunk_gated_delta_rule_fwd_kkt_solve_kernel"):
            {"BK": 64, "num_warps": 1, "num_stages": 3},
        ("fla.ops.gated_delta_rule.wy_fast", "recompute_w_u_fwd_kernel"): {"num_warps": 4, "num_stages": 3},
        ("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"):
            {"BV": 64, "num_warps": 4, "num_stages": 2},
        ("fla.ops.common.chunk_o", "chunk_fwd_kernel_o"): {"BK": 64, "BV": 64, "num_warps": 4, "num_stages": 3},
    },
}


def autotuner(kernel):
    """The Triton autotuner wrapping `kernel` (through heuristics and other wrappers), or None."""
    while kernel is not None and not hasattr(kernel, "configs"):
        kernel = getattr(kernel, "fn", None)
    return kernel


def matches(config, wanted: dict) -> bool:
    launch = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return all((config.kwargs | launch).get(k) == v for k, v in wanted.items())


def pin_for(device_name: str) -> list[str]:
    """Pin the kernels measured on this GPU; returns their names (none under KEVSCORE_AUTOTUNE=1, on an
    unmeasured GPU, or where FLA's own list no longer has the configuration)."""
    if os.environ.get("KEVSCORE_AUTOTUNE") == "1":
        return []
    pins = next((p for gpu, p in PINS.items() if gpu in device_name), {})
    pinned = []
    for (module, name), wanted in pins.items():
        tuner = autotuner(getattr(importlib.import_module(module), name, None))
        chosen = [c for c in getattr(tuner, "configs", []) if matches(c, wanted)]
        if chosen:
            tuner.configs = chosen[:1]
            pinned.append(name)
    return pinned
