"""The transformers baseline kevscore is measured against: naive scoring, and the batches it is built from.

The naive baseline, written as a careful user would with transformers' own `Qwen3_5ForCausalLM`
(`kevscore.reference.reference_model`): each row's full `document + question` sequence, rows sorted by
length and right-padded in batches, logits at each row's last real token. The prefix-cached baseline
(`benchmarks/bench_job.py`) builds its batches from the same pieces.

Right padding is safe: attention is causal and DeltaNet recurrent, so real positions never see padding.
Each `*_call` prepares its batches on the device and returns a call that runs the model and gives the
label logits `[rows, labels]` fp32 on the device, in the order of `rows` (-inf past a row's own labels).
Timing is the caller's."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kevscore.model.prompt import Encoded

Call = Callable[[], torch.Tensor]


@dataclass(slots=True)
class Batch:
    """Rows of one forward, right-padded, and where their label logits go."""
    ids: torch.Tensor  # [B, T] token ids, right-padded with 0
    mask: torch.Tensor | None  # [B, past + T] 1 at cached and real tokens; None when no row is padded
    rows: torch.Tensor  # [B] 0..B-1
    last: torch.Tensor  # [B] offset of each row's last real token in ids
    labels: torch.Tensor  # [B, L] label token ids (the row's first repeated past its own)
    extra: torch.Tensor  # [B, L] True past the row's own labels
    out: torch.Tensor  # [B] the rows' places in the result


def length_batches(lengths: Sequence[int], batch: int) -> list[list[int]]:
    """Indices of `lengths`, longest first, in groups of at most `batch` (least padding for the group count)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i:i + batch] for i in range(0, len(order), batch)]


def padded_batch(seqs: list[list[int]], labels: list[list[int]], out: list[int], past: int, width: int,
                 device: torch.device) -> Batch:
    """`seqs` right-padded into one forward after `past` cached tokens, their labels padded to `width`."""
    lengths = torch.tensor([len(s) for s in seqs])
    t, mask = int(lengths.max()), None  # no mask when no row is padded
    if int(lengths.min()) < t:
        real = (torch.arange(t) < lengths[:, None]).long()
        mask = torch.cat([torch.ones(len(seqs), past, dtype=torch.long), real], 1).to(device)
    ids = torch.tensor([s + [0] * (t - len(s)) for s in seqs], device=device)
    padded = [lab + [lab[0]] * (width - len(lab)) for lab in labels]
    extra = torch.tensor([[j >= len(lab) for j in range(width)] for lab in labels], device=device)
    return Batch(ids, mask, torch.arange(len(seqs), device=device), (lengths - 1).to(device),
                 torch.tensor(padded, device=device), extra, torch.tensor(out, device=device))


def label_logits(model, b: Batch, cache_kw: dict) -> torch.Tensor:
    """The batch's label logits `[B, width]` fp32 (-inf past a row's own labels), with `cache_kw` as cache."""
    hidden = model.model(input_ids=b.ids, attention_mask=b.mask, use_cache=bool(cache_kw), **cache_kw).last_hidden_state
    return model.lm_head(hidden[b.rows, b.last]).float().gather(1, b.labels).masked_fill(b.extra, float("-inf"))


def naive_call(model, enc: Encoded, device: torch.device | str, batch: int, rows: Sequence[int] | None = None) -> Call:
    """Each row's `document + question` through the model, `batch` rows a forward (sorted by length); `rows`: those
    of `enc` (None: all)."""
    device, rows = torch.device(device), list(range(len(enc)) if rows is None else rows)
    seqs = [enc.prefixes[enc.row_prefix[r]] + enc.branches[r] for r in rows]
    width = max(len(enc.label_ids[r]) for r in rows)
    batches = [padded_batch([seqs[i] for i in g], [enc.label_ids[rows[i]] for i in g], g, 0, width, device)
               for g in length_batches([len(s) for s in seqs], batch)]

    @torch.no_grad()
    def call() -> torch.Tensor:
        out = torch.empty(len(rows), width, device=device)
        for b in batches:
            out[b.out] = label_logits(model, b, {})
        return out

    return call
