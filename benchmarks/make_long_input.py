"""Write a large synthetic input for long-job runs and tests: deterministic short documents and questions.

    python benchmarks/make_long_input.py long.parquet --rows 100000 --docs 10000
    python benchmarks/make_long_input.py long.parquet --rows 20000 --docs 2000 --order shuffled

Every document gets rows/docs questions (the first rows % docs documents one more). `--order` decides where
a document's rows sit in the file: `grouped` (all rows of a document together, documents in order: the
fastest input for `kevscore run`), `interleaved` (round-robin over the documents: every window's rows
are spread over the whole file) or `shuffled` (a seeded random permutation). The text is made of common
English words, so any tokenizer splits it into roughly one token per word. With `--documents FILE` the
documents go to FILE (doc_id, document) and the questions file holds doc_id (the two-file form).
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

WORDS = ("the a of and to in is was for on that with as by at from it his her they this be are were an "
         "market river garden train city house water light night morning people letter road field school "
         "music story doctor winter summer bridge window table paper friend family village mountain "
         "open closed early late small large green old new quiet busy cold warm long short").split()
QUESTIONS = ("Is the {w} mentioned?", "Does the text talk about {w}?", "Was the {w} {v}?",
             "Is it about a {v} {w}?", "Does the story happen near the {w}?")


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def make(rows: int, docs: int, doc_words: int, question_words: int, order: str, seed: int):
    """(documents, row doc indices, questions), all deterministic in seed."""
    rng = random.Random(seed)
    texts = [" ".join(sentence(rng, max(3, doc_words // 4)) for _ in range(4)) for _ in range(docs)]
    owners = [i % docs for i in range(rows)]  # round-robin: interleaved
    if order == "grouped":
        owners.sort()
    elif order == "shuffled":
        rng.shuffle(owners)
    questions = []
    for _ in range(rows):
        q = rng.choice(QUESTIONS).format(w=rng.choice(WORDS[25:]), v=rng.choice(WORDS[-10:]))
        extra = max(0, question_words - len(q.split()))
        questions.append(q if not extra else f"{sentence(rng, extra)} {q}")
    return texts, owners, questions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("output", type=Path, help="questions Parquet to write")
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--docs", type=int, default=10_000)
    ap.add_argument("--doc-words", type=int, default=48, help="words per document (about tokens)")
    ap.add_argument("--question-words", type=int, default=8, help="words per question, at least")
    ap.add_argument("--order", choices=("grouped", "interleaved", "shuffled"), default="grouped")
    ap.add_argument("--documents", type=Path, help="write the two-file form: documents go here")
    ap.add_argument("--row-group-size", type=int, default=8192, help="Parquet row group size")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    texts, owners, questions = make(args.rows, args.docs, args.doc_words, args.question_words, args.order, args.seed)
    doc_ids = [f"d{d:07d}" for d in owners]
    cols = {"doc_id": doc_ids, "question_id": [f"q{i:08d}" for i in range(args.rows)], "question": questions}
    if args.documents is None:
        cols["document"] = [texts[d] for d in owners]
    else:
        pq.write_table(pa.table({"doc_id": [f"d{d:07d}" for d in range(args.docs)], "document": texts}),
                       args.documents, row_group_size=args.row_group_size)
    pq.write_table(pa.table(cols), args.output, row_group_size=args.row_group_size)
    print(f"{args.output}: {args.rows:,} rows, {args.docs:,} documents, order {args.order}")


if __name__ == "__main__":
    main()
