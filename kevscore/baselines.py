"""The transformers baselines kevscore is measured against: naive and prefix-cached scoring.

The transformers baselines kevscore is measured against, written as a careful user would with
transformers' own `Qwen3_5ForCausalLM` (`kevscore.reference.reference_model`):

- `naive`: each row's full `document + question` sequence, rows sorted by length and right-padded in
  batches, logits at each row's last real token;
- `prefix-cached`: each document run once into a `DynamicCache`, then its questions continued in batches
  from a copy of that cache expanded to the batch, right-padded.

Right padding is safe: attention is causal and DeltaNet recurrent, so real positions never see padding.
Each `*_call` prepares its batches on the device and returns a call that runs the model and gives the
label logits `[rows, labels]` fp32 on the device, in the order of `rows` (-inf past a row's own labels).
Timing is the caller's."""
from __future__ import annotations

import copy
import inspect
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


def _batch(seqs: list[list[int]], labels: list[list[int]], out: list[int], past: int, width: int,
           device: torch.device) -> Batch:
    lengths = torch.tensor([len(s) for s in seqs])
    t = int(lengths.max())
    mask = None
    if int(lengths.min()) < t:
        real = (torch.arange(t) < lengths[:, None]).long()
        mask = torch.cat([torch.ones(len(seqs), past, dtype=torch.long), real], 1).to(device)
    ids = torch.tensor([s + [0] * (t - len(s)) for s in seqs], device=device)
    padded = [lab + [lab[0]] * (width - len(lab)) for lab in labels]
    extra = torch.tensor([[j >= len(lab) for j in range(width)] for lab in labels], device=device)
    return Batch(ids, mask, torch.arange(len(seqs), device=device), (lengths - 1).to(device),
                 torch.tensor(padded, device=device), extra, torch.tensor(out, device=device))


def _label_logits(model, b: Batch, cache_kw: dict) -> torch.Tensor:
    hidden = model.model(input_ids=b.ids, attention_mask=b.mask, use_cache=bool(cache_kw), **cache_kw)
    logits = model.lm_head(hidden.last_hidden_state[b.rows, b.last]).float()
    return logits.gather(1, b.labels).masked_fill(b.extra, float("-inf"))


def _rows(enc: Encoded, rows: Sequence[int] | None) -> list[int]:
    return list(range(len(enc))) if rows is None else list(rows)


def naive_call(model, enc: Encoded, device: torch.device | str, batch: int,
               rows: Sequence[int] | None = None) -> Call:
    """Each row's `document + question` through the model, `batch` rows a forward (sorted by length)."""
    device, rows = torch.device(device), _rows(enc, rows)
    seqs = [enc.prefixes[enc.row_prefix[r]] + enc.branches[r] for r in rows]
    width = max(len(enc.label_ids[r]) for r in rows)
    batches = [_batch([seqs[i] for i in g], [enc.label_ids[rows[i]] for i in g], g, 0, width, device)
               for g in length_batches([len(s) for s in seqs], batch)]

    @torch.no_grad()
    def call() -> torch.Tensor:
        out = torch.empty(len(rows), width, device=device)
        for b in batches:
            out[b.out] = _label_logits(model, b, {})
        return out

    return call


def cache_keyword(model) -> str:
    """The forward's cache argument: `cache` from transformers 5.2x, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"


def prefix_cached_call(model, enc: Encoded, device: torch.device | str, batch: int,
                       rows: Sequence[int] | None = None) -> Call:
    """Each document once into a `DynamicCache`, then its questions `batch` at a time from a copy of it."""
    from transformers import DynamicCache

    device, rows = torch.device(device), _rows(enc, rows)
    keyword = cache_keyword(model)
    width = max(len(enc.label_ids[r]) for r in rows)
    by_doc: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_doc.setdefault(enc.row_prefix[r], []).append(i)
    plan = []
    for d, members in by_doc.items():
        groups = length_batches([len(enc.branches[rows[i]]) for i in members], batch)
        batches = [_batch([enc.branches[rows[members[j]]] for j in g], [enc.label_ids[rows[members[j]]] for j in g],
                          [members[j] for j in g], len(enc.prefixes[d]), width, device) for g in groups]
        plan.append((torch.tensor([enc.prefixes[d]], device=device), batches))

    @torch.no_grad()
    def call() -> torch.Tensor:
        out = torch.empty(len(rows), width, device=device)
        for doc, batches in plan:
            cache = DynamicCache(config=model.config)
            model.model(input_ids=doc, use_cache=True, **{keyword: cache})
            for k, b in enumerate(batches):
                rows_cache = cache if k == len(batches) - 1 else copy.deepcopy(cache)
                rows_cache.reorder_cache(torch.zeros_like(b.rows))  # [1] -> [B]: every row from the document
                out[b.out] = _label_logits(model, b, {keyword: rows_cache})
        return out

    return call

