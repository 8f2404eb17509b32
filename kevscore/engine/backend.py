"""Choosing the device and building the runner (model + bank) for it."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kevscore.engine.bank import BankLayout, StateBank
from kevscore.errors import KevscoreError
from kevscore.model.checkpoint import Checkpoint
from kevscore.model.kev import KevModel

CPU_BANK_BUDGET = 2 << 30  # bytes


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise KevscoreError("--device cuda: no CUDA GPU is available (torch.cuda.is_available() is False)")
    if name not in ("cpu", "cuda"):
        raise KevscoreError(f"--device {name}: choose cpu, cuda or auto")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def queue_mark(device: torch.device) -> torch.cuda.Event | None:
    """A timing event recorded behind the device's queued work (None on the CPU)."""
    return torch.cuda.current_stream(device).record_event(torch.cuda.Event(True)) if device.type == "cuda" else None


def release_cache(device: torch.device) -> None:
    """Return the allocator's cached blocks to the device (after an out-of-memory error, or a runner let go)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The model's dtype (weights, activations, the bank but its recurrent states) that `--dtype` (auto, bf16,
    fp32: job.options.check_options) asks for on `device`: auto is bf16 on a GPU; the CPU runs fp32 only."""
    if device.type != "cuda" and name == "bf16":
        raise KevscoreError("--dtype bf16: the CPU runs fp32 only; bf16 needs a GPU (--device cuda)")
    return torch.bfloat16 if device.type == "cuda" and name != "fp32" else torch.float32


@contextlib.contextmanager
def job_threads(device: torch.device, batch_invariant: bool) -> Iterator[None]:
    """One intra-op thread for torch's CPU ops while a job runs, where it is needed, restored after it.

    Under --batch-invariant on the CPU: a reduction split over threads rounds by the thread count, which differs
    between a one-process run and a torchrun rank (OMP_NUM_THREADS=1), so the promise of bit-identical results
    across shard counts needs a fixed count. On a GPU: the host's torch ops are index arithmetic on a prefill
    group's tokens (tens of thousands of elements, microseconds on one thread), and a pool of threads would
    wait at each op's barrier for cores that the tokenizer's threads hold while they encode the next window."""
    before = torch.get_num_threads()
    if (batch_invariant and device.type == "cpu") or device.type == "cuda":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_runner(ckpt: Checkpoint, device: torch.device, doc_tokens: list[int],
                 capacity: int | None = None, eager: bool = False, dtype: torch.dtype | None = None):
    """The CPU runner (torch ops, fp32 whatever `dtype`) or, on a GPU, the fused runner (FLA, CUDA graphs;
    `dtype` bf16, the default, or fp32)."""
    if device.type == "cuda":
        from kevscore.engine.cuda_runner import build_cuda_runner

        return build_cuda_runner(ckpt, device, doc_tokens, capacity, eager, dtype or torch.bfloat16)
    from kevscore.engine.runner import EagerRunner
    from kevscore.kernels import torch_ops

    model = KevModel.from_weights(ckpt.config, ckpt.weights, torch_ops, torch.float32, device)
    layout = BankLayout.plan(ckpt.config, torch.float32, doc_tokens, CPU_BANK_BUDGET, capacity)
    return EagerRunner(model, StateBank(ckpt.config, layout, device, torch.float32), ckpt.pad_id)
