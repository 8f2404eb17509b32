"""The state bank: one preallocated set of tensors holding every document entry of a wave.

An entry is what the model needs to continue from a document: per DeltaNet layer its final recurrent
state (fp32) and conv state (the last k-1 conv inputs), per attention layer the K/V of every document
token. Recurrent and conv states are indexed by entry slot; K/V live in a token pool where each entry
owns a contiguous range. The tensors are allocated once, so their addresses never change.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from kevscore.config import KevConfig
from kevscore.errors import KevscoreError


@dataclass(frozen=True, slots=True)
class BankLayout:
    entries: int
    tokens: int

    @staticmethod
    def entry_bytes(cfg: KevConfig, dtype: torch.dtype) -> int:
        nd, item = len(cfg.delta_layers), torch.empty(0, dtype=dtype).element_size()
        state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        conv = cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * item
        return nd * (state + conv)

    @staticmethod
    def token_bytes(cfg: KevConfig, dtype: torch.dtype) -> int:
        item = torch.empty(0, dtype=dtype).element_size()
        return len(cfg.attn_layers) * 2 * cfg.num_key_value_heads * cfg.head_dim * item

    @classmethod
    def plan(cls, cfg: KevConfig, dtype: torch.dtype, doc_tokens: list[int], budget: int,
             capacity: int | None = None) -> "BankLayout":
        """Room for every document when `budget` bytes allow it, else for as many as fit (waves);
        `capacity` fixes the entry count. The token pool always holds at least the longest document."""
        n, total, longest = len(doc_tokens), sum(doc_tokens), max(doc_tokens, default=1)
        per_entry, per_token = cls.entry_bytes(cfg, dtype), max(cls.token_bytes(cfg, dtype), 1)
        if capacity is None and n * per_entry + total * per_token <= budget:
            return cls(max(n, 1), max(total, 1))
        mean = 1.25 * total / max(n, 1)  # token room per entry, with slack for longer documents
        entries = capacity or max(1, int(budget // (per_entry + mean * per_token)))
        return cls(entries, max(longest, int(entries * mean), 1))


class StateBank:
    def __init__(self, cfg: KevConfig, layout: BankLayout, device, dtype: torch.dtype):
        nd, na = len(cfg.delta_layers), len(cfg.attn_layers)
        hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        width = cfg.linear_conv_kernel_dim - 1
        self.layout = layout
        self.state = torch.zeros(nd, layout.entries, hv, dk, dv, dtype=torch.float32, device=device)
        self.conv = torch.zeros(nd, layout.entries, cfg.conv_dim, width, dtype=dtype, device=device)
        self.kv = torch.zeros(na, 2, layout.tokens, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=device)
        self.start = torch.zeros(layout.entries, dtype=torch.long, device=device)  # first K/V token slot
        self.length = torch.zeros(layout.entries, dtype=torch.long, device=device)
        self.reset()

    def reset(self) -> None:
        """Start a new wave: every entry becomes free (the tensors keep their addresses)."""
        self.used_entries, self.used_tokens = 0, 0
        self._starts: list[int] = []
        self._lengths: list[int] = []

    def fits(self, entries: int, tokens: int) -> bool:
        return (self.used_entries + entries <= self.layout.entries
                and self.used_tokens + tokens <= self.layout.tokens)

    def alloc(self, length: int) -> int:
        """Reserve an entry for a document of `length` tokens; returns its slot."""
        if not self.fits(1, length):
            raise KevscoreError(
                f"state bank full: a {length}-token document does not fit "
                f"({self.layout.entries} entries, {self.layout.tokens} K/V tokens); raise --bank-capacity")
        slot = self.used_entries
        self._starts.append(self.used_tokens)
        self._lengths.append(length)
        self.used_entries += 1
        self.used_tokens += length
        return slot

    def entry_start(self, slot: int) -> int:
        return self._starts[slot]

    def publish(self) -> None:
        """Copy the host allocation tables to the device tables (once per wave, before scoring)."""
        n = self.used_entries
        self.start[:n].copy_(torch.tensor(self._starts, dtype=torch.long))
        self.length[:n].copy_(torch.tensor(self._lengths, dtype=torch.long))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"state": self.state, "conv": self.conv, "kv": self.kv}

    def checksum(self) -> str:
        """SHA-256 over the bytes of every bank tensor (copied to the host)."""
        digest = hashlib.sha256()
        for t in self.tensors().values():
            digest.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
        return digest.hexdigest()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())
