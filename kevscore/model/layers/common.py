"""What Kev layers share: norms, rotary embedding, MLP, per-forward contexts, bank declarations.

A layer declares the tensors of its bank entry (`BankTensor`); each forward gets a context."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kevscore.model.layers.ops import Ops

TOKENS = "tokens"  # a bank tensor's token axis: one row per document token (an entry owns a range of them)


def frozen_param(*shape: int, dtype: torch.dtype | None = None, device=None) -> nn.Parameter:
    """A parameter of `shape`, allocated but not initialized (the model's `load` fills it), never trained."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


@dataclass(frozen=True, slots=True)
class BankTensor:
    """One tensor of the bank entry a layer reads to continue from a document, declared by the layer (like
    mamba's allocate_inference_cache): the bank allocates it for every layer that declares it, the bank
    store saves and checks it per entry, and the model hands each layer its view (`bank_<name>`)."""
    name: str                     # the bank's attribute and the entry file's tensor
    dims: tuple[str | int, ...]   # per layer and entry: a KevConfig size by name, a literal size, or TOKENS
    fp32: bool = False            # kept in fp32 whatever the bank's dtype (a recurrent state)
    component: str = ""           # its name in bank reports (default: name)

    @property
    def token_axis(self) -> int | None:
        """The position of TOKENS in dims (None: one fixed-size block per entry)."""
        return self.dims.index(TOKENS) if TOKENS in self.dims else None

    def shape(self, cfg, tokens: int = 1) -> tuple[int, ...]:
        return tuple(tokens if d == TOKENS else d if isinstance(d, int) else int(getattr(cfg, d)) for d in self.dims)

    def dtype(self, bank_dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.fp32 else bank_dtype


@dataclass(slots=True)
class PrefillContext:
    """Documents packed into one sequence of N tokens; writes each document's bank entry. Everything is
    computed on the host once per group and uploaded without a sync, so no layer waits on the GPU."""
    cu_seqlens: torch.Tensor     # [D + 1] int32 document boundaries
    cu_seqlens_long: torch.Tensor  # [D + 1] int64, the same boundaries (FLA's kernels take int64)
    chunk_indices: torch.Tensor  # [chunks, 2] int64 (document, chunk within it) of every 64-token chunk
    tail_index: torch.Tensor     # [D, k - 1] int64 token of each document's last k - 1 conv inputs (clamped)
    tail_valid: torch.Tensor     # [D, k - 1] bool: that token belongs to the document (short documents)
    slots: torch.Tensor          # [D] bank entry of each document
    kv_slots: torch.Tensor       # [N] token slot in the bank's K/V pool of each token
    positions: torch.Tensor      # [N] position of each token within its document
    max_len: int                 # the longest document's length
    pad_index: torch.Tensor | None = None    # [D, max_len] packed token at each padded position (0 past a
                                             # document's end); None when padding would waste too much
    unpad_index: torch.Tensor | None = None  # [N] each packed token's place in the flattened [D, max_len]


@dataclass(slots=True)
class BranchContext:
    """Question rows right-padded to [R, T], each branching from its document's bank entry."""
    positions: torch.Tensor    # [R, T]
    slots: torch.Tensor        # [R] bank entry of each row (may be a strided column of an upload buffer)
    kv_index: torch.Tensor | None  # [R, P] token slots of the row's document in the K/V pool (clamped);
                                   # None for a backend that reads them in place (Ops.GATHERS_KV)
    kv_mask: torch.Tensor | None   # [R, P] which of those are real document tokens
    kv_start: torch.Tensor     # [R] first K/V pool slot of the row's document
    kv_len: torch.Tensor       # [R] the document's length
    path: str                  # "gathered" | "indexed"


Context = PrefillContext | BranchContext


class Rotary(nn.Module):
    """Partial NeoX rotary embedding over the first `dim` channels of each head."""

    def __init__(self, dim: int, theta: float):
        super().__init__()
        # on the CPU whatever device the model is built on (on the meta device, torch's arange would import
        # its compiler stack: seconds)
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos and sin [..., dim] of each position; the ops' `qk_norm_rotary` applies them."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], -1)
        return emb.cos(), emb.sin()


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int, ops: Ops):
        super().__init__()
        self.ops = ops
        self.gate_up, self.down = frozen_param(2 * inner, hidden), frozen_param(hidden, inner)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The residual stream plus the MLP's output."""
        return self.ops.proj_add(self.ops.swiglu_proj(x, self.gate_up), self.down, residual)
