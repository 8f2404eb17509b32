"""The state bank: one preallocated set of tensors holding every document entry of a wave.

An entry is what the model needs to continue from a document, as its layers declare it (`BANK` of each
layer, `kevscore.model.kev.bank_tensors`): per DeltaNet layer its final recurrent state (fp32) and conv state
(the last k-1 conv inputs), per attention layer the K/V of every document token. Tensors without a token
axis are indexed by entry slot; those with one form a token pool where each entry owns a contiguous range.
The tensors are allocated once, so their addresses never change.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kevscore.errors import KevscoreError, first_line
from kevscore.model.config import KevConfig
from kevscore.model.kev import bank_tensors


@dataclass(frozen=True, slots=True)
class BankLayout:
    entries: int
    tokens: int

    @staticmethod
    def bytes(cfg: KevConfig, dtype: torch.dtype, per_token: bool) -> int:
        """Bytes, all layers, of an entry's fixed-size tensors (those without a token axis), or `per_token`:
        of the token pool's tensors per document token."""
        return sum(layers * math.prod(t.shape(cfg)) * t.dtype(dtype).itemsize
                   for t, layers in bank_tensors(cfg) if (t.token_axis is not None) == per_token)

    @classmethod
    def plan(cls, cfg: KevConfig, dtype: torch.dtype, doc_tokens: list[int], budget: int,
             capacity: int | None = None) -> "BankLayout":
        """Room for every document when `budget` bytes allow it, else for as many as fit (waves);
        `capacity` fixes the entry count. The token pool always holds at least the longest document."""
        n, total, longest = len(doc_tokens), sum(doc_tokens), max(doc_tokens, default=1)
        per_entry, per_token = cls.bytes(cfg, dtype, False), max(cls.bytes(cfg, dtype, True), 1)
        if capacity is None and n * per_entry + total * per_token <= budget:
            return cls(max(n, 1), max(total, 1))
        mean = 1.25 * total / max(n, 1)  # token room per entry, with slack for longer documents
        entries = capacity or max(1, int(budget // (per_entry + mean * per_token)))
        return cls(entries, max(longest, int(entries * mean), 1))


class StateBank:
    """One attribute per declared tensor (`state`, `conv`, `kv` for Kev): [layers, entries, *dims], or for a
    tensor with a token axis [layers, *dims] with the pool's tokens on that axis."""

    def __init__(self, cfg: KevConfig, layout: BankLayout, device, dtype: torch.dtype):
        self.layout = layout
        self.declared = [t for t, _ in bank_tensors(cfg)]
        try:
            for t, layers in bank_tensors(cfg):
                shape = t.shape(cfg, layout.tokens) if t.token_axis is not None else (layout.entries, *t.shape(cfg))
                setattr(self, t.name, torch.zeros(layers, *shape, dtype=t.dtype(dtype), device=device))
        except RuntimeError as exc:  # out of memory (torch.OutOfMemoryError on a GPU): a --bank-capacity too large
            raise KevscoreError(f"a state bank of {layout.entries:,} entries does not fit in the memory of {device}; "
                                f"lower --bank-capacity ({first_line(exc)})") from exc
        self.start = torch.zeros(layout.entries, dtype=torch.long, device=device)  # first K/V token slot
        self.reset()

    def reset(self) -> None:
        """Start a new wave: every entry becomes free (the tensors keep their addresses)."""
        self.used_entries, self.used_tokens = 0, 0
        self._starts: list[int] = []

    def alloc(self, length: int) -> int:
        """Reserve an entry for a document of `length` tokens; returns its slot."""
        if self.used_entries >= self.layout.entries or self.used_tokens + length > self.layout.tokens:
            raise KevscoreError(f"state bank full: a {length}-token document does not fit ({self.layout.entries} "
                                f"entries, {self.layout.tokens} K/V tokens); raise --bank-capacity")
        self._starts.append(self.used_tokens)
        self.used_entries += 1
        self.used_tokens += length
        return self.used_entries - 1  # the slot

    def entry_start(self, slot: int) -> int:
        return self._starts[slot]

    def publish(self) -> None:
        """Copy the entries' first K/V token slots to the device table (once per wave, before scoring)."""
        self.start[:self.used_entries].copy_(torch.tensor(self._starts, dtype=torch.long))

    def entry(self, slot: int, length: int) -> dict[str, torch.Tensor]:
        """Views of entry `slot` (a document of `length` tokens) in every tensor, shaped as an entry file holds
        them: [layers, *dims], the token axis `length` long."""
        return {t.name: getattr(self, t.name)[:, slot] if t.token_axis is None
                else getattr(self, t.name).narrow(1 + t.token_axis, self._starts[slot], length) for t in self.declared}

    def used(self) -> list[torch.Tensor]:
        """Views of the wave's region: every tensor's entries in use (its pool's tokens in use, for one with a token
        axis), then the start table's (a snapshot of them shows that scoring leaves the bank as prefill made it)."""
        return [getattr(self, t.name)[:, :self.used_entries] if t.token_axis is None
                else getattr(self, t.name).narrow(1 + t.token_axis, 0, self.used_tokens) for t in self.declared
                ] + [self.start[:self.used_entries]]
