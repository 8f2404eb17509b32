"""The GPU runner: a bf16 or fp32 model over FLA kernels, a bank sized from free memory, CUDA graphs per bucket.

One CUDA graph per (rows, length, scored positions, path) bucket, captured on first use into one shared memory
pool (a batch large enough to hide its launches behind its GPU work runs eagerly at its exact shape instead).
The documents' lengths are not in the key: branch attention reads each row's document K/V in place.

A batch is one host-to-device copy of its pinned upload buffer into the bucket's static buffer and one
graph replay; the output (final hidden states at the rows' scored tokens) is cloned before the next replay.
A bucket's first batch runs eagerly and its graph is captured behind it, neither waiting for the GPU: the
host's capture work hides behind the batches already queued.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from kevscore.engine.bank import BankLayout, StateBank
from kevscore.engine.plan import Batch, prefill_group_tokens
from kevscore.engine.runner import EagerRunner, fill_upload
from kevscore.model.checkpoint import Checkpoint
from kevscore.model.config import KevConfig
from kevscore.model.kev import KevModel

BANK_SHARE = 0.6  # of the free GPU memory after loading the model


@dataclass(slots=True)
class CapturedBatch:
    graph: torch.cuda.CUDAGraph
    host: torch.Tensor    # pinned upload buffer
    device: torch.Tensor  # static upload buffer the graph reads
    out: torch.Tensor     # static output the graph writes
    uploaded: torch.cuda.Event  # the last copy out of `host`: the buffer is refilled only once it is done


class GraphRunner(EagerRunner):
    def __init__(self, model: KevModel, bank: StateBank, pad: int):
        super().__init__(model, bank, pad)
        assert not model.ops.GATHERS_KV, "a graph's key holds no document length to gather K/V by"
        self.graphs: dict[tuple, CapturedBatch] = {}
        # where the eager runs and captures go, and the memory pool the graphs share
        self.stream, self.pool = torch.cuda.Stream(self.device), torch.cuda.graph_pool_handle()
        self.capture_s = 0.0  # host seconds of the eager runs (first launches) and captures, reported apart

    def score(self, batch: Batch, branches, slots, prefix_lens, path: str) -> torch.Tensor:
        if batch.exact:  # GPU work enough to hide its launches (engine.plan.EAGER_LAYER_FLOPS): no graph, no padding
            return super().score(batch, branches, slots, prefix_lens, path)
        key = (batch.size, batch.length, batch.scored, path)
        if (entry := self.graphs.get(key)) is None:  # this batch's scores come from the eager run before the capture
            self.graphs[key], out = self.capture(batch, branches, slots, prefix_lens, path)
        else:
            entry.uploaded.synchronize()  # the bucket's last batch was read out of the buffer (long ago)
            fill_upload(entry.host, batch.length, branches, slots, prefix_lens, self.pad_id)
            entry.device.copy_(entry.host, non_blocking=True)
            entry.uploaded.record()
            entry.graph.replay()
            out = entry.out
        return out[: len(branches) * batch.scored].to(torch.float32, copy=True)

    def capture(self, batch: Batch, branches, slots, prefix_lens, path: str) -> tuple[CapturedBatch, torch.Tensor]:
        """Run the batch eagerly (autotuners pick their configs here, every kernel is loaded), then capture the
        bucket's graph. Returns the graph and the eager run's output, the same kernels' on the same input.

        Both go on a side stream behind the work queued so far, and nothing waits for the GPU: not the upload
        (from pinned memory), nor the capture, which `torch.cuda.graph` would begin by synchronizing and
        emptying the allocator's caches (the GPU idle meanwhile, the memory of prefill's activations and the
        pinned buffers allocated again). A capture only records launches, so the GPU's queue needs no draining."""
        t0 = time.perf_counter()
        host = self.upload(batch, branches, slots, prefix_lens)
        device = host.to(self.device, non_blocking=True)
        uploaded = torch.cuda.current_stream().record_event()
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(self.stream):
                first = self.forward(device, batch, path)
                # thread-local: another thread's CUDA calls (a reader pinning memory) cannot end this capture
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    out = self.forward(device, batch, path)
                finally:
                    graph.capture_end()
        except RuntimeError as exc:
            # an allocation failing inside the capture can surface as a capture error on its end; report it as
            # what it is, so the engine splits the batch (kevscore.engine.pipeline) instead of failing the run
            cause = exc if isinstance(exc, torch.OutOfMemoryError) else exc.__context__
            if isinstance(cause, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
                raise torch.OutOfMemoryError(f"out of memory capturing a graph of {batch.size} rows x "
                                             f"{batch.length} tokens: {exc}") from exc
            raise
        torch.cuda.current_stream().wait_stream(self.stream)  # (a failed capture's eager run feeds nothing)
        self.capture_s += time.perf_counter() - t0
        return CapturedBatch(graph, host, device, out, uploaded), first


def process_settings(dtype: torch.dtype) -> None:
    """The process-wide switches a GPU runner's kernels read at their first use, set before any:
    - cuBLAS without a workspace: its heuristic then picks the same tiles in variants that need no zeroed
      workspace, so a captured scoring call has no memset node before each GEMM, at the same kernel time
      (NOTES 100); read at the process's first cuBLAS call; a CUBLAS_WORKSPACE_CONFIG the user set is kept.
    - for an fp32 model, Triton's dots of fp32 operands in 3xTF32 instead of TF32, FLA's and ours alike where
      they name no precision (kernels/fla_ops.py: the one FLA names); read when a kernel compiles and part of
      Triton's cache key (a kernel already compiled in this process keeps its dots). No bf16 model's kernel has
      such a dot: their code is the same."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    if dtype == torch.float32:
        os.environ["TRITON_F32_DEFAULT"] = "tf32x3"  # fp32's precision on tensor cores (TF32 moves p by ~3e-4)


def build_cuda_runner(ckpt: Checkpoint, device: torch.device, doc_tokens: list[int], capacity: int | None,
                      eager: bool, dtype: torch.dtype = torch.bfloat16) -> EagerRunner:
    """The model and a bank sized from free memory, run through CUDA graphs (`eager`: the eager runner)."""
    from kevscore.kernels import fla_ops

    process_settings(dtype)
    model = KevModel.from_weights(ckpt.config, ckpt.weights, fla_ops, dtype, device)
    free, _ = torch.cuda.mem_get_info(device)
    layout = BankLayout.plan(ckpt.config, dtype, doc_tokens, int(free * BANK_SHARE), capacity)
    bank = StateBank(ckpt.config, layout, device, dtype)
    runner = (EagerRunner if eager else GraphRunner)(model, bank, ckpt.pad_id)
    # prefill groups of documents attention pads by at most PAD_WASTE (engine.pipeline): fp32 has no flash attention
    runner.similar_lengths = dtype == torch.float32
    free, _ = torch.cuda.mem_get_info(device)
    runner.prefill_tokens = prefill_group_tokens(free, prefill_bytes_per_token(ckpt.config, dtype.itemsize))
    return runner


def prefill_bytes_per_token(cfg: KevConfig, itemsize: int = 2) -> int:
    """Activation bytes one document token holds at the peak of a prefill layer (`itemsize` bytes an element:
    2 in bf16, 4 in fp32): the projection outputs, q/k/v, the chunk pipeline's w, u, v_new, o, its (I + A)^-1
    blocks and its share of the chunk states, the MLP's gate|up and SwiGLU outputs and the residual stream,
    with room for the allocator."""
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    elements = (cfg.conv_dim + cfg.value_dim + 2 * hv) + cfg.conv_dim + 4 * hv * dv + hv * 64 \
        + hv * cfg.linear_key_head_dim * dv // 64 + 3 * cfg.intermediate_size + 6 * cfg.hidden_size
    return itemsize * elements * 3 // 2
