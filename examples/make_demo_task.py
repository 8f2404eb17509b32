"""Writes examples/demo-task.parquet: questions of the demo model's task (kevscore.demo.task) that it did
not see in training, with the expected answer of each. Run: python examples/make_demo_task.py

Columns: doc_id, question_id, document, question (what `kevscore run` reads), expected ("Yes" / "No")
and family (mention / number), which kevscore ignores and carries nowhere; compare `expected` with the
output's `prediction` by `row` (or `question_id`).
"""
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kevscore.demo.task import examples
from kevscore.demo.train import EXAMPLES_SEED, SHIPPED_FAMILIES

HERE = Path(__file__).parent
ROWS, PER_DOCUMENT = 200, 4


def main() -> None:
    rows = examples(ROWS, EXAMPLES_SEED, SHIPPED_FAMILIES, per_document=PER_DOCUMENT)
    doc_ids = {d: f"doc-{i:03d}" for i, d in enumerate(dict.fromkeys(e.document for e in rows))}
    pq.write_table(pa.table({
        "doc_id": [doc_ids[e.document] for e in rows],
        "question_id": [f"q-{i:03d}" for i in range(len(rows))],
        "document": [e.document for e in rows],
        "question": [e.question for e in rows],
        "expected": [e.answer for e in rows],
        "family": [e.family for e in rows],
    }), HERE / "demo-task.parquet")


if __name__ == "__main__":
    main()
