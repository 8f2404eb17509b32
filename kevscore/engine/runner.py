"""The runner owns the device side: the model, the bank, upload buffers; it prefills and scores batches.

A scoring batch travels as one int64 upload buffer [R, T + 3] whose columns are the branch token ids,
then the row's bank slot, the offset of its last real token and its document length. Everything the
forward needs is derived from that buffer on the device (`branch_inputs`), so a CUDA graph captured
over a static buffer replays any batch of its shape after a single host-to-device copy.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from kevscore.engine.bank import StateBank
from kevscore.engine.plan import Batch, eager_tokens
from kevscore.kernels.gdr_ref import CHUNK
from kevscore.model.kev import KevModel
from kevscore.model.layers.common import BranchContext, PrefillContext

SLOT, LAST, PLEN = 0, 1, 2  # metadata columns after the T token columns
PAD_WASTE = 1.25  # a prefill group's attention pads its documents to the longest while that adds at most 25%


def fill_upload(buf: torch.Tensor, length: int, branches: Sequence[Sequence[int]], slots: Sequence[int],
                prefix_lens: Sequence[int], pad_id: int) -> None:
    """Write real rows into the front of host buffer `buf` [R, length + 3]; padding rows repeat row 0.
    Filled through a numpy view: under CUDA graphs this runs while the GPU waits, so it is kept cheap."""
    arr = buf.numpy()
    n = len(branches)
    arr[:n, :length] = pad_id
    for i, ids in enumerate(branches):
        arr[i, : len(ids)] = ids
    arr[:n, length + SLOT] = slots
    arr[:n, length + LAST] = [len(ids) - 1 for ids in branches]
    arr[:n, length + PLEN] = prefix_lens
    arr[n:] = arr[0]


def branch_inputs(buf: torch.Tensor, length: int, prefix: int | None, bank: StateBank, path: str):
    """(ids, context, last) for a device upload buffer; only device ops, so it can be graph-captured.
    `prefix` None: no [R, prefix] K/V index (a backend that reads the documents' K/V in place)."""
    slots = buf[:, length + SLOT]  # a strided column: the indexed scan reads it in place
    plen = buf[:, length + PLEN]
    kv_start = bank.start[slots]
    kv_index = kv_mask = None
    if prefix is not None:
        steps = torch.arange(max(prefix, 1), device=buf.device)
        kv_mask = steps[None, :] < plen[:, None]
        kv_index = torch.where(kv_mask, kv_start[:, None] + steps, 0)
    positions = plen[:, None] + torch.arange(length, device=buf.device)
    ctx = BranchContext(positions=positions, slots=slots, kv_index=kv_index, kv_mask=kv_mask,
                        kv_start=kv_start, kv_len=plen, path=path)
    return buf[:, :length], ctx, buf[:, length + LAST]


def prefill_inputs(docs: Sequence[Sequence[int]], slots: Sequence[int], bank: StateBank, device, conv_width: int):
    """(ids [1, N], context) of documents packed in one sequence. Every index is computed here on the host
    and uploaded from pinned memory without waiting, so the layers never synchronize with the GPU."""
    lens = torch.tensor([len(d) for d in docs], dtype=torch.int64)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    starts = cu[:-1]
    chunks = (lens + CHUNK - 1) // CHUNK
    doc_of_chunk = torch.repeat_interleave(torch.arange(len(docs)), chunks)
    chunk_in_doc = torch.arange(int(chunks.sum())) - torch.repeat_interleave(chunks.cumsum(0) - chunks, chunks)
    tail = cu[1:, None] - conv_width + torch.arange(conv_width)
    doc_of_token = torch.repeat_interleave(torch.arange(len(docs)), lens)
    positions = torch.arange(int(cu[-1])) - starts[doc_of_token]
    entry_start = torch.tensor([bank.entry_start(s) for s in slots], dtype=torch.int64)
    longest = int(lens.max())
    host = {"ids": torch.cat([torch.as_tensor(d, dtype=torch.int64) for d in docs]),
            "cu_seqlens": cu.to(torch.int32), "cu_seqlens_long": cu,
            "chunk_indices": torch.stack([doc_of_chunk, chunk_in_doc], 1),
            "tail_index": tail.clamp(min=0), "tail_valid": tail >= starts[:, None],
            "slots": torch.tensor(list(slots), dtype=torch.int64),
            "kv_slots": entry_start[doc_of_token] + positions, "positions": positions}
    if len(docs) * longest <= PAD_WASTE * int(cu[-1]):  # attention may run on a padded [D, L] batch
        steps = torch.arange(longest)
        host["pad_index"] = torch.where(steps < lens[:, None], starts[:, None] + steps, 0)
        host["unpad_index"] = doc_of_token * longest + positions
    dev = dict(zip(host, upload_together(list(host.values()), torch.device(device))))
    ids = dev.pop("ids")
    return ids[None], PrefillContext(**dev, max_len=longest)


class EagerRunner:
    """Runs the model eagerly (the CPU path, and the GPU path under --eager)."""

    prefill_tokens = 8192  # document tokens per prefill group (the GPU runner sizes its own from memory)

    def __init__(self, model: KevModel, bank: StateBank, pad_id: int):
        self.model, self.bank, self.pad_id = model, bank, pad_id
        self.device = bank.state.device
        # batches of this many padded tokens or more are planned at their own shape (engine.plan.plan_batches); on a
        # GPU smaller ones keep their buckets, the shapes the warm-up builds kernels for and a graph's key; a CPU
        # needs neither
        layer_weights = sum(p.numel() for p in model.layers.parameters() if p.dim() == 2) / len(model.layers)
        self.exact_from = 0 if self.device.type == "cpu" else eager_tokens(layer_weights)
        model.attach_bank(bank)

    def prefill(self, docs: Sequence[Sequence[int]], slots: Sequence[int]) -> None:
        for d, s in zip(docs, slots):
            if not d:  # a document with no tokens leaves the state where the model starts
                self.bank.state[:, s].zero_()
                self.bank.conv[:, s].zero_()
        if real := [(d, s) for d, s in zip(docs, slots) if d]:
            self.model.prefill(*prefill_inputs(*zip(*real), self.bank, self.device, self.model.cfg.conv_state_len))

    def upload(self, batch: Batch, branches, slots, prefix_lens) -> torch.Tensor:
        """The batch's host upload buffer; pinned for a GPU, so that its copy does not wait for the GPU's queue."""
        buf = torch.empty(batch.size, batch.length + 3, dtype=torch.long, pin_memory=self.device.type == "cuda")
        fill_upload(buf, batch.length, branches, slots, prefix_lens, self.pad_id)
        return buf

    def forward(self, buf: torch.Tensor, batch: Batch, path: str) -> torch.Tensor:
        """The model on a device upload buffer: hidden states at every row's last token [R, H], or at its last
        `batch.scored` tokens [R * scored, H] (row by row; positions before the row's start repeat its first)."""
        prefix = batch.prefix if self.model.ops.GATHERS_KV else None
        ids, ctx, last = branch_inputs(buf, batch.length, prefix, self.bank, path)
        if batch.scored > 1:
            last = (last[:, None] + torch.arange(1 - batch.scored, 1, device=buf.device)).clamp(min=0)
        return self.model.branch(ids, ctx, last)

    def score(self, batch: Batch, branches, slots, prefix_lens, path: str) -> torch.Tensor:
        """Final-normed hidden states at each real row's scored positions: [len(branches) * batch.scored, H]
        fp32."""
        buf = self.upload(batch, branches, slots, prefix_lens).to(self.device, non_blocking=True)
        return self.forward(buf, batch, path)[: len(branches) * batch.scored].float()

    def label_scores(self, hidden: torch.Tensor, label_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(label logits [n, L] fp32 padded with -inf, log-sum-exp over the vocabulary [n])."""
        head = self.model.lm_head
        width = max(len(ids) for ids in label_ids)
        # through pinned memory without waiting: a plain host tensor's copy would first wait for the GPU to
        # finish the batch, and then each op below would launch onto an idle GPU
        idx, pad = upload_together([torch.tensor([ids + [ids[0]] * (width - len(ids)) for ids in label_ids]),
                                    torch.tensor([[j >= len(ids) for j in range(width)] for ids in label_ids])],
                                   hidden.device)
        lse = torch.logsumexp(torch.nn.functional.linear(hidden.to(head.dtype), head).float(), -1)
        return torch.einsum("nh,nlh->nl", hidden.float(), head[idx].float()).masked_fill(pad, float("-inf")), lse

    def token_scores(self, hidden: torch.Tensor, at: list[int], which: list[int], tokens: list[int]) -> torch.Tensor:
        """[len(tokens) + len(at)] fp32: the logit of each `tokens[q]` at hidden row `at[which[q]]`, then the
        log-sum-exp over the vocabulary at each hidden row of `at`."""
        head = self.model.lm_head
        at_t, which_t, tokens_t = upload_together([torch.tensor(x) for x in (at, which, tokens)], hidden.device)
        h = hidden[at_t]
        lse = torch.logsumexp(torch.nn.functional.linear(h.to(head.dtype), head).float(), -1)
        return torch.cat([(h[which_t].float() * head[tokens_t].float()).sum(-1), lse])


def upload_together(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The tensors on `device` as views of one buffer, each 16-byte aligned: one host buffer (pinned for a GPU, so
    the copy does not wait for the GPU's queue) and one copy, rather than an allocation and a copy each."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    starts = list(itertools.accumulate(((size + 15) // 16 * 16 for size in sizes), initial=0))
    host = torch.empty(starts[-1], dtype=torch.uint8, pin_memory=device.type == "cuda")
    for t, start, size in zip(tensors, starts, sizes):
        host[start:start + size].view(t.dtype).view(t.shape).copy_(t)
    buf = host.to(device, non_blocking=True)
    return [buf[start:start + size].view(t.dtype).view(t.shape) for t, start, size in zip(tensors, starts, sizes)]
