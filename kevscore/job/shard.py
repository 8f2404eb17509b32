"""Splitting one job over ranks by document: every rank computes the same assignment from the input alone.

A document's rows all go to one rank (its bank entry lives there). The cost of a document is estimated
from the input text, without tokenizing: its length plus the lengths of all its questions, in characters
(tokens are roughly proportional; the estimate only has to balance). Documents are assigned largest first
to the least-loaded rank (ties: the lower rank), with ties between documents broken by their key, so the
result depends on nothing but the input and the world size.
"""
from __future__ import annotations

import heapq


def assign_documents(costs: dict[str, int], world: int) -> dict[str, int]:
    """Document key -> rank, balancing the summed cost per rank (greedy, largest first); `world` at least 1
    (job.run.shard_documents checks the rank it asks for is in the world)."""
    loads = [(0, rank) for rank in range(world)]
    out: dict[str, int] = {}
    for key in sorted(costs, key=lambda k: (-costs[k], k)):
        load, rank = heapq.heappop(loads)
        out[key] = rank
        heapq.heappush(loads, (load + costs[key], rank))
    return out
