"""Writes examples/questions.parquet (one-file form) and the two-file pair. Run: python examples/make_examples.py"""
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).parent
DOCS = {
    "market": "We walked to the market before breakfast. The baker had fresh bread, warm rolls and apple pies. "
              "My sister bought coffee, milk, eggs and a bag of oranges.",
    "train": "The morning train to the city was late again. The conductor said a tree had fallen on the line "
             "near the river, and the passengers waited forty minutes in the rain.",
    "garden": "In spring the garden is full of tulips and roses. Every evening my grandfather waters the "
              "tomatoes, and on Sundays he cuts the grass before lunch.",
    "meeting": "The team meeting moved to Thursday at ten. Anna will present the budget, and Tom will explain "
               "why the new office opens in March instead of January.",
    "trip": "Last summer we drove to the mountains. We stayed in a small cabin by a lake, went fishing every "
            "morning and saw a family of deer near the road.",
    "recipe": "To make the soup, cut two onions and three carrots, cook them in butter, add water and salt, "
              "and let everything simmer for half an hour.",
}
QUESTIONS = {
    "market": ["Does the document mention bread?", "Did someone buy coffee?", "Is the market closed?"],
    "train": ["Was the train late?", "Did a tree fall on the line?", "Was it sunny?"],
    "garden": ["Are there roses in the garden?", "Does the grandfather water the tomatoes?"],
    "meeting": ["Is the meeting on Monday?", "Will Anna present the budget?", "Does the office open in March?"],
    "trip": ["Did they stay in a hotel?", "Did they see deer?"],
    "recipe": ["Does the soup need onions?", "Should the soup simmer for two hours?"],
}


def main() -> None:
    rows = [(d, f"{d}-{i}", q) for d, qs in QUESTIONS.items() for i, q in enumerate(qs)]
    pq.write_table(pa.table({
        "doc_id": [d for d, _, _ in rows], "question_id": [q for _, q, _ in rows],
        "document": [DOCS[d] for d, _, _ in rows], "question": [q for _, _, q in rows],
    }), HERE / "questions.parquet")
    pq.write_table(pa.table({"doc_id": [d for d, _, _ in rows], "question_id": [q for _, q, _ in rows],
                             "question": [q for _, _, q in rows]}), HERE / "two-file" / "questions.parquet")
    pq.write_table(pa.table({"doc_id": list(DOCS), "document": list(DOCS.values())}),
                   HERE / "two-file" / "documents.parquet")


if __name__ == "__main__":
    main()
