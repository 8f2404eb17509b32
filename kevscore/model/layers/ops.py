"""The ops interface the layers call, which every ops backend implements.

A backend (`kernels.torch_ops` on the CPU, `kernels.fla_ops` on the GPU) is a module of functions of these names
and signatures (a module satisfies a Protocol).

Gates travel unevaluated so a backend may fuse them: the DeltaNet decay as `gate = (a, A_log, dt_bias)`
(decay = -exp(A_log) * softplus(a + dt_bias)), attention's output gate as the q|gate projection slice.
"""
from __future__ import annotations

from typing import Protocol

import torch

Tensor = torch.Tensor


class Ops(Protocol):
    NAME: str  # the backend in model fingerprints: bank entries of different backends are not interchangeable
    GATHERS_KV: bool  # attn_branch reads BranchContext.kv_index / kv_mask (else kv_start / kv_len in place)

    # norms and the MLP
    def rms_norm(self, x: Tensor, scale: Tensor, eps: float) -> Tensor:
        """Qwen3.5's zero-centred RMSNorm with `scale` = 1 + weight (fp32)."""

    def proj_add(self, x: Tensor, weight: Tensor, residual: Tensor) -> Tensor:
        """residual + x weight^T: the residual stream after a sub-layer's output projection (a backend may write
        it into `residual`, which its caller reads no more)."""

    def gated_rms_norm(self, x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
        """DeltaNet's output norm: weight * norm(x) * silu(gate)."""

    def gate_up_weight(self, gate: Tensor, up: Tensor) -> Tensor:
        """The MLP's gate and up projections [I, K] as one weight [2 I, K], in the layout `swiglu_proj` takes."""

    def swiglu_proj(self, x: Tensor, gate_up: Tensor) -> Tensor:
        """silu(gate) * up of x's projection by `gate_up` (made by `gate_up_weight`)."""

    # attention
    def qk_norm_rotary(self, q: Tensor | None, k: Tensor, q_scale: Tensor, k_scale: Tensor, cos: Tensor, sin: Tensor,
                       eps: float) -> tuple[Tensor | None, Tensor]:
        """RMSNorm of each q and k head, then partial rotary; q and k [..., heads, head_dim] (q None: k alone)."""

    def attn_prefill(self, q: Tensor, k: Tensor, v: Tensor, gate: Tensor, ctx) -> Tensor:
        """Causal attention within each packed document (ctx: a PrefillContext), times sigmoid(gate)."""

    def attn_branch(self, q: Tensor, k: Tensor, v: Tensor, gate: Tensor | None, kv: Tensor, ctx) -> Tensor:
        """Branch queries over their document's K/V in the pool `kv` [2, tokens, Hkv, D] (ctx: a BranchContext)
        and, causally, the branch's own; times sigmoid(gate) (None: no gate)."""

    # the gated delta rule
    def prefill_front(self, x: Tensor, weight: Tensor, ctx, hk: int, dk: int, hv: int, dv: int,
                      b: Tensor) -> tuple[Tensor, ...]:
        """(q, k, v, beta = sigmoid(b)) of packed documents' conv, q and k l2-normalized per head."""

    def branch_front(self, x: Tensor, weight: Tensor, bank_conv: Tensor, slots: Tensor, hk: int, dk: int, hv: int,
                     dv: int, b: Tensor) -> tuple[Tensor, ...]:
        """The same for branch rows, their conv continuing from the bank entries `slots`."""

    def gdr_prefill(self, q: Tensor, k: Tensor, v: Tensor, gate: tuple[Tensor, Tensor, Tensor], beta: Tensor, ctx,
                    bank: Tensor) -> Tensor:
        """Packed documents from zero states (q and k l2-normalized, as the fronts leave them): the output;
        document d's final state [HV, K, V] goes into the bank's states at entry `ctx.slots[d]`."""

    def gdr_branch(self, q: Tensor, k: Tensor, v: Tensor, gate: tuple[Tensor, Tensor, Tensor], beta: Tensor,
                   bank: Tensor, slots: Tensor, path: str) -> Tensor:
        """Branch rows from the bank's states of entries `slots`, read in place (`indexed`) or copied out
        first (`gathered`, the --state-read mode): the same results."""
