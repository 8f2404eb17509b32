"""Programmatic dependent launch: each of our Triton kernels may start while the kernel before it finishes.

A kernel launched with `launch_pdl` is let onto the SMs as soon as every program of the kernel before it has
called `gdc_launch_dependents` (or ended), so its launch and its programs' start overlap that kernel's last wave
instead of following it; in a captured graph the edge between the two becomes a programmatic one. Each such
kernel must call `wait_for_inputs` before it touches global memory: `gdc_wait` returns once the kernel before
has finished and its writes are visible. Hopper and later; the Triton interpreter cannot run the instructions,
so they sit behind the `PDL` constexpr, off unless `launch_options` turns them on.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def launch_options(device: torch.device) -> dict:
    """The launch keywords of a kernel taking `PDL: tl.constexpr`: dependent launch on a CUDA device of compute
    capability 9 or later unless KEVSCORE_DEPENDENT_LAUNCH=0, else none (the kernel's default, off)."""
    if os.environ.get("KEVSCORE_DEPENDENT_LAUNCH", "1") == "0" or device.type != "cuda":
        return {}
    if torch.cuda.get_device_capability(device)[0] < 9:
        return {}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """With PDL: wait until the kernel before has finished, then let the next kernel start its launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
