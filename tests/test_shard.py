"""Splitting a job by document over ranks: deterministic, balanced, and the shards add up to the whole."""
import random
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kevscore.job.options import RunOptions
from kevscore.job.run import run_job
from kevscore.job.shard import assign_documents

EXAMPLES = Path(__file__).parent.parent / "examples"


def document_costs(doc_keys: Sequence[str], documents: Sequence[str], questions: Sequence[str]) -> dict[str, int]:
    """Document key -> its text's length plus its questions' lengths (what InputScan.costs gives a job)."""
    costs: dict[str, int] = {}
    for key, doc, question in zip(doc_keys, documents, questions):
        costs[key] = costs.get(key, len(doc)) + len(question)
    return costs


def rank_loads(costs: dict[str, int], assignment: dict[str, int], world: int) -> list[int]:
    loads = [0] * world
    for key, rank in assignment.items():
        loads[rank] += costs[key]
    return loads


def shard_rows(doc_keys: Sequence[str], documents: Sequence[str], questions: Sequence[str],
               rank: int, world: int) -> list[int]:
    """Positions of the rows whose documents `rank` of `world` scores, in input order."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in 0..{world - 1}")
    assignment = assign_documents(document_costs(doc_keys, documents, questions), world)
    return [i for i, key in enumerate(doc_keys) if assignment[key] == rank]


def random_costs(n, seed):
    rng = random.Random(seed)
    return {f"doc-{i}": rng.randrange(1, 5000) for i in range(n)}


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_assignment_is_balanced_and_deterministic(world):
    costs = random_costs(500, world)
    a = assign_documents(costs, world)
    assert set(a) == set(costs) and set(a.values()) == set(range(world))
    shuffled = dict(random.Random(1).sample(list(costs.items()), len(costs)))
    assert assign_documents(shuffled, world) == a  # the order documents are met in does not matter
    loads = rank_loads(costs, a, world)
    assert max(loads) - min(loads) <= max(costs.values())  # greedy largest-first bound
    assert max(loads) <= 1.05 * sum(loads) / world


def test_a_document_never_splits_and_every_row_is_kept_once():
    keys = ["a", "b", "a", "c", "b", "a", "d"]
    docs = [k * 40 for k in keys]
    questions = ["q" * (i + 1) for i in range(len(keys))]
    parts = [shard_rows(keys, docs, questions, r, 3) for r in range(3)]
    assert sorted(i for p in parts for i in p) == list(range(len(keys)))
    for p in parts:
        assert p == sorted(p)
        other = [i for q in parts if q is not p for i in q]
        assert not {keys[i] for i in p} & {keys[i] for i in other}
    assert document_costs(keys, docs, questions)["a"] == 40 + 1 + 3 + 6
    with pytest.raises(ValueError):
        shard_rows(keys, docs, questions, 3, 3)


def run_shards(tmp_path, world, **opts):
    full = run_job(RunOptions(input=EXAMPLES / "questions.parquet", output=tmp_path / "full.parquet", device="cpu",
                              **opts))
    parts = []
    for rank in range(world):
        out = tmp_path / f"part{rank}.parquet"
        run_job(RunOptions(input=EXAMPLES / "questions.parquet", output=out, device="cpu", shard=(rank, world), **opts))
        parts.append(pq.read_table(out))
    assert all(p.num_rows > 0 for p in parts)
    return pq.read_table(full.output), pa.concat_tables(parts).sort_by("row")


def test_batch_invariant_shards_equal_the_single_process_output_exactly(tmp_path):
    full, merged = run_shards(tmp_path, 2, batch_invariant=True)
    assert merged.num_rows == pq.read_metadata(EXAMPLES / "questions.parquet").num_rows
    assert merged.equals(full)


def test_batched_shards_differ_from_one_process_only_in_last_bits(tmp_path):
    """With batching, a row's fp32 result depends on its batch-mates at the 1e-7 level (the GEMM's row
    blocking): every column but the probabilities is equal, and they agree to 1e-6."""
    full, merged = run_shards(tmp_path, 3)
    for name in ("row", "doc_id", "question_id", "labels", "prediction"):
        assert merged.column(name).equals(full.column(name))
    for a, b in zip(merged.column("probs").to_pylist(), full.column("probs").to_pylist()):
        assert a == pytest.approx(b, abs=1e-6)
